"""SST-2 dev accuracy per precision mode after the same number of steps (median over seeds).

Runs `python finetune/train.py --config configs/sst2-minilm.yaml` once per (seed, mode), seed-major so
the modes alternate and share the machine's noise, each in its own process (Accelerate's state is
per process). Every run sees the same training slice and step count; only `precision.mode` (and
`precision.bf16_update` for the `bf16-true-plain` variant) differ.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_precision_accuracy.py \
        --modes fp32 bf16 bf16-true --seeds 0 1 2 --train-samples 1920 --steps 60 --lr 5e-5

Prints a markdown table and writes JSON to --out (default runs/bench_precision_accuracy.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchlib import ROOT, train_run


def one_run(mode: str, seed: int, args: argparse.Namespace, out_dir: Path) -> dict[str, float]:
    run_dir = out_dir / f"{mode}-seed{seed}"
    real_mode, extra = (mode, [])
    if mode == "bf16-true-plain":
        real_mode, extra = "bf16-true", ["precision.bf16_update=plain"]
    overrides = [
        f"run.seed={seed}",
        f"precision.mode={real_mode}",
        f"data.max_train_samples={args.train_samples}",
        f"train.max_steps={args.steps}",
        f"train.learning_rate={args.lr}",
        f"train.micro_batch_size={args.batch_size}",
        "train.eval_every_steps=null",
        "checkpoint.every_steps=null",
        f"data.max_eval_samples={args.eval_samples}",
        f"data.max_length={args.max_length}",
        *extra,
    ]
    r = train_run(ROOT / "configs" / "sst2-minilm.yaml", overrides, run_dir)
    ev = r.eval
    return {"accuracy": ev["accuracy"], "macro_f1": ev["macro_f1"], "loss": ev["loss"], "wall_s": r.wall_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["fp32", "bf16", "bf16-true"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--train-samples", type=int, default=1920)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--eval-samples", type=int, default=872, help="first N dev rows (872 = all)")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_precision_accuracy"))
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_precision_accuracy.json")
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    for seed in args.seeds:
        for mode in args.modes:
            r = one_run(mode, seed, args, args.work)
            results[mode].append({"seed": seed, **r})
            print(
                f"seed {seed} {mode}: accuracy {r['accuracy']:.4f} loss {r['loss']:.4f} ({r['wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"\nSST-2 dev (first {args.eval_samples} of 872), all-MiniLM-L6-v2, "
        f"{args.steps} steps x batch {args.batch_size} from "
        f"{args.train_samples} training rows, max_length {args.max_length}, lr {args.lr:g}, seeds {args.seeds}"
    )
    print("| mode | median dev accuracy | per seed | median dev loss | median wall s |")
    print("|---|---|---|---|---|")
    for mode, rows in results.items():
        accs = [r["accuracy"] for r in rows]
        print(
            f"| {mode} | {statistics.median(accs):.4f} | {', '.join(f'{a:.4f}' for a in accs)} | "
            f"{statistics.median(r['loss'] for r in rows):.4f} | {statistics.median(r['wall_s'] for r in rows):.0f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
