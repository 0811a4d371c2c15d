"""`finetune sweep`: Optuna trials as ordinary runs, the study in study.db, best.yaml, median pruning.

Tiny models on a 64-row slice of SST-2, 8 optimizer steps, an evaluation every 2 steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import write_tiny_config

from finetune.cli import main as cli_main
from finetune.config.files import load_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SMALL = {
    "data.max_train_samples": 64,
    "data.max_eval_samples": 32,
    "train.micro_batch_size": 8,
    "train.gradient_accumulation_steps": 1,
    "train.eval_every_steps": 2,
    "train.log_every_steps": 4,
}


def _study(root: Path) -> Any:
    import optuna

    return optuna.load_study(study_name=root.name, storage=f"sqlite:///{root / 'study.db'}")


@pytest.mark.slow
def test_sweep_writes_study_trials_and_a_best_yaml_that_trains(
    tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # loss is minimised: the study's direction follows checkpoint.best_metric
    space = {
        "train.learning_rate": {"low": 1e-4, "high": 3e-3, "log": True},
        "train.warmup_ratio": {"choices": [0.0, 0.1]},
    }
    cfg = write_tiny_config(tmp_path, {**SMALL, "checkpoint.best_metric": "loss", "sweep.space": space})
    assert cli_main(["sweep", "--config", str(cfg), "--trials", "2"]) == 0
    root = tmp_path / "run"
    study = _study(root)
    assert study.direction.name == "MINIMIZE" and [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    # trial 0 is the config's own values (the baseline); each trial an ordinary run directory
    assert study.trials[0].params == {"train.learning_rate": 1e-3, "train.warmup_ratio": 0.1}
    for t in study.trials:
        run = root / f"trial-{t.number:03d}"
        ev = json.loads((run / "eval.json").read_text())
        assert t.value == ev["loss"] and (run / "final" / "model.safetensors").is_file()
        assert load_config(run / "config.yaml").train.learning_rate == t.params["train.learning_rate"]
        assert json.loads((run / "trial.json").read_text())["state"] == "complete"
        # the loop reported every periodic evaluation (steps 2, 4, 6; the last one is the trial's value)
        assert sorted(t.intermediate_values) == [2, 4, 6]
    best = load_config(root / "best.yaml")  # the normal loader: ready to train
    assert study.best_value == min(t.value for t in study.trials)
    assert best.train.learning_rate == study.best_params["train.learning_rate"]
    assert best.train.warmup_ratio == study.best_params["train.warmup_ratio"]
    assert best.run.output_dir == str(root / "best") and best.sweep.space.keys() == space.keys()
    err = capsys.readouterr().err
    assert err.count("\ntrial ") + err.startswith("trial ") == 2 and "best: trial" in err


@pytest.mark.slow
def test_a_trial_below_the_median_is_pruned_and_left_as_a_marked_run(tmp_path: Path, data_dir: Path) -> None:
    import optuna

    cfg = write_tiny_config(tmp_path, {**SMALL, "sweep.startup_trials": 1})
    root = tmp_path / "run"
    root.mkdir()
    # a finished trial that scored 1.0 at every evaluation: the median any real trial falls below
    study = optuna.create_study(study_name="run", storage=f"sqlite:///{root / 'study.db'}", direction="maximize")
    space = load_config(cfg).sweep.space
    dist = {k: optuna.distributions.FloatDistribution(s.low, s.high, log=s.log) for k, s in space.items()}
    study.add_trial(
        optuna.trial.create_trial(
            params={k: s.low for k, s in space.items()},
            distributions=dist,
            value=1.0,
            intermediate_values={2: 1.0, 4: 1.0, 6: 1.0},
        )
    )
    assert cli_main(["sweep", "--config", str(cfg), "--trials", "1"]) == 0
    trial = _study(root).trials[1]
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [2]  # stopped at the first evaluation
    run = root / "trial-001"
    note = json.loads((run / "trial.json").read_text())
    assert note["state"] == "pruned" and note["step"] == 2 and note["value"] == trial.intermediate_values[2] < 1.0
    assert (run / "config.yaml").is_file() and not (run / "final").exists()  # an ordinary run dir, stopped early
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 2
    assert "sweep: trial 1 pruned at step 2" in (run / "train.log").read_text()


@pytest.mark.parametrize(
    "updates, argv_tail, needle",
    [
        (
            {"sweep.space": {"train.learnig_rate": {"low": 1e-5, "high": 1e-3}}},
            ["--trials", "2"],
            "sweep.space: train.learnig_rate is not a config key that a trial can set (did you mean "
            "train.learning_rate?)",
        ),
        ({"sweep.space": {"run.output_dir": {"choices": ["a", "b"]}}}, ["--trials", "2"], "run.output_dir is not"),
        ({"sweep.space": {"train.learning_rate": {"low": 1e-3, "high": 1e-5}}}, ["--trials", "2"], "low <= high"),
        ({}, ["--trials", "0"], "--trials 0: a sweep runs at least one trial"),
        ({"data.validation_file": None}, ["--trials", "1"], "scores trials on validation data"),
    ],
)
def test_sweep_bad_arguments_are_one_line(
    tmp_path: Path,
    data_dir: Path,
    capsys: pytest.CaptureFixture[str],
    updates: dict[str, Any],
    argv_tail: list[str],
    needle: str,
) -> None:
    cfg = write_tiny_config(tmp_path, {**SMALL, **updates})
    assert cli_main(["sweep", "--config", str(cfg), *argv_tail]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()  # nothing written
