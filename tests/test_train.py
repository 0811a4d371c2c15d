"""The training loop: the step budget, and one real `accelerate launch` run end to end whose exported
model loads in a `transformers.pipeline` (exact accumulation is tested in tests/test_window.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, TINY

import finetune.train as train_mod
from finetune.config.files import load_config, parse_yaml12, validate_config
from finetune.deploy.final import export_final
from finetune.training import runtime


@pytest.mark.slow
def test_max_steps_ends_the_run_and_the_schedule(tiny_config: Callable[..., Path], tmp_path: Path) -> None:
    # 64 rows, micro 4 x accumulation 2: 8 windows per epoch; epochs 3 but max_steps 5 -> 5 steps
    cfg = tiny_config(
        {
            "data.max_train_samples": 64,
            "data.max_eval_samples": 8,
            "train.micro_batch_size": 4,
            "train.epochs": 3,
            "train.max_steps": 5,
            "train.warmup_ratio": 0.0,
            "train.lr_scheduler": "linear",
            "train.log_every_steps": 1,
        }
    )
    assert train_mod.main(["--config", str(cfg)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5]
    lr0 = load_config(cfg).train.learning_rate
    # linear decay over exactly 5 steps: lr after step k is lr0 * (5 - k) / 5, reaching 0 at the end
    assert [r["lr"] for r in train_rows] == pytest.approx([lr0 * (5 - k) / 5 for k in range(1, 6)], rel=1e-6)
    # fractional epochs: 0.5 epoch of 8 windows is 4 steps
    cfg2 = tiny_config(
        {
            "data.max_train_samples": 64,
            "data.max_eval_samples": 8,
            "train.micro_batch_size": 4,
            "train.epochs": 0.5,
            "train.log_every_steps": 1,
            "run.overwrite": True,
        }
    )
    assert train_mod.main(["--config", str(cfg2)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]


def test_adamw_does_not_decay_biases_and_norms(tiny_config: Callable[..., Path]) -> None:
    from finetune.model.load import build_model, build_tokenizer

    cfg = load_config(tiny_config())
    model = build_model(cfg, ["negative", "positive"], build_tokenizer(cfg))
    opt = train_mod.build_optimizer(cfg, model)
    assert isinstance(opt, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    no_decay = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert decay and no_decay and not decay & no_decay
    assert decay | no_decay == set(names.values())
    assert all(n.endswith(".bias") or "LayerNorm" in n for n in no_decay), no_decay
    assert "bert.encoder.layer.0.attention.self.query.weight" in decay and "classifier.weight" in decay


# ------------------------------------------------------------------------------------------------
# End to end through `accelerate launch`.


@pytest.mark.slow
def test_accelerate_launch_end_to_end_and_pipeline(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = Path(sys.executable).parent / "accelerate"
    launch = [str(launcher), "launch"] if launcher.is_file() else [sys.executable, "-m", "accelerate.commands.launch"]
    cmd = [
        *launch,
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "finetune/train.py",
        "--config",
        "configs/tiny-debug.yaml",
        f"run.output_dir={out}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FINETUNE_DATA_DIR": str(data_dir)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "done:" in proc.stderr

    cfg = load_config(TINY, [f"run.output_dir={out}"])
    names = ["negative", "positive"]

    # eval.json: final validation metrics at the top level
    ev = json.loads((out / "eval.json").read_text())
    assert 0.0 <= ev["accuracy"] <= 1.0 and 0.0 <= ev["macro_f1"] <= 1.0
    assert set(ev["per_class"]) == set(names)
    assert {"precision", "recall", "f1"} <= set(ev["per_class"]["negative"])
    cm = ev["confusion_matrix"]
    assert len(cm) == 2 and all(len(r) == 2 for r in cm) and sum(map(sum, cm)) == cfg.data.max_eval_samples
    assert ev["accuracy"] == pytest.approx((cm[0][0] + cm[1][1]) / cfg.data.max_eval_samples)

    # metrics.jsonl: a row per logging interval (steps 2, 4, ...) and eval rows (every 4 steps + final)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_per_epoch = -(
        -cfg.data.max_train_samples // (cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps)
    )
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(2, steps_per_epoch + 1, 2))
    assert all({"lr", "samples_per_s"} <= set(r) for r in train_rows)
    assert [r["step"] for r in rows if "eval_accuracy" in r][-1] == steps_per_epoch
    assert rows[-1]["eval_accuracy"] == pytest.approx(ev["accuracy"])

    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    prov = json.loads((out / "provenance.json").read_text())
    assert {"torch", "transformers", "accelerate", "datasets", "git_commit"} <= set(prov)
    train_file = data_dir / "sst2" / "train.tsv"
    assert prov["data_files"]["train"]["sha256"] == hashlib.sha256(train_file.read_bytes()).hexdigest()
    report = json.loads((out / "data_report.json").read_text())
    assert report["splits"]["train"]["rows"] == cfg.data.max_train_samples
    assert report["splits"]["validation"]["rows"] == cfg.data.max_eval_samples
    # config.yaml: the resolved config, reloadable
    assert validate_config(parse_yaml12((out / "config.yaml").read_text())) == cfg

    # the export loads in a pipeline and predicts the config's label names
    from transformers import pipeline

    clf = pipeline("text-classification", model=str(out / "final"), device="cpu")
    preds = clf(["a wonderful , moving film", "dull and lifeless"])
    assert len(preds) == 2 and all(p["label"] in names for p in preds)
    assert all(0.0 < p["score"] <= 1.0 for p in preds)


@pytest.mark.slow
def test_trackers_tensorboard_and_mlflow(
    tiny_config: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard, and MLflow for real (a local file store, offline): MLflow gets every row of metrics.jsonl
    at its step and the resolved config as parameters, its run named after the run directory."""
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from finetune.config.files import flat_config

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store needs no database: fastest here
    # with a test split: eval.json holds its metrics under `test`, the trackers get them too
    cfg = tiny_config(
        {
            "data.max_train_samples": 64,
            "data.max_eval_samples": 16,
            "data.test_file": "sst2/dev.tsv",
            "train.log_every_steps": 1,
            "train.eval_every_steps": 1,
            "log.trackers": ["tensorboard", "mlflow"],
        }
    )
    assert train_mod.main(["--config", str(cfg)]) == 0
    run = tmp_path / "run"
    ev = json.loads((run / "eval.json").read_text())
    assert ev["test"]["num_samples"] == 16 and sum(map(sum, ev["test"]["confusion_matrix"])) == 16
    assert ev["test"]["confusion_matrix"] == ev["confusion_matrix"]  # the same 16 dev rows
    events = sorted(run.rglob("events.out.tfevents.*"))
    assert events
    tags = set()
    for e in events:
        acc = EventAccumulator(str(e))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"loss", "lr", "eval_accuracy", "test_accuracy"} <= tags, tags

    client = mlflow.tracking.MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert found.info.run_name == "run" and found.info.status == "FINISHED"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                expected.setdefault(key, []).append((row["step"], float(value)))
    assert {"loss", "lr", "samples_per_s", "eval_accuracy", "eval_loss"} <= set(expected)
    for key, points in expected.items():
        logged = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, key))
        assert [s for s, _ in logged] == [s for s, _ in sorted(points)], key
        assert [v for _, v in logged] == pytest.approx([v for _, v in sorted(points)], rel=1e-6), key
    assert {m.key for m in client.get_metric_history(found.info.run_id, "test_accuracy")} == {"test_accuracy"}
    params = found.data.params
    resolved = flat_config(load_config(run / "config.yaml"))
    assert params == {k: str(v) for k, v in resolved.items()}


