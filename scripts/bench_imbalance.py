"""Class weights and focal loss on SMS Spam; truncation vs chunks on BBC News: side by side, 3 seeds.

SMS Spam (13% spam): F1 of the spam class and macro-F1 on the held-out validation split, for plain
cross-entropy, `train.class_weights=auto` and `train.loss=focal`. BBC News at `data.max_length=128`:
accuracy with head truncation, head_tail truncation and overlapping chunks (`data.chunk_stride`),
and the wall time of each run. Every run is the real `python finetune/train.py` with overrides of the
shipped config; the variants of one seed run back to back, so machine-load drift hits them alike.

    .venv/bin/python scripts/bench_imbalance.py [--seeds 0 1 2] [--only sms|bbc] [--sms-epochs 1] [--bbc-epochs 1]

Prints markdown tables (median over seeds, then each seed) and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchlib import ROOT, train_run

SMS = {
    "cross_entropy": [],
    "class_weights=auto": ["train.class_weights=auto"],
    "focal (gamma 2)": ["train.loss=focal", "train.focal_gamma=2.0"],
}
BBC = {"head": [], "head_tail": ["data.truncation=head_tail"], "chunks (stride 32, mean)": ["data.chunk_stride=32"]}


def run(config: str, overrides: list[str], out: Path) -> tuple[dict, float]:
    """final/'s eval.json and the wall time of one run with evaluation only at the end."""
    r = train_run(config, ["train.eval_every_steps=null", *overrides], out)
    return r.eval, r.wall_s


def table(title: str, results: dict[str, list[dict]], keys: list[str]) -> str:
    lines = [
        f"### {title}",
        "",
        "| variant | " + " | ".join(f"{k} (median)" for k in keys) + " | per seed |",
        "|---" * (len(keys) + 2) + "|",
    ]
    for name, rows in results.items():
        med = [statistics.median(r[k] for r in rows) for k in keys]
        seeds = "; ".join(", ".join(f"{r[k]:.3f}" for k in keys) for r in rows)
        lines.append(f"| {name} | " + " | ".join(f"{m:.3f}" for m in med) + f" | {seeds} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", choices=["sms", "bbc"], default=None)
    ap.add_argument("--sms-epochs", type=float, default=1)
    ap.add_argument("--bbc-epochs", type=float, default=1)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_imbalance"))
    args = ap.parse_args()
    out = Path(args.out)
    report: dict[str, dict[str, list[dict]]] = {"sms": {k: [] for k in SMS}, "bbc": {k: [] for k in BBC}}
    for seed in args.seeds:
        if args.only in (None, "sms"):
            for k, (name, extra) in enumerate(SMS.items()):
                ev, secs = run(
                    "configs/sms-spam-minilm.yaml",
                    [f"run.seed={seed}", f"train.epochs={args.sms_epochs}", *extra],
                    out / f"sms-seed{seed}-variant{k}",
                )
                spam = ev["per_class"]["spam"]
                report["sms"][name].append(
                    {"spam_f1": spam["f1"], "spam_recall": spam["recall"], "macro_f1": ev["macro_f1"], "seconds": secs}
                )
                print(name, seed, report["sms"][name][-1], flush=True)
        if args.only in (None, "bbc"):
            for k, (name, extra) in enumerate(BBC.items()):
                ev, secs = run(
                    "configs/bbc-minilm.yaml",
                    [f"run.seed={seed}", f"train.epochs={args.bbc_epochs}", "data.max_length=128", *extra],
                    out / f"bbc-seed{seed}-variant{k}",
                )
                report["bbc"][name].append(
                    {
                        "accuracy": ev["accuracy"],
                        "macro_f1": ev["macro_f1"],
                        "num_samples": ev["num_samples"],
                        "seconds": secs,
                    }
                )
                print(name, seed, report["bbc"][name][-1], flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    if any(report["sms"].values()):
        print(
            table(
                f"SMS Spam, {args.sms_epochs} epoch(s), validation split",
                report["sms"],
                ["spam_f1", "spam_recall", "macro_f1", "seconds"],
            )
        )
    if any(report["bbc"].values()):
        print(
            table(
                f"BBC News, max_length 128, {args.bbc_epochs} epoch(s), validation split",
                report["bbc"],
                ["accuracy", "macro_f1", "seconds"],
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
