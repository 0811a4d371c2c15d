"""The wall-time budget (`train.max_minutes`): a clean stop with the best weights as final/, the time used
kept across a resume, and the refusals. The clock is the test-only `clock_step_seconds` fault (each optimizer
step counts as N seconds), so nothing sleeps and the stop step is known in advance. The 2-process agreement
is tests/test_multiprocess.py's `test_time_budget_stops_every_rank_at_the_same_step`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from finetune.core import faults
from finetune.train import main
from finetune.training import checkpoint as ckpt
from finetune.training import runtime
from finetune.training.budget import TimeBudget

# 256 rows in windows of 32: 8 steps an epoch, 2 epochs; an evaluation and a checkpoint every 2 steps
BUDGET = {
    "train.epochs": 2,
    "train.eval_every_steps": 2,
    "train.log_every_steps": 1,
    "checkpoint.every_steps": 2,
    "checkpoint.export": "best",
    "checkpoint.keep_last": 1,
    "train.max_minutes": 3,  # 180 s: at 30 s a step, spent at step 6
}


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_budget_counts_from_the_resumed_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "clock_step_seconds:30")
    budget = TimeBudget(3, used_s=90.0, step=3)
    assert [budget.used(s) for s in (3, 4, 6)] == [90.0, 120.0, 180.0]
    assert not budget.spent(179.9) and budget.spent(180.0)
    assert not TimeBudget(None).spent(1e9)
    monkeypatch.setenv(faults.ENV, "clock_step_seconds:30@1")  # another rank's fault: the real clock here
    assert TimeBudget(1, used_s=5.0).used(100) < 6.0


@pytest.mark.slow
def test_budget_stops_cleanly_with_the_best_weights_and_resume_keeps_the_time_used(
    tiny_config: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny_config(BUDGET)
    run = tmp_path / "run"
    # preempted at step 3 with 90 s used; resumed, the budget must end the run at step 6 (90 + 3 x 30), not 9
    monkeypatch.setenv(faults.ENV, "clock_step_seconds:30,sigterm_at_step:3")
    assert main(["--config", str(cfg)]) == runtime.EXIT_CODES["SIGTERM"]
    assert ckpt.read_progress(ckpt.checkpoint_dir(run, 3)).seconds_trained == 90.0
    monkeypatch.setenv(faults.ENV, "clock_step_seconds:30")
    assert main(["--config", str(cfg), "checkpoint.resume=auto"]) == 0
    err = capfd.readouterr().err
    assert "time budget of 3 minutes (train.max_minutes) spent at step 6" in err

    last = ckpt.read_progress(ckpt.newest_valid_checkpoint(run))
    assert (last.step, last.finished, last.seconds_trained) == (6, True, 180.0)
    rows = _rows(run)
    assert max(r["step"] for r in rows) == 6  # nothing trained past the budget
    evals = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    assert sorted(evals) == [2, 4, 6]
    best_step = min(evals, key=lambda s: (-evals[s], s))  # highest accuracy, earliest on ties
    final = json.loads((run / "eval.json").read_text())
    assert (final["step"], final["exported"]) == (best_step, "best")
    assert final["accuracy"] == pytest.approx(evals[best_step], abs=1e-9)
    exported = load_file(run / "final" / "model.safetensors")
    saved = load_file(ckpt.checkpoint_dir(run, best_step) / "model.safetensors")
    for name, tensor in exported.items():  # final/ holds the best checkpoint's weights (the head under its own name)
        match = [v for k, v in saved.items() if k.endswith(name) or name.endswith(k)]
        assert match and bool((match[0] == tensor).all()), name


@pytest.mark.parametrize(
    "updates, words",
    [
        ({"train.max_minutes": 0}, "train.max_minutes"),
        ({"train.max_minutes": -5}, "train.max_minutes"),
        ({"train.max_minutes": "soon"}, "train.max_minutes"),
        ({**BUDGET, "data.validation_file": None}, "give validation data"),
        ({**BUDGET, "train.eval_every_steps": None}, "checkpoint.export=best"),
        ({**BUDGET, "checkpoint.export": "last"}, "checkpoint.export=best"),
    ],
)
def test_a_budget_that_cannot_work_is_one_line_before_anything_is_written(
    updates: dict[str, Any], words: str, tiny_config: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny_config({**BUDGET, **updates})
    assert main(["--config", str(cfg)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert not (tmp_path / "run").exists()
