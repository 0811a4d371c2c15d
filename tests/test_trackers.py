"""Trackers: a server that is down at start is one line and nothing written; a tracker that
fails mid-run is reported once and dropped while training, checkpoints and metrics.jsonl go on."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from accelerate.tracking import GeneralTracker

from finetune import train as train_mod
from finetune.training.trackers import reach_trackers, tracker_uri


def _closed_port() -> int:
    with socket.socket() as s:  # bound then released: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tracker_uri_follows_each_trackers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("AIM_REPO", raising=False)
    assert tracker_uri("mlflow") == "http://mlflow.example:5000"
    assert tracker_uri("wandb") is None  # offline: nothing to reach
    assert tracker_uri("tensorboard") is None and tracker_uri("aim") is None
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.internal")
    assert tracker_uri("wandb") == "https://wandb.internal"
    # a local store is not probed (a file URI or a path is no server)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/mlruns")
    reach_trackers(["mlflow", "tensorboard"], timeout_s=0.1)


def test_a_tracker_server_down_at_start_is_one_line_and_nothing_written(
    tiny_config: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """MLflow pointed at a port where no server listens (no network needed): exit 2, one line naming the
    tracker and the URI, no run directory (before: a 120-line traceback after a half-written run dir)."""
    uri = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = tiny_config({"log.trackers": ["tensorboard", "mlflow"]})
    assert train_mod.main(["--config", str(cfg)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith("error: log.trackers: mlflow cannot be reached at " + uri), err
    assert not (tmp_path / "run").exists()


class FlakyTracker(GeneralTracker):
    """A tracker whose server goes away after `fail_after` logs (no network: it only counts)."""

    name = "mlflow"
    requires_logging_directory = False
    fail_after = 2
    instances: list[FlakyTracker] = []

    def __init__(self, experiment_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.logged: list[int | None] = []
        self.calls_after_failure = 0
        self.config: dict[str, Any] = {}
        self.kwargs = kwargs
        self.finished = False
        FlakyTracker.instances.append(self)

    @property
    def tracker(self) -> Any:
        return self

    def store_init_configuration(self, values: dict) -> None:
        self.config = dict(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if len(self.logged) >= self.fail_after:
            self.calls_after_failure += 1
            raise ConnectionError("HTTPConnectionPool(host='mlflow', port=5000): Max retries exceeded")
        self.logged.append(step)

    def finish(self) -> None:
        self.finished = True


@pytest.mark.slow
def test_a_tracker_failing_mid_run_is_reported_once_and_dropped(
    tiny_config: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import accelerate.tracking

    monkeypatch.setitem(accelerate.tracking.LOGGER_TYPE_TO_CLASS, "mlflow", FlakyTracker)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # nothing to reach
    FlakyTracker.instances.clear()
    cfg = tiny_config(
        {
            "log.trackers": ["mlflow"],
            "data.max_train_samples": 96,
            "train.micro_batch_size": 8,
            "train.gradient_accumulation_steps": 2,
            "train.log_every_steps": 1,
            "checkpoint.every_steps": 2,
        }
    )
    assert train_mod.main(["--config", str(cfg)]) == 0
    err = capsys.readouterr().err
    (tracker,) = FlakyTracker.instances
    assert tracker.logged == [1, 2] and tracker.calls_after_failure == 1  # never called again after its error
    assert tracker.config["train.learning_rate"] == pytest.approx(1e-3)  # the resolved config was stored
    assert not tracker.finished  # dropped: not even its finish
    assert tracker.kwargs == {"run_name": "run"}  # Accelerate's project name, the run named after its directory
    warnings = [line for line in err.splitlines() if "log.trackers: mlflow failed" in line]
    assert len(warnings) == 1, err
    assert "at step 3" in warnings[0] and "Max retries exceeded" in warnings[0] and "dropped" in warnings[0]
    run = tmp_path / "run"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[:6] == [1, 2, 3, 4, 5, 6]  # every step logged to metrics.jsonl, after the failure too
    assert (run / "checkpoints" / "step_00000004").is_dir() and (run / "final" / "model.safetensors").is_file()
