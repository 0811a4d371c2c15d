"""The table of a `finetune sweep` study: one row per trial, against trial 0 (the config's own values).

The sweep itself is the command (docs/ARCHITECTURE.md gives it); this reads its study.db and trial
directories and prints a markdown table: state, the searched values, the metric (the last reported
evaluation for a pruned trial), optimizer steps run and wall time.

    .venv/bin/python scripts/bench_sweep.py SWEEP_DIR [--study-name NAME]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("sweep_dir")
    parser.add_argument("--study-name", default=None)
    args = parser.parse_args()
    import optuna

    root = Path(args.sweep_dir).resolve()
    study = optuna.load_study(study_name=args.study_name or root.name, storage=f"sqlite:///{root / 'study.db'}")
    keys = sorted({k for t in study.trials for k in t.params})
    print("| trial | state | " + " | ".join(k.split(".")[-1] for k in keys) + " | accuracy | steps | wall s |")
    print("|---:|---|" + "---:|" * (len(keys) + 3))
    total = 0.0
    for t in study.trials:
        values = " | ".join(
            f"{t.params[k]:.3g}" if isinstance(t.params.get(k), float) else str(t.params.get(k)) for k in keys
        )
        note = root / f"trial-{t.number:03d}" / "trial.json"
        step = json.loads(note.read_text()).get("step") if note.is_file() else None
        value = (
            t.value
            if t.value is not None
            else (t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None)
        )
        wall = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete else None
        total += wall or 0.0
        shown = "-" if value is None else f"{value:.4f}"
        print(
            f"| {t.number} | {t.state.name.lower()} | {values} | {shown} | {step or '-'} | "
            f"{'-' if wall is None else f'{wall:.0f}'} |"
        )
    best = study.best_trial
    print(
        f"\nbest: trial {best.number}, {best.value:.4f}; trial 0 (the config as shipped): "
        f"{study.trials[0].value}; {len(study.trials)} trials, {total / 60:.1f} min of trials"
    )


if __name__ == "__main__":
    main()
