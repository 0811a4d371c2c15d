"""Planner truth: `finetune plan`'s peak against the real training loop's measured peak.

For the default model (all-MiniLM-L6-v2, configs/sst2-minilm.yaml) and a tiny random model of
every family of tests/test_families.py, each in fp32 (full), with LoRA, with QLoRA (4-bit
base, bf16 autocast, checkpointing) and with LoRA on an 8-bit base (bf16 autocast): `main()` trains
2 optimizer steps of micro-batch 8 x 2 on
SST-2 rows at least L tokens long (so every batch is the planner's worst case, L tokens per row),
and the loop's MemoryMonitor samples the second window with MemTracker (checkpoint memory.json).
The plan is `predict_peak` for the same config. Errors are (plan - loop) / loop.

    HF_HUB_OFFLINE=1 PYTHONPATH=. python scripts/bench_planner.py --out runs/bench_planner
    ... --families minilm bert --settings "LoRA on an 8-bit base, bf16"     # a subset
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_families import FAMILIES, family_config, train_tokenizer  # noqa: E402

from finetune.config.files import load_config  # noqa: E402
from finetune.memory.peak import MiB  # noqa: E402
from finetune.memory.planner import predict_peak  # noqa: E402
from finetune.model.load import build_tokenizer  # noqa: E402
from finetune.train import main as train_main  # noqa: E402
from finetune.training import checkpoint as ckpt  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "full fp32": {},
    "LoRA r=4": {"model.lora": {"r": 4}},
    "QLoRA 4-bit, bf16, ckpt": {
        "model.lora": {"r": 4},
        "model.quantization": "4bit",
        "precision.mode": "bf16",
        "model.gradient_checkpointing": True,
    },
    "LoRA on an 8-bit base, bf16": {"model.lora": {"r": 4}, "model.quantization": "8bit", "precision.mode": "bf16"},
}


# pretrained models of shipped configs (offline: package aliases), beside the tiny random families
PRETRAINED = {"minilm": "sst2-minilm.yaml", "smollm2": "sst2-smollm2.yaml"}


def long_rows(data_dir: Path, tokenizer: Any, length: int, n: int, out: Path) -> Path:
    """The first n SST-2 training rows of at least `length` tokens, as a tsv."""
    lines = (data_dir / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]
    rows = [x for x in lines if len(tokenizer(x.split("\t")[0])["input_ids"]) >= length][:n]
    assert len(rows) == n, f"only {len(rows)} SST-2 rows of {length}+ tokens"
    out.write_text("sentence\tlabel\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return out


def one(cfg_path: Path, overrides: list[str], run: Path, length: int) -> dict[str, Any]:
    """Train, read the sampled window's peak, plan the same config."""
    t0 = time.perf_counter()
    assert train_main(["--config", str(cfg_path), *overrides]) == 0
    report = json.loads((ckpt.list_checkpoints(run)[-1] / "memory.json").read_text())
    cfg = load_config(cfg_path, overrides)
    planned = predict_peak(cfg, 8, 2, build_tokenizer(cfg), ["negative", "positive"], seq_len=length)
    loop = report["peak_bytes"]
    return {
        "planned_mib": planned.peak_bytes / MiB,
        "loop_mib": loop / MiB,
        "error": planned.peak_bytes / loop - 1,
        "seconds": time.perf_counter() - t0,
    }


def yaml_value(v: Any) -> str:
    if v is None:
        return "null"
    return json.dumps(v) if isinstance(v, dict) else str(v).lower() if isinstance(v, bool) else str(v)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_planner"))
    parser.add_argument(
        "--families",
        nargs="*",
        default=None,
        help="tiny families (default all); minilm = the default model, smollm2 = SmolLM2-135M",
    )
    parser.add_argument("--data-dir", default=None, help="default: FINETUNE_DATA_DIR or ../shared/data")
    parser.add_argument("--settings", nargs="*", default=None, choices=list(SETTINGS), help="default: all")
    args = parser.parse_args()
    import os

    data = Path(args.data_dir or os.environ.get("FINETUNE_DATA_DIR", ROOT.parent / "shared" / "data"))
    out = Path(args.out).resolve()  # data paths in configs resolve against data.data_dir
    out.mkdir(parents=True, exist_ok=True)
    families = args.families if args.families is not None else ["minilm", *FAMILIES]
    results = []
    sentences = [x.split("\t")[0] for x in (data / "sst2" / "train.tsv").read_text().splitlines()[1:401]]
    toks = {k: train_tokenizer(sentences, k, out / "tok" / k) for k in ("decoder", "decoder_eos", "encoder")}
    for family in families:
        for name, setting in SETTINGS.items():
            if args.settings is not None and name not in args.settings:
                continue
            run = out / family / name.split(",")[0].replace(" ", "_") / "run"
            if family in PRETRAINED:  # a shipped config at 48 tokens (rows that long exist in SST-2)
                length = 48
                cfg_path = ROOT / "configs" / PRETRAINED[family]
                tok = build_tokenizer(load_config(cfg_path))
                rows = long_rows(data, tok, length, 32, out / f"long_{family}.tsv")
                if family == "smollm2" and name == "full fp32":  # its config trains LoRA: full fine-tuning drops it
                    setting = {"model.lora": None}
                overrides = [
                    f"run.output_dir={run}",
                    "run.overwrite=true",
                    f"data.train_file={rows}",
                    f"data.data_dir={data}",
                    "data.max_eval_samples=16",
                    f"data.max_length={length}",
                    "data.max_train_samples=32",
                    "train.max_steps=2",
                    "checkpoint.every_steps=2",
                    "train.micro_batch_size=8",
                    "train.gradient_accumulation_steps=2",
                    "train.eval_every_steps=null",
                    *(f"{k}={yaml_value(v)}" for k, v in setting.items()),
                ]
            else:
                length = 16
                kind = FAMILIES[family][0]
                from transformers import AutoTokenizer

                rows = long_rows(data, AutoTokenizer.from_pretrained(toks[kind]), length, 32, out / f"long_{kind}.tsv")
                cfg_path = family_config(
                    run.parent,
                    family,
                    toks,
                    **{"data.train_file": str(rows), "data.max_length": length, "run.overwrite": True, **setting},
                )
                overrides = []
            row: dict[str, Any] = {"family": family, "setting": name, "tokens": length}
            try:
                row.update(one(cfg_path, overrides, run, length))
            except Exception as exc:  # a setting the family cannot train: recorded, the others go on
                row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            results.append(row)
            print(json.dumps(row), flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=2))
    print("\n| model | setting | planned MiB | loop MiB (MemTracker in train()) | error |\n|---|---|---|---|---|")
    for r in results:
        if "failed" in r:
            print(f"| {r['family']} | {r['setting']} | - | - | training failed: {r['failed']} |")
        else:
            print(
                f"| {r['family']} | {r['setting']} | {r['planned_mib']:,.3f} | {r['loop_mib']:,.3f} | "
                f"{100 * r['error']:+.2f}% |"
            )
    ok = [abs(r["error"]) for r in results if "error" in r]
    print(f"\nworst |error|: {100 * max(ok):.2f}% over {len(ok)} runs ({len(results) - len(ok)} failed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
