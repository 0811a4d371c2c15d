"""A real decoder (SmolLM2-135M, configs/sst2-smollm2.yaml) under finetune and under transformers.Trainer + peft.

    HF_HUB_OFFLINE=1 python scripts/bench_decoder.py --rows 16000 --repeats 1 --json runs/bench_decoder.json
    python scripts/bench_decoder.py --rows 960 --repeats 2          # a quick side by side

Each contestant runs in its own child process (so that its peak RSS, `ru_maxrss`, is its own), one
after the other and alternating (A B B A ...), on the same rows with the same hyper-parameters:
- `finetune`: `finetune train --config configs/sst2-smollm2.yaml` (LoRA r 16 on every linear layer,
  the score head in full), evaluation only at the end;
- `minilm`: the same rows through the demo's config (configs/sst2-minilm.yaml, all-MiniLM-L6-v2, full
  fine-tuning), for scale;
- `trainer`: what a Trainer user writes: the same converted SmolLM2 folder, `get_peft_model` with the
  same LoraConfig (task SEQ_CLS: peft trains the score head in full), `datasets.map` tokenization,
  `DataCollatorWithPadding`, TrainingArguments defaults plus the shared hyper-parameters.
samples/s is training time only (finetune: its loop's logged rate; Trainer: on_train_begin ->
on_train_end); accuracy is on the SST-2 dev set (872 rows), both evaluated with the same code.
Report the ratios: the machine is shared and noisy.

The ladder on SmolLM2-135M (docs/MEMORY.md): each rung of LADDER is finetune on the same rows at
`data.max_length` 32 (grouped batches of 16 x 32 tokens are then the planner's worst case), in its own child:

    python scripts/bench_decoder.py --ladder 0 1 2 --rows 480 --ladder-json runs/ladder.json   # appends
    python scripts/bench_decoder.py --ladder-table runs/ladder.json

per rung: peak RSS (`ru_maxrss`), the loop's MemTracker peak (memory.json) against `predict_peak` at the
sampled window's shape, dev accuracy and samples/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CONFIG = ROOT / "configs" / "sst2-smollm2.yaml"


def overrides(out: Path, rows: int, seed: int) -> list[str]:
    return [
        f"run.output_dir={out}",
        "run.overwrite=true",
        f"run.seed={seed}",
        f"data.max_train_samples={rows}",
        "train.eval_every_steps=null",
        f"train.log_every_steps={10**9}",
        "checkpoint.every_steps=null",
    ]


def child_finetune(rows: int, seed: int, config: Path = CONFIG, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    from finetune.core.fileio import read_jsonl
    from finetune.memory import monitor as memory
    from finetune.train import main

    # finetune resets the kernel's high-water mark at every log line (its per-interval peaks), and the reset
    # lowers ru_maxrss too: kept off here so that the child's ru_maxrss is its whole life's peak, as Trainer's is
    memory._reset_vm_hwm = lambda: False

    with tempfile.TemporaryDirectory(prefix="bench-dec-ft-") as tmp:
        run = Path(tmp) / "run"
        assert main(["--config", str(config), *overrides(run, rows, seed), *extra]) == 0
        metrics = read_jsonl(run / "metrics.jsonl")
        last = [r for r in metrics if "samples_per_s" in r][-1]
        acc = json.loads((run / "eval.json").read_text())["accuracy"]
    return {"samples_per_s": last["samples_per_s"], "padding_fraction": last.get("padding_fraction"), "accuracy": acc}


def child_trainer(rows: int, seed: int) -> dict[str, Any]:
    import math

    from bench_vs_trainer import DevSet, _trainer_data, shared_hparams
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import (
        AutoModelForSequenceClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    from finetune.config.files import load_config
    from finetune.model.load import build_tokenizer, resolve_model_path
    from finetune.training.optim import planned_steps

    with tempfile.TemporaryDirectory(prefix="bench-dec-tr-") as tmp:
        cfg = load_config(CONFIG, overrides(Path(tmp) / "unused", rows, seed))
        tokenizer = build_tokenizer(cfg)
        train_ds = _trainer_data(cfg, tokenizer)
        t = cfg.train
        micro, G = int(t.micro_batch_size), t.gradient_accumulation_steps
        total = planned_steps(cfg, math.ceil(len(train_ds) / (micro * G)))[0]
        set_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            resolve_model_path(cfg.model.source or ""), num_labels=2
        )
        model.config.pad_token_id = tokenizer.pad_token_id
        lora = cfg.model.lora
        assert lora is not None
        model = get_peft_model(
            model,
            LoraConfig(
                task_type=TaskType.SEQ_CLS,
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
            ),
        )
        clock: dict[str, float] = {}

        class Clock(TrainerCallback):
            def on_train_begin(self, *a: Any, **k: Any) -> None:
                clock["t0"] = time.perf_counter()

            def on_train_end(self, *a: Any, **k: Any) -> None:
                clock["t1"] = time.perf_counter()

        targs = TrainingArguments(
            output_dir=tmp,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            gradient_accumulation_steps=G,
            **shared_hparams(cfg, total),
        )
        trainer = Trainer(
            model=model,
            args=targs,
            train_dataset=train_ds,
            data_collator=DataCollatorWithPadding(tokenizer),
            callbacks=[Clock()],
        )
        trainer.train()
        real = total_tok = 0
        for batch in trainer.get_train_dataloader():
            real += int(batch["attention_mask"].sum())
            total_tok += batch["attention_mask"].numel()
        acc = DevSet(cfg, tokenizer).accuracy(model)
    return {
        "samples_per_s": len(train_ds) / (clock["t1"] - clock["t0"]),
        "padding_fraction": 1 - real / total_tok,
        "accuracy": acc,
    }


# name -> overrides of configs/sst2-smollm2.yaml; full fine-tuning takes a learning rate for all weights
LADDER: list[tuple[str, list[str]]] = [
    ("full fine-tuning, fp32 (lr 5e-5)", ["model.lora=null", "train.learning_rate=5e-5"]),
    ("LoRA r=16, fp32", []),
    ("LoRA r=16, bf16 autocast", ["precision.mode=bf16"]),
    (
        "full fine-tuning, bf16-true (fp32 norms, lr 5e-5)",
        ["model.lora=null", "precision.mode=bf16-true", "train.learning_rate=5e-5"],
    ),
    ("LoRA r=16, fp32, gradient checkpointing", ["model.gradient_checkpointing=true"]),
    ("QLoRA: 4-bit NF4 base, LoRA r=16", ["model.quantization=4bit"]),
    ("LoRA r=16 on an 8-bit base", ["model.quantization=8bit"]),
]
LADDER_LENGTH = 32


def child_rung(rows: int, seed: int, rung: int) -> dict[str, Any]:
    from finetune.config.files import load_config
    from finetune.core.fileio import read_jsonl
    from finetune.memory import monitor as memory
    from finetune.memory.planner import predict_peak
    from finetune.model.load import build_tokenizer
    from finetune.train import main

    memory._reset_vm_hwm = lambda: False  # as in child_finetune: ru_maxrss is the whole run's
    with tempfile.TemporaryDirectory(prefix="bench-dec-rung-") as tmp:
        run = Path(tmp) / "run"
        over = [*overrides(run, rows, seed), f"data.max_length={LADDER_LENGTH}", *LADDER[rung][1]]
        assert main(["--config", str(CONFIG), *over]) == 0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        last = [r for r in read_jsonl(run / "metrics.jsonl") if "samples_per_s" in r][-1]
        acc = json.loads((run / "eval.json").read_text())["accuracy"]
        report = json.loads((run / "memory.json").read_text())
    cfg = load_config(CONFIG, over)
    shapes = report["sampled_batches"]
    micro, seq = max(b[0] for b in shapes), max(b[1] for b in shapes)
    t0 = time.perf_counter()
    G = cfg.train.gradient_accumulation_steps
    plan = predict_peak(cfg, micro, G, build_tokenizer(cfg), ["negative", "positive"], seq_len=seq)
    return {
        "rung": LADDER[rung][0],
        "overrides": LADDER[rung][1],
        "peak_rss_mib": rss,
        "loop_peak_mib": report["peak_bytes"] / 2**20,
        "planned_mib": plan.peak_bytes / 2**20,
        "plan_error": plan.peak_bytes / report["peak_bytes"] - 1,
        "sampled_batches": shapes,
        "split_mib": {
            k: (report[f"{k}_bytes"] or 0) / 2**20
            for k in ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
        },
        "plan_seconds": time.perf_counter() - t0,
        "samples_per_s": last["samples_per_s"],
        "accuracy": acc,
    }


def ladder_table(path: Path) -> str:
    """The ladder's markdown table: the median over seeds of each rung, % of full fp32's peak RSS."""
    runs = json.loads(path.read_text())
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["rung"], []).append(r)
    med = {
        n: {
            k: statistics.median(r[k] for r in rs)
            for k in ("peak_rss_mib", "loop_peak_mib", "planned_mib", "plan_error", "samples_per_s", "accuracy")
        }
        for n, rs in by.items()
    }
    full = med.get(LADDER[0][0], {}).get("loop_peak_mib")
    lines = [
        "| rung | seeds | peak RSS MiB | loop peak MiB (MemTracker) | % of full fp32 | planned MiB | plan error | "
        "dev accuracy [per seed] | samples/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, _ in LADDER:
        if name not in med:
            continue
        m, seeds = med[name], by[name]
        share = f"{100 * m['loop_peak_mib'] / full:.0f}" if full else "-"
        accs = ", ".join(f"{r['accuracy']:.3f}" for r in seeds)
        lines.append(
            f"| {name} | {len(seeds)} | {m['peak_rss_mib']:,.0f} | {m['loop_peak_mib']:,.1f} | {share} | "
            f"{m['planned_mib']:,.1f} | {100 * m['plan_error']:+.2f}% | {m['accuracy']:.3f} [{accs}] | "
            f"{m['samples_per_s']:.2f} |"
        )
    return "\n".join(lines)


def child_finetune_trim(rows: int, seed: int) -> dict[str, Any]:
    """finetune with glibc's malloc_trim(0) after every optimizer step (a candidate fix: freed heap pages handed
    back between windows); measured, not shipped (docs/MEMORY.md)."""
    import ctypes

    from finetune import train

    libc, after_step = ctypes.CDLL("libc.so.6"), train.after_step

    def trimmed(*args: Any) -> None:
        after_step(*args)
        libc.malloc_trim(0)

    train.after_step = trimmed
    return child_finetune(rows, seed)


def child_finetune_first(rows: int, seed: int) -> dict[str, Any]:
    """finetune with each epoch's heaviest window moved to the second step (a candidate fix: with length-grouped
    windows the heap grows step by step as longer windows arrive, each growth around live allocations; the
    heaviest early sets the heap's extent once, as the transformers Trainer's LengthGroupedSampler puts its
    longest batch first; second, not first, so the memory report's one sampled window after the first
    optimizer step is the heaviest)."""
    from finetune.data import window

    batches = window.WindowedBatchSampler.batches

    def heaviest_first(self: Any) -> list[list[int]]:
        out = batches(self)
        g = self.accumulation
        windows = [out[w : w + g] for w in range(0, len(out), g)]
        full = [i for i, w in enumerate(windows) if sum(map(len, w)) == self.batch_size * g]
        if not full:
            return out
        top = max(full, key=lambda i: max(len(b) * max(self.lengths[j] for j in b) for b in windows[i]))
        windows.insert(min(1, len(full) - 1), windows.pop(top))
        return [b for w in windows for b in w]

    window.WindowedBatchSampler.batches = heaviest_first  # type: ignore[method-assign]
    return child_finetune(rows, seed)


def child_finetune_random(rows: int, seed: int) -> dict[str, Any]:
    """finetune without length grouping (random batches, as the bench's Trainer has): is the excess from the
    windows' changing shapes?"""
    return child_finetune(rows, seed, extra=("data.group_by_length=false",))


def child_finetune_glibc(rows: int, seed: int) -> dict[str, Any]:
    """finetune with glibc's malloc defaults throughout (memory.lean_heaviest_window=false): the peak without
    the lean heaviest window."""
    return child_finetune(rows, seed, extra=("memory.lean_heaviest_window=false",))


def child_finetune_nobreakdown(rows: int, seed: int) -> dict[str, Any]:
    """finetune without MemTracker's sampled windows (memory.breakdown=false): what the memory report's two
    sampled windows (a torch dispatch mode on every op) cost a short run."""
    return child_finetune(rows, seed, extra=("memory.breakdown=false",))


CHILDREN = {
    "finetune": child_finetune,
    "finetune_trim": child_finetune_trim,
    "finetune_first": child_finetune_first,
    "finetune_random": child_finetune_random,
    "finetune_glibc": child_finetune_glibc,
    "finetune_nobreakdown": child_finetune_nobreakdown,
    "minilm": lambda rows, seed: child_finetune(rows, seed, ROOT / "configs" / "sst2-minilm.yaml"),
    "trainer": child_trainer,
}


def run_child(name: str, rows: int, seed: int, rung: int = 0) -> dict[str, Any]:
    """One contestant in a fresh process; its result line plus its peak RSS."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        t0 = time.perf_counter()
        args = ["--child", name, "--rows", str(rows), "--seed", str(seed), "--rung", str(rung), "--child-out", out.name]
        subprocess.run([sys.executable, __file__, *args], check=True)
        result = json.loads(Path(out.name).read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=960, help="first N SST-2 training rows (16000: the demo budget)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--ladder", type=int, nargs="*", default=None, help="run these rungs of LADDER (indices)")
    p.add_argument("--seeds", type=int, nargs="*", default=None, help="--ladder: seeds (default --seed)")
    p.add_argument("--ladder-json", type=Path, default=ROOT / "runs" / "bench_decoder_ladder.json")
    p.add_argument("--ladder-table", type=Path, default=None, help="print the ladder table of this JSON file")
    p.add_argument("--contestants", nargs="+", choices=list(CHILDREN), default=["finetune", "minilm", "trainer"])
    p.add_argument("--child", choices=[*CHILDREN, "rung"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--rung", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        if args.child == "rung":
            result = child_rung(args.rows, args.seed, args.rung)
        else:
            result = CHILDREN[args.child](args.rows, args.seed)
            result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    if args.ladder_table:
        print(ladder_table(args.ladder_table))
        return 0
    if args.ladder is not None:
        done = json.loads(args.ladder_json.read_text()) if args.ladder_json.exists() else []
        for seed in args.seeds or [args.seed]:
            for rung in args.ladder:
                r = run_child("rung", args.rows, seed, rung) | {"seed": seed, "rows": args.rows}
                print(json.dumps(r), flush=True)
                done.append(r)
                args.ladder_json.parent.mkdir(parents=True, exist_ok=True)
                args.ladder_json.write_text(json.dumps(done, indent=2))
        return 0
    names = args.contestants
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            r = run_child(name, args.rows, args.seed)
            runs[name].append(r)
            print(f"[{rep + 1}/{args.repeats}] {name:8s} {json.dumps(r)}", flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    base = "trainer" if "trainer" in runs else names[-1]
    ratio = statistics.median(
        a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs[names[0]], runs[base], strict=True)
    )
    print(f"\n{args.rows} rows, seed {args.seed}, {args.repeats} repeat(s), torch threads: the config's\n")
    print("| | samples/s | dev accuracy | peak RSS MiB | padding | wall s |\n|---|---|---|---|---|---|")
    for n, s in med.items():
        print(
            f"| {n} | {s['samples_per_s']:.2f} | {s['accuracy']:.4f} | {s['peak_rss_mib']:,.0f} | "
            f"{s['padding_fraction']:.3f} | {s['wall_s']:.0f} |"
        )
    print(f"\nsamples/s {names[0]} / {base}: {ratio:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": runs, "median": med, "ratio": ratio, "rows": args.rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
