"""The training loop's behaviour at its edges, each through the real `main()` on the tiny model:
eval.json describes final/, launch-config dynamo is refused, resume settles interrupted saves first,
options without their data are refused, prediction truncates as training did, out-of-memory in the
optimizer step or in evaluation, a full disk, fp32 losses into backward, exact resume with dropout.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import write_tiny_config
from safetensors.torch import load_file

import finetune.train as train_mod
from finetune.assemble import build_eval_loaders
from finetune.config.files import load_config
from finetune.core import faults
from finetune.training import checkpoint as ckpt
from finetune.training import runtime

pytestmark = pytest.mark.usefixtures("one_thread", "data_dir")  # conftest.py

SMALL = {"data.max_train_samples": 64, "data.max_eval_samples": 32}


def _cfg(tmp_path: Path, extra: dict[str, Any] | None = None, name: str = "tiny.yaml") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return write_tiny_config(tmp_path, {**SMALL, **(extra or {})}, name=name)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _one_line_error(capfd: pytest.CaptureFixture[str]) -> str:
    err = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.slow
def test_eval_json_describes_the_exported_best_weights(tmp_path: Path) -> None:
    # lr 3e-2 makes this seed's validation accuracy peak before the end, so best != last
    cfg = _cfg(
        tmp_path,
        {
            "train.learning_rate": 3e-2,
            "train.max_steps": 8,
            "train.epochs": 4,
            "train.eval_every_steps": 2,
            "checkpoint.every_steps": 2,
            "checkpoint.keep_last": 1,
            "checkpoint.export": "best",
        },
    )
    assert train_mod.main(["--config", str(cfg)]) == 0
    run = tmp_path / "run"
    final = json.loads((run / "eval.json").read_text())
    best = ckpt.best_checkpoint(run, "accuracy")
    assert best is not None and final["exported"] == "best" and final["step"] == ckpt.read_progress(best).step
    assert final["step"] != 8, "the scenario needs a best step before the last one"
    assert _max_diff(_weights(run / "final" / "model.safetensors"), _weights(best / "model.safetensors")) == 0.0
    # the numbers are those of final/'s weights: the best checkpoint's own evaluation, not the last step's
    assert final["accuracy"] == ckpt.read_progress(best).eval["accuracy"]
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval_accuracy" in x][-1]
    assert last["step"] == 8


@pytest.mark.slow
def test_best_within_se_exports_the_latest_checkpoint_near_the_best(tmp_path: Path) -> None:
    # the run above with checkpoint.best_within_se: final/ is the latest checkpoint whose validation accuracy is
    # within one binomial standard error of the run's best, worked out here from metrics.jsonl
    extra = {"train.learning_rate": 3e-2, "train.max_steps": 8, "train.epochs": 4, "train.eval_every_steps": 2}
    extra |= {"checkpoint.every_steps": 2, "checkpoint.keep_last": 1, "checkpoint.export": "best"}
    cfg = _cfg(tmp_path, extra | {"checkpoint.best_within_se": 1.0})
    assert train_mod.main(["--config", str(cfg)]) == 0
    run = tmp_path / "run"
    evals = {
        r["step"]: r["eval_accuracy"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "eval_accuracy" in r
    }
    assert sorted(evals) == [2, 4, 6, 8]
    rows = SMALL["data.max_eval_samples"]
    top = max(evals.values())
    near = [s for s, a in evals.items() if a >= top - math.sqrt(top * (1 - top) / rows)]
    final = json.loads((run / "eval.json").read_text())
    assert final["exported"] == "best" and final["step"] == max(near)
    assert final["accuracy"] == evals[max(near)]
    strict = min(s for s, a in evals.items() if a == top)
    assert max(near) != strict, f"the scenario needs a later checkpoint near the best: {evals}"


def test_launch_config_dynamo_is_refused_unless_the_config_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from accelerate.utils import DynamoBackend

    monkeypatch.setenv(runtime.DYNAMO_ENV, "inductor")
    assert train_mod.main(["--config", str(_cfg(tmp_path))]) == 2
    assert "model.compile is false" in _one_line_error(capfd)
    assert not (tmp_path / "run").exists()
    # with model.compile=true the model is compiled once, by finetune: Accelerate is told "no"
    cfg = load_config(_cfg(tmp_path), ["model.compile=true", "model.compile_backend=aot_eager"])
    accelerator = runtime.build_accelerator(cfg)
    assert accelerator.state.dynamo_plugin.backend == DynamoBackend.NO


@pytest.mark.slow
def test_resume_settles_an_interrupted_replacement_before_choosing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path, {"train.max_steps": 4, "train.epochs": 2, "checkpoint.every_steps": 2})
    assert train_mod.main(["--config", str(cfg)]) == 0
    root = tmp_path / "run" / "checkpoints"
    newest = ckpt.checkpoint_dir(tmp_path / "run", 4)
    # a crash between `step_4 -> .trash-step_4` and `.tmp-step_4 -> step_4` while replacing step 4
    newest.rename(root / f"{ckpt.TRASH_PREFIX}{newest.name}")
    (root / f"{ckpt.TMP_PREFIX}{newest.name}").mkdir()
    capfd.readouterr()
    assert train_mod.main(["--config", str(cfg), "checkpoint.resume=auto"]) == 0
    assert f"resumed from {newest} at step 4" in capfd.readouterr().err


def test_options_that_need_validation_data_are_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg(tmp_path, {"data.validation_file": None, "train.eval_every_steps": 2})
    assert train_mod.main(["--config", str(cfg)]) == 2
    assert "train.eval_every_steps need validation data" in _one_line_error(capfd)
    assert not (tmp_path / "run").exists()


def test_evaluation_loaders_use_data_num_workers(tmp_path: Path) -> None:
    from finetune.data.build import build_data
    from finetune.model.load import build_tokenizer

    cfg = load_config(_cfg(tmp_path), ["data.num_workers=1", "data.max_eval_samples=8"])
    tok = build_tokenizer(cfg)
    validation, test = build_eval_loaders(cfg, build_data(cfg, tok), tok, 4)
    assert validation.num_workers == 1 and test is None


def test_final_predicts_with_the_training_max_length(tiny_run: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.deploy.predict import predict_texts

    train_len = load_config(tiny_run / "config.yaml").data.max_length
    tok = AutoTokenizer.from_pretrained(tiny_run / "final")
    model = AutoModelForSequenceClassification.from_pretrained(tiny_run / "final").eval()
    assert tok.model_max_length == train_len and tok.truncation_side == "right"
    text = " ".join(["a remarkably tedious and overlong film"] * 30)  # ~180 tokens
    (row,) = predict_texts(tok, model, [text])  # final/ alone: no max_length passed
    with torch.no_grad():
        cut = tok(text, truncation=True, max_length=train_len, return_tensors="pt")
        expected = model(**cut).logits.softmax(-1)[0].tolist()
        longer = model(**tok(text, truncation=True, max_length=128, return_tensors="pt")).logits.softmax(-1)[0]
    assert list(row["probabilities"].values()) == pytest.approx(expected, abs=1e-6)
    assert longer.tolist() != pytest.approx(expected, abs=1e-6)  # the cut point matters for this text


@pytest.mark.slow
def test_out_of_memory_inside_the_optimizer_step_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(faults.ENV, "oom_in_step:2")
    assert train_mod.main(["--config", str(_cfg(tmp_path, {"checkpoint.every_steps": 1}))]) == 2
    line = _one_line_error(capfd)
    assert "out of memory inside optimizer step 2" in line and "half updated" in line
    assert f"{ckpt.checkpoint_dir(tmp_path / 'run', 1)} is intact" in line


@pytest.mark.slow
def test_out_of_memory_in_evaluation_halves_the_rows_per_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    plain = _cfg(tmp_path / "plain", {"train.max_steps": 2})
    assert train_mod.main(["--config", str(plain)]) == 0
    monkeypatch.setenv(faults.ENV, "oom_in_eval:2")  # the final evaluation, after step 2
    hit = _cfg(tmp_path / "hit", {"train.max_steps": 2})
    assert train_mod.main(["--config", str(hit)]) == 0
    assert "out of memory in evaluation at 32 rows per forward: retrying with 16" in capfd.readouterr().err
    a, b = (json.loads((d / "run" / "eval.json").read_text()) for d in (tmp_path / "plain", tmp_path / "hit"))
    assert a["confusion_matrix"] == b["confusion_matrix"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6)


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_resumable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path, {"checkpoint.every_steps": 1, "train.max_steps": 3})
    monkeypatch.setenv(faults.ENV, "disk_full_in_save:2")
    assert train_mod.main(["--config", str(cfg)]) == 2
    line = _one_line_error(capfd)
    run = tmp_path / "run"
    assert "the disk is full" in line and "MiB are free" in line and "checkpoint.resume=auto" in line
    assert f"the previous checkpoint {ckpt.checkpoint_dir(run, 1)} is intact" in line
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001"]  # no temporary left
    monkeypatch.delenv(faults.ENV)
    assert train_mod.main(["--config", str(cfg), "checkpoint.resume=auto"]) == 0


def test_disk_full_errors_are_recognised_and_small_disks_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import errno

    from safetensors import SafetensorError

    assert ckpt.is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert ckpt.is_disk_full(SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"))
    assert not ckpt.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert ckpt.estimate_disk_need(100, 10, keep_last=2, checkpoints=True) == 410
    assert ckpt.estimate_disk_need(100, 10, keep_last=2, checkpoints=False) == 10
    with caplog.at_level("WARNING", logger="finetune"):
        ckpt.warn_if_disk_small(tmp_path, 1 << 62)
    assert "may write about" in caplog.text


def test_num_threads_auto_divides_the_cores_among_local_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert runtime.apply_num_threads("auto") == max(1, cores // 2) == torch.get_num_threads()
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        assert runtime.apply_num_threads("auto") == cores == torch.get_num_threads()
        assert runtime.apply_num_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "bf16-true"])
def test_the_loss_handed_to_backward_is_fp32(mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator

    seen: list[tuple[torch.dtype, torch.dtype]] = []
    real_backward, real_build = Accelerator.backward, train_mod.build_policy_model
    head_dtypes: list[torch.dtype] = []  # the classifier's own output (Accelerate upcasts the model's logits)

    def build(*args: Any) -> Any:
        model, *rest = real_build(*args)
        model.classifier.register_forward_hook(lambda m, i, out: head_dtypes.append(out.dtype))
        return (model, *rest)

    def backward(self: Any, loss: torch.Tensor, **kwargs: Any) -> None:
        seen.append((loss.dtype, head_dtypes[-1]))
        return real_backward(self, loss, **kwargs)

    monkeypatch.setattr(Accelerator, "backward", backward)
    monkeypatch.setattr(train_mod, "build_policy_model", build)
    cfg = _cfg(tmp_path, {"precision.mode": mode, "train.max_steps": 1, "data.max_eval_samples": 8})
    assert train_mod.main(["--config", str(cfg)]) == 0
    assert seen and all(loss == torch.float32 for loss, _ in seen), seen
    assert all(logits == torch.bfloat16 for _, logits in seen), seen  # the forward really ran in bf16


@pytest.mark.slow
def test_exact_resume_with_dropout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # tiny-debug has dropout 0: a broken RNG restore would pass every other resume test
    dropout = {
        "model.architecture.hidden_dropout_prob": 0.2,
        "model.architecture.attention_probs_dropout_prob": 0.2,
        "train.max_steps": 6,
        "train.epochs": 3,
        "checkpoint.every_steps": 2,
        "data.max_eval_samples": 8,
    }
    reference = _cfg(tmp_path / "reference", dropout)
    assert train_mod.main(["--config", str(reference)]) == 0
    stopped = _cfg(tmp_path / "stopped", dropout)
    monkeypatch.setenv(faults.ENV, "sigterm_at_batch:7")  # inside the window of step 4 (epoch 1)
    assert train_mod.main(["--config", str(stopped)]) == 143
    monkeypatch.delenv(faults.ENV)
    assert train_mod.main(["--config", str(stopped), "checkpoint.resume=auto"]) == 0
    a = _weights(tmp_path / "reference" / "run" / "final" / "model.safetensors")
    b = _weights(tmp_path / "stopped" / "run" / "final" / "model.safetensors")
    assert _max_diff(a, b) == 0.0
    # and dropout really acts: the same run without it ends elsewhere
    no_dropout = _cfg(
        tmp_path / "no_dropout",
        {
            **dropout,
            "model.architecture.hidden_dropout_prob": 0.0,
            "model.architecture.attention_probs_dropout_prob": 0.0,
        },
    )
    assert train_mod.main(["--config", str(no_dropout)]) == 0
    c = _weights(tmp_path / "no_dropout" / "run" / "final" / "model.safetensors")
    assert _max_diff(a, c) > 1e-4
