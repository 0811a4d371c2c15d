"""Exact resume: runs stopped by SIGTERM (at chosen points, through FINETUNE_TEST_ONLY_FAULTS), by a crash
inside a checkpoint write, or left with a truncated checkpoint, resumed with checkpoint.resume=auto,
end with the same weights and the same logged losses as an uninterrupted run. Also: refused and
accepted config changes, and a SIGTERM sent to the `accelerate launch` process alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, write_tiny_config
from safetensors.torch import load_file

from finetune.core import faults
from finetune.train import main
from finetune.training import checkpoint as ckpt
from finetune.training import runtime

# 128 rows, global micro-batch 16, accumulation 2: 8 micro-batches = 4 optimizer steps per epoch,
# 2 epochs = 8 steps; a periodic checkpoint every 3 steps; a loss logged at every step.
RUN = {
    "data.max_train_samples": 128,
    "data.max_eval_samples": 64,
    "train.epochs": 2,
    "train.log_every_steps": 1,
    "checkpoint.every_steps": 3,
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _config(directory: Path, extra: dict[str, Any] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_tiny_config(directory, {**RUN, **(extra or {})})


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan waits for its new parent to reap it)."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return False


def _max_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """The uninterrupted run."""
    directory = tmp_path_factory.mktemp("reference")
    assert main(["--config", str(_config(directory))]) == 0
    return directory / "run"


def _assert_same_as_reference(run: Path, reference: Path, after_step: int) -> None:
    assert _max_diff(run, reference) <= 1e-7
    ref, got = _losses(reference), _losses(run)
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    assert {s: got[s] for s in got if s > after_step} == {s: ref[s] for s in ref if s > after_step}


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, stopped_at",
    [
        ("sigterm_at_step:2", 2),  # mid-epoch, between periodic checkpoints
        ("sigterm_at_step:4", 4),  # the last step of epoch 0: the epoch boundary
        ("sigterm_at_batch:9", 5),  # first micro-batch of epoch 1, inside an accumulation window
    ],
)
def test_sigterm_then_resume_is_exact(
    fault: str,
    stopped_at: int,
    reference: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cfg = _config(tmp_path)
    run = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, fault)
    assert main(["--config", str(cfg)]) == runtime.EXIT_CODES["SIGTERM"]
    err = capfd.readouterr().err
    assert f"SIGTERM: stopped at step {stopped_at}" in err and "checkpoint.resume=auto" in err
    # the preemption checkpoint is the step where the signal was handled, not the last periodic one
    newest = ckpt.newest_valid_checkpoint(run)
    assert newest == ckpt.checkpoint_dir(run, stopped_at)
    progress = ckpt.read_progress(newest)
    assert progress.step == stopped_at
    assert (progress.epoch, progress.batches_in_epoch) == divmod(2 * stopped_at, 8)

    monkeypatch.delenv(faults.ENV)
    if stopped_at == 2:
        # a change that changes the result is refused, naming the key
        assert main(["--config", str(cfg), "checkpoint.resume=auto", "train.learning_rate=0.002"]) == 2
        err = capfd.readouterr().err
        assert "train.learning_rate" in err and "cannot resume" in err
        assert main(["--config", str(cfg), "checkpoint.resume=auto", "train.micro_batch_size=8"]) == 2
        assert "train.micro_batch_size" in capfd.readouterr().err
        # harmless changes (evaluation and logging intervals, checkpoint interval) are accepted
        harmless = ["train.eval_every_steps=3", "checkpoint.every_steps=4"]
    else:
        harmless = []
    assert main(["--config", str(cfg), "checkpoint.resume=auto", *harmless]) == 0
    assert f"resumed from {newest}" in capfd.readouterr().err
    _assert_same_as_reference(run, reference, stopped_at)


@pytest.mark.slow
def test_sigint_checkpoints_and_exits_130(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _config(tmp_path, {"checkpoint.every_steps": None})  # a preemption checkpoint needs no interval
    monkeypatch.setenv(faults.ENV, "sigint_at_batch:3")  # inside the window of step 2
    assert main(["--config", str(cfg)]) == runtime.EXIT_CODES["SIGINT"] == 130
    assert "SIGINT: stopped at step 2" in capfd.readouterr().err
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["step_00000002"]


@pytest.mark.slow
def test_crash_inside_a_checkpoint_write_resumes_from_the_previous_one(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _config(tmp_path)
    run = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, "crash_in_save:6")
    with pytest.raises(faults.InjectedCrash):
        main(["--config", str(cfg)])
    root = run / "checkpoints"
    # the state files of step 6 were written, but only into the temporary directory
    assert (root / f"{ckpt.TMP_PREFIX}step_00000006" / "model.safetensors").is_file()
    assert not ckpt.checkpoint_dir(run, 6).exists()
    monkeypatch.delenv(faults.ENV)
    capfd.readouterr()
    assert main(["--config", str(cfg), "checkpoint.resume=auto"]) == 0
    assert f"resumed from {ckpt.checkpoint_dir(run, 3)}" in capfd.readouterr().err
    assert not any(p.name.startswith(ckpt.TMP_PREFIX) for p in root.iterdir())  # stale temporary removed
    _assert_same_as_reference(run, reference, 3)


@pytest.mark.slow
def test_truncated_newest_checkpoint_is_skipped(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _config(tmp_path)
    run = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, "sigterm_at_step:7")
    assert main(["--config", str(cfg)]) == 143
    monkeypatch.delenv(faults.ENV)
    newest = ckpt.checkpoint_dir(run, 7)
    weights = newest / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert "truncated" in (ckpt.verify_checkpoint(newest) or "")
    capfd.readouterr()
    assert main(["--config", str(cfg), "checkpoint.resume=auto"]) == 0
    err = capfd.readouterr().err
    assert f"skipping checkpoint {newest}" in err
    assert f"resumed from {ckpt.checkpoint_dir(run, 6)}" in err
    _assert_same_as_reference(run, reference, 6)


def test_auto_resume_refuses_a_foreign_directory(
    tmp_path: Path, data_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _config(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("someone else's files")
    assert main(["--config", str(cfg), "checkpoint.resume=auto"]) == 2
    assert "holds no run of this config" in capfd.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_sigterm_to_the_accelerate_launcher_alone_reaches_training(tmp_path: Path, data_dir: Path) -> None:
    """`accelerate launch` forwards no signals; the parent-death signal makes its death reach the trainer."""
    cfg = _config(tmp_path)
    run = tmp_path / "run"
    env = {**os.environ, faults.ENV: "wait_at_step:2", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "launch.log").open("w")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--cpu",
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(ROOT / "finetune" / "train.py"),
            "--config",
            str(cfg),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    marker = run / "fault_waiting"
    deadline = time.monotonic() + 240
    while not marker.is_file() and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    assert marker.is_file(), (tmp_path / "launch.log").read_text()[-3000:]
    time.sleep(0.2)
    trainer = int(marker.read_text())
    assert trainer != launcher.pid
    os.kill(launcher.pid, signal.SIGTERM)  # the launcher only: as a container runtime does
    launcher.wait(timeout=60)
    deadline = time.monotonic() + 120
    while _alive(trainer) and time.monotonic() < deadline:
        time.sleep(0.2)
    log.close()
    out = (tmp_path / "launch.log").read_text()
    assert not _alive(trainer), out[-3000:]
    assert "SIGTERM: stopped at step 2" in out, out[-3000:]
    newest = ckpt.newest_valid_checkpoint(run)
    assert newest == ckpt.checkpoint_dir(run, 2) and ckpt.read_progress(newest).step == 2


@pytest.mark.slow
def test_early_stopping_export_best_and_rotation(
    tmp_path: Path, data_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    patience = 2
    cfg = _config(
        tmp_path,
        {
            "train.eval_every_steps": 1,
            "checkpoint.every_steps": 1,
            "checkpoint.keep_last": 1,
            "checkpoint.export": "best",
            "train.early_stopping_patience": patience,
            "train.learning_rate": 3e-3,
        },
    )
    run = tmp_path / "run"
    assert main(["--config", str(cfg)]) == 0
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval_accuracy" in x]
    # the stop step computed independently from the logged evaluations (ties are no improvement)
    best, bad, stop = None, 0, None
    for row in evals:
        if best is None or row["eval_accuracy"] > best[0]:
            best, bad = (row["eval_accuracy"], row["step"]), 0
        else:
            bad += 1
        if bad >= patience and stop is None:
            stop = row["step"]
    last_step = max(_losses(run))
    assert stop is not None and last_step == stop < 8, (evals, last_step)
    assert f"early stopping at step {stop}" in capfd.readouterr().err
    # rotation: the newest checkpoint plus the best one (its own evaluation), nothing else
    best_dir = ckpt.checkpoint_dir(run, best[1])
    assert set(ckpt.list_checkpoints(run)) == {best_dir, ckpt.checkpoint_dir(run, stop)}
    # export=best: final/ holds the best checkpoint's weights
    final, chosen = load_file(run / "final" / "model.safetensors"), load_file(best_dir / "model.safetensors")
    assert all(bool((final[k] == chosen[k]).all()) for k in chosen)
    # a resume of the finished run does not train further, nor log or checkpoint its end again
    metrics_before = (run / "metrics.jsonl").read_text()
    manifest = ckpt.checkpoint_dir(run, stop) / ckpt.MANIFEST
    manifest_before = manifest.read_text()
    assert main(["--config", str(cfg), "checkpoint.resume=auto"]) == 0
    assert max(_losses(run)) == stop
    assert (run / "metrics.jsonl").read_text() == metrics_before
    assert manifest.read_text() == manifest_before


@pytest.mark.slow
def test_preemption_at_a_checkpoint_step_saves_once(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGTERM at step 3 with checkpoint.every_steps=3: the periodic checkpoint is the preemption one
    steps: list[int] = []
    real_save = ckpt.save_checkpoint

    def save(*args: Any, **kwargs: Any) -> Path:
        steps.append(args[2].step)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", save)
    monkeypatch.setenv(faults.ENV, "sigterm_at_step:3")
    assert main(["--config", str(_config(tmp_path))]) == 143
    assert steps == [3]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["step_00000003"]
