"""The training loop: exact gradient accumulation on ragged windows, the step budget, and one real
`accelerate launch` run end to end whose exported model loads in a `transformers.pipeline`."""

from __future__ import annotations

import copy
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
import torch.nn.functional as F
from conftest import ROOT, TINY

import finetune.train as train_mod
from finetune import runtime
from finetune.config_io import load_config, parse_yaml12, validate_config
from finetune.data import Collator
from finetune.final import export_final

# Plain SGD, lr 1, no decay/clipping/warmup, fixed order: the optimizer sees exactly the accumulated gradient.
EXACT = {
    "data.max_train_samples": 10,
    "data.max_eval_samples": 8,
    "data.group_by_length": False,
    "train.optimizer": "sgd",
    "train.learning_rate": 1.0,
    "train.weight_decay": 0.0,
    "train.max_grad_norm": None,
    "train.lr_scheduler": "constant",
    "train.warmup_steps": 0,
    "train.epochs": 1,
    "train.log_every_steps": 1,
}


class _Spy:
    """Wraps train.py's build_* functions to record the data order and, before each optimizer step,
    the parameters and the gradient the optimizer is about to apply."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        self.ref_model: torch.nn.Module | None = None
        self.loader_args: tuple[Any, ...] = ()
        self.sampler: Any = None
        real_loader, real_opt = train_mod.build_train_loader, train_mod.build_optimizer

        def build_train_loader(ds: Any, tokenizer: Any, *args: Any) -> Any:
            loader, sampler = real_loader(ds, tokenizer, *args)
            self.loader_args, self.sampler = (ds, tokenizer), sampler
            return loader, sampler

        def build_optimizer(cfg: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
            opt = real_opt(cfg, model)
            self.ref_model = copy.deepcopy(model)
            names = {id(p): n for n, p in model.named_parameters()}

            def pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                params = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
                self.steps.append(
                    (
                        {n: p.detach().clone() for n, p in params.items()},
                        {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None},
                    )
                )

            opt.register_step_pre_hook(pre_step)
            return opt

        monkeypatch.setattr(train_mod, "build_train_loader", build_train_loader)
        monkeypatch.setattr(train_mod, "build_optimizer", build_optimizer)


def _window_gradients(
    spy: _Spy, windows: list[list[list[int]]], params: list[dict[str, torch.Tensor]], loss_of: Callable
) -> list[dict[str, torch.Tensor]]:
    """Gradients an independent plain-torch computation gets at the given parameters for each window."""
    ds, tokenizer = spy.loader_args
    collate = Collator(tokenizer)
    model = spy.ref_model
    assert model is not None
    model.train()
    out = []
    for window, p0 in zip(windows, params, strict=True):
        model.load_state_dict(p0, strict=False)
        model.zero_grad(set_to_none=True)
        micro_losses = []
        for micro in window:
            batch = collate([dict(ds[i]) for i in micro])
            labels = batch.pop("labels")
            per_sample = F.cross_entropy(model(**batch).logits.float(), labels, reduction="none")
            micro_losses.append(per_sample)
        loss_of(micro_losses).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    return out


def _rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).flatten() for k in a]).norm()
    return float(diff / torch.cat([b[k].flatten() for k in b]).norm())


def test_accumulated_gradient_equals_full_batch_gradient_on_ragged_windows(
    tiny_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10 samples, micro-batch 4, accumulation 2: micro-batches [4, 4, 2] -> windows [4, 4] and [2]
    spy = _Spy(monkeypatch)
    cfg = tiny_config({**EXACT, "train.micro_batch_size": 4, "train.gradient_accumulation_steps": 2})
    assert train_mod.main(["--config", str(cfg)]) == 0

    spy.sampler.set_epoch(0)
    batches = spy.sampler.batches()
    assert [len(b) for b in batches] == [4, 4, 2]
    windows = [batches[0:2], batches[2:3]]
    assert len(spy.steps) == 2  # one optimizer step per window, the short tail included
    params = [p for p, _ in spy.steps]
    loop_grads = [g for _, g in spy.steps]

    # full-batch gradient of each window: the mean loss over all of the window's samples
    full = _window_gradients(spy, windows, params, lambda ls: torch.cat(ls).mean())
    errors = [_rel_err(g, f) for g, f in zip(loop_grads, full, strict=True)]
    assert max(errors) <= 1e-5, errors

    # the test can tell: the usual per-micro-batch mean divided by the accumulation count (what
    # `loss.mean()` + Accelerate's division gives) is right for the [4, 4] window and wrong for [2]
    naive = _window_gradients(spy, windows, params, lambda ls: sum(micro_loss.mean() for micro_loss in ls) / 2)
    assert _rel_err(naive[0], full[0]) <= 1e-5
    assert _rel_err(naive[1], full[1]) > 0.4

    # and SGD with lr 1 applied exactly that gradient (the second step starts from p - g)
    step1 = {n: params[0][n] - loop_grads[0][n] for n in loop_grads[0]}
    assert _rel_err({n: params[1][n] for n in step1}, step1) <= 1e-6


def test_batch_layouts_with_the_same_windows_train_the_same_weights(
    tiny_config: Callable[..., Path], tmp_path: Path
) -> None:
    """micro 4 x accumulation 2 and micro 8 x accumulation 1 both make windows [8] and [2]."""
    from safetensors.torch import load_file

    a = tiny_config(
        {
            **EXACT,
            "train.micro_batch_size": 4,
            "train.gradient_accumulation_steps": 2,
            "run.output_dir": str(tmp_path / "a"),
        },
        name="a.yaml",
    )
    b = tiny_config(
        {
            **EXACT,
            "train.micro_batch_size": 8,
            "train.gradient_accumulation_steps": 1,
            "run.output_dir": str(tmp_path / "b"),
        },
        name="b.yaml",
    )
    assert train_mod.main(["--config", str(a)]) == 0
    assert train_mod.main(["--config", str(b)]) == 0
    wa, wb = (
        load_file(tmp_path / "a" / "final" / "model.safetensors"),
        load_file(tmp_path / "b" / "final" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys()
    moved = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert moved <= 1e-5
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


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
    from finetune.model import build_model, build_tokenizer

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


def test_accelerate_launch_end_to_end_and_pipeline(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = Path(sys.executable).parent / "accelerate"
    launch = [str(launcher), "launch"] if launcher.is_file() else [sys.executable, "-m", "accelerate.commands.launch"]
    cmd = [
        *launch, "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "finetune/train.py", "--config", "configs/tiny-debug.yaml", f"run.output_dir={out}",
    ]  # fmt: skip
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


def test_trackers_tensorboard_and_mlflow(
    tiny_config: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard, and MLflow for real (a local file store, offline): MLflow gets every row of metrics.jsonl
    at its step and the resolved config as parameters, its run named after the run directory."""
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from finetune.config_io import flat_config

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

    from finetune.config import LogConfig

    # log.trackers offers every tracker of Accelerate's log_with (but "all")
    offered = set(LogConfig.model_fields["trackers"].annotation.__args__[0].__args__)
    assert offered == {t.value for t in LoggerType} - {"all"}
    cfg = tiny_config({"log.trackers": ["tensorboard", "wandb"]})
    assert train_mod.main(["--config", str(cfg)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "log.trackers: wandb needs the package wandb" in err[0], err
    assert not (tmp_path / "run").exists()


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(
    tiny_config: Callable[..., Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job log (stderr not a terminal) got tqdm's carriage-return frames, one per step and more: now a
    plain line per interval (here 0 s: one per step) with step/total, elapsed, ETA, rate, loss and
    samples/s; a terminal keeps tqdm's bar."""
    import io

    monkeypatch.setenv("TQDM_MININTERVAL", "0")
    cfg = tiny_config({"data.max_train_samples": 64, "train.log_every_steps": 1})
    assert train_mod.main(["--config", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
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

    from finetune.model import build_model, build_tokenizer

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
    runtime.setup_logging(acc, None)


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
