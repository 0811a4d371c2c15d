"""Fine-tuning recipes on the SST-2 demo budget, side by side: 3 seeds each.

The demo config (`configs/sst2-minilm.yaml`: all-MiniLM-L6-v2, the first 16,000 SST-2 training rows,
1 epoch, lr 1e-4) as shipped, and with each recipe of the schema alone: layer-wise learning-rate
decay (`train.layer_lr_decay`), a separate head learning rate (`train.head_learning_rate`) and
re-initialising the top layer (`train.reinit_top_layers`). Every run is the real
`python finetune/train.py` with overrides; the variants of one seed run back to back, so drift in the
machine's load hits them alike. Reports SST-2 dev accuracy at the end of training (with final/'s
bootstrap interval) and the wall time of each run. Each run uses one CPU thread (`run.num_threads=1`):
on a machine shared with other work a 2-thread run slowed ~8x here, a 1-thread one far less.

    .venv/bin/python scripts/bench_recipes.py [--seeds 42 43 44] [--only baseline llrd ...] [--out FILE]

Prints a markdown table (median over seeds, then each seed) and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_imbalance import run  # the real train.py with overrides, evaluation only at the end

VARIANTS = {
    "shipped (lr 1e-4)": [],
    "layer_lr_decay 0.8, lr 2e-4": ["train.layer_lr_decay=0.8", "train.learning_rate=2e-4"],
    "head_learning_rate 1e-3": ["train.head_learning_rate=1e-3"],
    "reinit_top_layers 1": ["train.reinit_top_layers=1"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/sst2-minilm.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--only", nargs="+", default=None, help="variant name prefixes to run")
    parser.add_argument("--work", default="/tmp/bench_recipes")
    parser.add_argument("--out", default="/tmp/bench_recipes.json")
    args = parser.parse_args()
    variants = {k: v for k, v in VARIANTS.items() if not args.only or any(k.startswith(o) for o in args.only)}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for seed in args.seeds:
        for i, (name, overrides) in enumerate(variants.items()):
            settings = [f"run.seed={seed}", "run.num_threads=1", *overrides]
            final, wall = run(args.config, settings, Path(args.work) / f"s{seed}-v{i}")
            row = {
                "seed": seed,
                "accuracy": final["accuracy"],
                "accuracy_ci": final.get("accuracy_ci"),
                "macro_f1": final["macro_f1"],
                "wall_s": wall,
            }
            results[name].append(row)
            print(f"seed {seed} {name}: accuracy {row['accuracy']:.4f} {row['accuracy_ci']} {wall:.0f} s", flush=True)
            Path(args.out).write_text(json.dumps({"config": args.config, "results": results}, indent=2))
    print("\n| recipe | dev accuracy (median) | wall s (median) | per seed: accuracy [95% CI], s |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        per = "; ".join(
            f"{r['accuracy']:.4f} [{r['accuracy_ci'][0]:.3f}, {r['accuracy_ci'][1]:.3f}], {r['wall_s']:.0f}"
            for r in rows
        )
        acc, wall = statistics.median(r["accuracy"] for r in rows), statistics.median(r["wall_s"] for r in rows)
        print(f"| {name} | {acc:.4f} | {wall:.0f} | {per} |")


if __name__ == "__main__":
    main()
