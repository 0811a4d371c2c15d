"""`finetune sweep`: hyper-parameter search with Optuna (TPE sampler, median pruning).

Each trial is an ordinary run of `train.train` in `<run.output_dir>/trial-<NNN>/`, with the trial's
values of `sweep.space` set on top of the config. The only thing the loop knows of the sweep is
`train(..., report=...)`: after each periodic evaluation the metric goes to the trial, and a trial
the median pruner stops raises `optuna.TrialPruned` out of the loop (its directory stays, marked
pruned in trial.json). The study lives in `<run.output_dir>/study.db` (SQLite) unless `--storage`
names another database, so several machines can work on one study; the best trial's config is
written to `<run.output_dir>/best.yaml`, ready for `finetune train`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from finetune.config import tasks
from finetune.config.files import apply_overrides, dump_config, validate_config
from finetune.config.schema import Config, SweepRange
from finetune.core.errors import UserError
from finetune.train import train
from finetune.training.runtime import PreemptionGuard

logger = logging.getLogger("finetune")

TRIAL_FILE = "trial.json"


def _import_optuna() -> Any:
    """optuna, imported when a sweep runs (start-up time of the other commands).

    Raises:
        UserError: optuna is not installed.
    """
    try:
        import optuna
    except ImportError:
        raise UserError("finetune sweep needs optuna: pip install optuna (requirements.txt pins it)") from None
    return optuna


def _get(cfg: dict[str, Any], key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def baseline_params(cfg: Config) -> dict[str, Any] | None:
    """The config's own values of the searched keys, when every one lies in its range (else None)."""
    raw, out = cfg.model_dump(mode="json"), {}
    for key, spec in cfg.sweep.space.items():
        value = _get(raw, key)
        inside = (
            value in spec.choices
            if spec.choices is not None
            else (isinstance(value, (int, float)) and not isinstance(value, bool) and spec.low <= value <= spec.high)
        )
        if not inside:
            return None
        out[key] = value
    return out


def suggest(trial: Any, key: str, spec: SweepRange) -> Any:
    """The trial's value of `key` from its range or choices."""
    if spec.choices is not None:
        return trial.suggest_categorical(key, spec.choices)
    return trial.suggest_float(key, spec.low, spec.high, log=spec.log)


def trial_config(base: Config, params: dict[str, Any], output_dir: Path) -> Config:
    """`base` with the trial's values, writing into `output_dir`.

    Raises:
        UserError: a value the schema refuses (e.g. a choice of the wrong type).
    """
    raw = base.model_dump(mode="json")
    raw["run"]["output_dir"] = str(output_dir)
    raw = apply_overrides(raw, [f"{k}={json.dumps(v)}" for k, v in params.items()])
    return validate_config(raw, source=f"sweep trial {output_dir.name}")


def _pruning_report(trial: Any, metric: str, run_dir: Path) -> Any:
    """`train`'s report: the metric goes to the trial; a trial the pruner stops raises `optuna.TrialPruned`."""
    optuna = _import_optuna()

    def report(step: int, metrics: dict[str, Any]) -> None:
        trial.report(float(metrics[metric]), step)
        if trial.should_prune():
            _write_trial_file(run_dir, trial.number, trial.params, "pruned", float(metrics[metric]), step)
            logger.info(
                f"sweep: trial {trial.number} pruned at step {step} ({metric} {metrics[metric]:.4f} is "
                "worse than the median of earlier trials at this step)"
            )
            raise optuna.TrialPruned(f"pruned at step {step}: {metric} {metrics[metric]:.4f}")

    return report


def _write_trial_file(
    run_dir: Path, number: int, params: dict[str, Any], state: str, value: float | None, step: int | None
) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    note = {"trial": number, "state": state, "value": value, "step": step, "params": params}
    if state == "pruned":
        note["note"] = "stopped early by the median pruner: no final/, the last checkpoint (if any) is kept"
    (run_dir / TRIAL_FILE).write_text(json.dumps(note, indent=2))


def _objective(base: Config, root: Path, guard: PreemptionGuard) -> Any:
    metric = base.checkpoint.best_metric
    assert metric is not None

    def objective(trial: Any) -> float:
        params = {key: suggest(trial, key, spec) for key, spec in base.sweep.space.items()}
        run_dir = root / f"trial-{trial.number:03d}"
        cfg = trial_config(base, params, run_dir)
        trial.set_user_attr("run_dir", str(run_dir))
        final = train(cfg, guard, report=_pruning_report(trial, metric, run_dir))
        _write_trial_file(run_dir, trial.number, params, "complete", final.get(metric), final.get("step"))
        return float(final[metric])

    return objective


