"""How many validation rows a temperature needs: temperature scaling as finetune/evaluation/calibrate.py does it,
fitted on n synthetic rows whose true temperature is known and scored on 10,000 new rows of the same kind.

The synthetic classifier: per row a class c drawn uniformly and true logits z = g * onehot(c) + N(0, 1) per
class, g a Gamma(2) margin whose mean is set so that the top probability is right `--accuracy` of the time; the
label is drawn from softmax(z), so softmax(z) is calibrated; the classifier's logits are T * z, so T (the true
temperature) is what the fit should find: above 1 overconfident, below 1 underconfident, 1 calibrated.

For each number of classes, true temperature and n: `--draws` draws of n rows; per draw the fitted temperature
(`fit_temperature`), its error |log(T_fit / T)|, and whether the NLL on the new rows at T_fit is lower than
at T = 1 (fitting helps) or higher (fitting hurts); beside it the same for the temperature calibrate() keeps
(fitted, and kept only where it lowers the cross-fitted NLL). The threshold is the smallest n of the grid from
which, in every miscalibrated scenario (true T != 1), the fitted temperature helps in more draws than it hurts,
at that n and every larger one (at T = 1 a fitted temperature can only hurt: the cross-fitted check is what
keeps T = 1 there).

    .venv/bin/python scripts/bench_calibration.py [--draws 200] [--seed 0] [--record docs/results/calibration.jsonl]

Prints a markdown table per scenario and the threshold; `--record FILE` appends the threshold as a record.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import markdown_table, record_fields
from scipy.special import log_softmax

from finetune.evaluation.calibrate import calibrate, nll  # importable once benchlib has put the repository on sys.path

ROWS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CLASSES = (2, 6, 77)
TEMPERATURES = (0.8, 1.0, 1.25, 1.5, 2.0)
NEW_ROWS = 10_000
# the held-out NLL is read off a curve over log T (0.01 to 100, 1 on a grid point) rather than recomputed per draw
GRID = np.logspace(-2, 2, 201)


def true_logits(rng: np.random.Generator, n: int, classes: int, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """n rows of calibrated logits z and labels drawn from softmax(z)."""
    z = rng.normal(size=(n, classes))
    z[np.arange(n), rng.integers(0, classes, n)] += margin * rng.gamma(2.0, 0.5, n)
    p = np.exp(log_softmax(z, axis=1))
    labels = (p.cumsum(1) < rng.random((n, 1))).sum(1).clip(0, classes - 1)
    return z, labels


def margin_for(accuracy: float, classes: int, seed: int) -> float:
    """The mean margin whose calibrated classifier is right `accuracy` of the time (bisection on 10,000 rows)."""
    lo, hi = 0.0, 40.0
    for _ in range(25):
        mid = (lo + hi) / 2
        z, _ = true_logits(np.random.default_rng(seed), NEW_ROWS, classes, mid)
        right = np.exp(log_softmax(z, axis=1)).max(1).mean()
        lo, hi = (mid, hi) if right < accuracy else (lo, mid)
    return (lo + hi) / 2


def scenario(classes: int, temperature: float, margin: float, draws: int, seed: int) -> list[dict[str, Any]]:
    """Per n of ROWS: how often the fitted (and the kept) temperature lowers / raises the NLL on new rows."""
    rng = np.random.default_rng([seed, classes, int(temperature * 100)])
    z_new, y_new = true_logits(rng, NEW_ROWS, classes, margin)
    curve = np.array([nll(temperature * z_new, y_new, t) for t in GRID])
    held_out = lambda t: float(np.interp(np.log(t), np.log(GRID), curve))  # noqa: E731
    at_one = held_out(1.0)
    rows = []
    for n in ROWS:
        fitted, kept = [], []
        for draw in range(draws):
            z, y = true_logits(rng, n, classes, margin)
            report = calibrate(temperature * z, y, seed=draw, min_rows=0)
            fitted.append(report["fitted_temperature"])
            kept.append(report["temperature"])
        change = np.array([held_out(t) for t in fitted]) - at_one
        kept_change = np.array([held_out(t) for t in kept]) - at_one
        rows.append(
            {
                "classes": classes,
                "true_temperature": temperature,
                "rows": n,
                "median_log_error": float(np.median(np.abs(np.log(np.array(fitted) / temperature)))),
                "at_bound": float(np.mean(np.array(fitted) <= 0.0101)),
                "helps": float(np.mean(change < 0)),
                "hurts": float(np.mean(change > 0)),
                "mean_nll_change": float(change.mean()),
                "kept_helps": float(np.mean(kept_change < 0)),
                "kept_hurts": float(np.mean(kept_change > 0)),
                "kept_mean_nll_change": float(kept_change.mean()),
            }
        )
    return rows


def threshold(results: list[dict[str, Any]]) -> int:
    """The smallest n of ROWS from which every miscalibrated scenario's fitted temperature helps in more draws
    than it hurts, at n and above."""
    bad = [r["rows"] for r in results if r["true_temperature"] != 1.0 and r["helps"] <= r["hurts"]]
    above = [n for n in ROWS if n > max(bad, default=0)]
    return above[0] if above else ROWS[-1] + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=200, help="draws of n rows per scenario and n")
    parser.add_argument("--accuracy", type=float, default=0.9, help="how often the synthetic classifier is right")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write every scenario's rows as JSON here")
    parser.add_argument("--record", type=Path, default=None, help="append the threshold as a record to this file")
    args = parser.parse_args(argv)
    results = []
    for classes in CLASSES:
        margin = margin_for(args.accuracy, classes, args.seed)
        for temperature in TEMPERATURES:
            rows = scenario(classes, temperature, margin, args.draws, args.seed)
            results += rows
            print(f"\n{classes} classes, true temperature {temperature} (margin {margin:.2f})")
            header = [k for k in rows[0] if k not in ("classes", "true_temperature")]
            print(markdown_table(header, [[r[k] for k in header] for r in rows]), flush=True)
    found = threshold(results)
    print(f"\nthreshold: {found} rows")
    if args.out is not None:
        args.out.write_text(json.dumps({"threshold": found, "results": results}, indent=1))
    if args.record is not None:
        what = (
            f"validation rows from which a fitted temperature lowers the NLL on new rows in more draws than it "
            f"raises it (synthetic, {'/'.join(map(str, CLASSES))} classes, true T "
            f"{'/'.join(str(t) for t in TEMPERATURES if t != 1.0)}, accuracy {args.accuracy}, {args.draws} draws)"
        )
        with args.record.open("a") as f:
            f.write(json.dumps(record_fields("calibration", what, "rows", found, None, [args.seed])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