def test_tracker_without_its_package_is_one_line(
    tiny_config: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """wandb is not installed here: Accelerate dropped the tracker without a word, and the run went on."""
    from accelerate.utils import LoggerType

    from finetune.config.schema import LogConfig

    # log.trackers offers every tracker of Accelerate's log_with (but "all")
    offered = set(LogConfig.model_fields["trackers"].annotation.__args__[0].__args__)
    assert offered == {t.value for t in LoggerType} - {"all"}
    cfg = tiny_config({"log.trackers": ["tensorboard", "wandb"]})
    assert train_mod.main(["--config", str(cfg)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "log.trackers: wandb needs the package wandb" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(
    tiny_config: Callable[..., Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job log (stderr not a terminal) gets no tqdm carriage-return frames (one per step and more) but a
    plain line per interval (here 0 s: one per step) with step/total, elapsed, ETA, rate, loss and
    samples/s; a terminal keeps tqdm's bar. train.log, which has no bar, gets each training row and each
    evaluation as a line, with metrics.jsonl's values; stderr does not get them twice."""
    import io

    monkeypatch.setenv("TQDM_MININTERVAL", "0")
    cfg = tiny_config({"data.max_train_samples": 64, "train.log_every_steps": 1, "train.eval_every_steps": 1})
    assert train_mod.main(["--config", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    run_dir = cfg.parent / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows, eval_rows = [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2] and [r["step"] for r in eval_rows][:1] == [1]
    log = (run_dir / "train.log").read_text()
    for r in train_rows:
        line = f"step {r['step']}/2 epoch 1/1: loss {r['loss']:.4f}, lr {r['lr']:.2e}"
        assert line in log and line not in err, log
    assert f"step 1: eval accuracy {eval_rows[0]['eval_accuracy']:.4f}" in log
    assert f"loss {eval_rows[0]['eval_loss']:.4f}" in log
    lines = [line for line in err.splitlines() if line.startswith("train ")]
    assert [line.split(" |")[0] for line in lines] == ["train 0/2", "train 1/2", "train 2/2"], err
    assert "elapsed 00:0" in lines[-1] and "ETA 00:00" in lines[-1] and "step/s" in lines[-1]
    assert "loss=" in lines[-1] and "samples/s=" in lines[-1]

    # the default interval: quick steps print the last line only; a terminal gets tqdm's frames
    monkeypatch.delenv("TQDM_MININTERVAL")
    log = io.StringIO()
    with runtime.progress_bar(total=50, desc="train", file=log) as bar:
        for _ in range(50):
            bar.update(1)
    assert log.getvalue().count("\n") == 1 and log.getvalue().startswith("train 50/50 |")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    with runtime.progress_bar(total=3, desc="train", file=term) as bar:
        bar.update(3)
    assert "\r" in term.getvalue() and "|" in term.getvalue()


def test_export_is_atomic(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # a failure half way through the export leaves the previous final/ as it was, never a mix
    from accelerate import Accelerator

    from finetune.model.load import build_model, build_tokenizer

    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}"])
    tok = build_tokenizer(cfg)
    model = build_model(cfg, ["negative", "positive"], tok)
    out = tmp_path / "final"
    accelerator = Accelerator(cpu=True)
    export_final(accelerator, model, tok, out, 128)
    assert "Writing model shards" not in capfd.readouterr().err  # no progress bar for a sub-second save
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    class BrokenTokenizer:
        def save_pretrained(self, path: Any) -> None:
            raise OSError("disk full")

    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # a different export
    with pytest.raises(OSError, match="disk full"):
        export_final(accelerator, model, BrokenTokenizer(), out, 128)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    export_final(accelerator, model, tok, out, 128)  # the leftover temporary does not get in the way
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_setup_logging_closes_the_previous_log_file(tmp_path: Path) -> None:
    import logging
    from types import SimpleNamespace

    acc: Any = SimpleNamespace(is_main_process=True)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    runtime.setup_logging(acc, tmp_path / "a")
    first = [h for h in train_mod.logger.handlers if isinstance(h, logging.FileHandler)]
    runtime.setup_logging(acc, tmp_path / "b")
    assert len(first) == 1 and first[0].stream is None  # closed, not leaked
    assert [h.baseFilename for h in train_mod.logger.handlers if isinstance(h, logging.FileHandler)] == [
        str(tmp_path / "b" / "train.log")
    ]
    assert [h.baseFilename for h in runtime.progress_log.handlers] == [str(tmp_path / "b" / "train.log")]
    runtime.setup_logging(acc, None)
    assert runtime.progress_log.handlers == []  # no run directory: the rows have nowhere to go, not stderr


@pytest.mark.slow
def test_clipping_folded_into_fused_adamw_equals_clip_grad_norm(
    tmp_path: Path, tiny_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused AdamW dividing by grad_scale = max(1, norm / max_norm) gives the weights of
    clip_grad_norm_ followed by the step, with clipping active on every step."""
    from safetensors.torch import load_file

    norms: list[float] = []
    real_fold = train_mod.fold_clipping_into_step

    def spy(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        norm = real_fold(optimizer, params, max_norm)
        norms.append(float(norm))
        return norm

    updates = {
        "data.max_train_samples": 64,
        "data.max_eval_samples": 16,
        "train.max_grad_norm": 0.005,
        "train.log_every_steps": 1,
    }
    monkeypatch.setattr(train_mod, "fold_clipping_into_step", spy)
    folded = tiny_config({**updates, "run.output_dir": str(tmp_path / "folded")}, name="folded.yaml")
    assert train_mod.main(["--config", str(folded)]) == 0
    assert len(norms) == 2 and min(norms) > 0.005  # the folded path ran, and it clipped
    monkeypatch.setattr(train_mod, "clipping_folds_into_step", lambda *a: False)
    plain = tiny_config({**updates, "run.output_dir": str(tmp_path / "plain")}, name="plain.yaml")
    assert train_mod.main(["--config", str(plain)]) == 0
    assert len(norms) == 2  # the reference run used clip_grad_norm_
    a, b = (
        load_file(tmp_path / "folded" / "final" / "model.safetensors"),
        load_file(tmp_path / "plain" / "final" / "model.safetensors"),
    )
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_evaluate_runs_without_autograd(tiny_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluation builds no autograd graph (memory): every forward inside `collect_outputs` sees grad mode off."""
    seen: list[bool] = []
    real = train_mod.collect_outputs

    def spy(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        handle = model.register_forward_pre_hook(lambda m, a: seen.append(torch.is_grad_enabled()))
        try:
            return real(model, *args, **kwargs)
        finally:
            handle.remove()

    monkeypatch.setattr(train_mod, "collect_outputs", spy)
    cfg = tiny_config({"data.max_train_samples": 32, "data.max_eval_samples": 16})
    assert train_mod.main(["--config", str(cfg)]) == 0
    assert seen and not any(seen)