def _progress_line(total: int, metric: str, started: float) -> Any:
    def callback(study: Any, trial: Any) -> None:
        done = len([t for t in study.trials if t.state.is_finished()])
        params = ", ".join(
            f"{k.split('.')[-1]}={v:.3g}" if isinstance(v, float) else f"{k.split('.')[-1]}={v}"
            for k, v in trial.params.items()
        )
        value = "" if trial.value is None else f" {metric} {trial.value:.4f}"
        if trial.state.name == "PRUNED" and trial.intermediate_values:
            step = max(trial.intermediate_values)
            value = f" at step {step}: {metric} {trial.intermediate_values[step]:.4f}"
        try:
            best = f"best {study.best_value:.4f} (trial {study.best_trial.number})"
        except ValueError:  # no completed trial yet
            best = "no completed trial yet"
        seconds = (trial.datetime_complete - trial.datetime_start).total_seconds()
        print(
            f"trial {trial.number} ({done} in study, {total} this sweep): {trial.state.name.lower()}{value} "
            f"[{params}] {seconds:.0f} s; {best}; {time.perf_counter() - started:.0f} s so far",
            file=sys.stderr,
            flush=True,
        )

    return callback


def write_best(study: Any, base: Config, root: Path) -> Path | None:
    """`<root>/best.yaml`: the base config with the best trial's values, training into `<root>/best`."""
    try:
        best = study.best_trial
    except ValueError:
        return None
    cfg = trial_config(base, best.params, root / "best")
    path = root / "best.yaml"
    header = (
        f"# finetune sweep: trial {best.number} of study {study.study_name!r}, "
        f"{base.checkpoint.best_metric} {best.value:.4f}\n# train with: finetune train --config {path}\n"
    )
    path.write_text(header + dump_config(cfg))
    return path


def run_sweep(
    base: Config, trials: int, storage: str | None = None, study_name: str | None = None, timeout: float | None = None
) -> Any:
    """Run `trials` trials of the study (created, or continued when it exists) and write best.yaml; the study.
    With `timeout` (seconds) no trial starts after that time (Optuna's own timeout).

    Raises:
        UserError: `trials` below 1, no validation data to score trials on, optuna missing.
    """
    if trials < 1:
        raise UserError(f"--trials {trials}: a sweep runs at least one trial")
    d = base.data
    hub_validation = d.hub_dataset is not None and d.hub_validation_split is not None
    if d.validation_file is None and d.validation_split is None and not hub_validation:
        raise UserError(
            "finetune sweep scores trials on validation data: set data.validation_file (or data.validation_split)"
        )
    optuna = _import_optuna()
    root = Path(base.run.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    storage = storage or f"sqlite:///{(root / 'study.db').resolve()}"
    metric = base.checkpoint.best_metric
    direction = tasks.direction(metric)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own progress line per trial; errors reach the user as ours
    study = optuna.create_study(
        study_name=study_name or root.resolve().name,
        storage=storage,
        load_if_exists=True,
        direction=direction,
        sampler=optuna.samplers.TPESampler(n_startup_trials=base.sweep.random_trials, seed=base.run.seed),
        pruner=optuna.pruners.MedianPruner(
            n_startup_trials=base.sweep.startup_trials, n_warmup_steps=_warmup_steps(base)
        ),
    )
    if study.direction.name.lower() != direction:
        raise UserError(
            f"study {study.study_name!r} in {storage} is a {study.direction.name.lower()} study; "
            f"{metric} needs {direction}"
        )
    baseline = baseline_params(base) if base.sweep.baseline else None
    if baseline is not None and not study.trials:
        study.enqueue_trial(baseline)  # trial 0 runs the config as given: the number to beat
    logger.info(f"sweep: {trials} trial(s) of study {study.study_name!r} ({direction} {metric}) in {storage}")
    with PreemptionGuard() as guard:
        study.optimize(
            _objective(base, root, guard),
            n_trials=trials,
            timeout=timeout,
            gc_after_trial=True,
            callbacks=[_progress_line(trials, metric, time.perf_counter())],
        )
    best = write_best(study, base, root)
    if best is not None:
        print(
            f"best: trial {study.best_trial.number}, {metric} {study.best_value:.4f}; wrote {best}; "
            f"train it with: finetune train --config {best}",
            file=sys.stderr,
        )
    return study


def _warmup_steps(base: Config) -> int:
    """Optimizer steps before pruning may start: `sweep.warmup_evaluations` evaluations."""
    return base.sweep.warmup_evaluations * (base.train.eval_every_steps or 0)
