"""`finetune distill`: the distillation loss against a float64 formula written out here, a tiny student distilled from
a tiny teacher's final/ with unlabeled texts (stopped by SIGTERM and resumed to the uninterrupted run's weights, its
teacher cache read, not computed, on resume; only a missing chunk computed again), final/ loading in transformers'
pipeline, and a teacher of other labels, a missing unlabeled file or a missing teacher refused in one line before
anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_tiny_config
from safetensors.torch import load_file

from finetune.cli import main as cli_main
from finetune.config.files import load_config
from finetune.core import faults
from finetune.core.errors import UserError
from finetune.core.fileio import TEACHER_DIR
from finetune.data.build import build_data
from finetune.data.collate import Collator
from finetune.data.window import WindowedDataset
from finetune.deploy.teacher import MANIFEST, teacher_logits
from finetune.model.load import build_tokenizer
from finetune.model.precision import fp32_distill_loss

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ----------------------------------------------------------------------------------------------
# The loss.


def _reference(
    s: torch.Tensor,
    y: torch.Tensor,
    t: torch.Tensor,
    gold: torch.Tensor,
    kind: str,
    T: float,
    alpha: float,
    soft_loss: str = "kl",
) -> torch.Tensor:
    """The distillation loss per sample in float64, each term written out."""
    s, t = s.double(), t.double()
    if kind == "regression":
        return alpha * gold * (s[:, 0] - y) ** 2 + (1 - alpha) * (s[:, 0] - t[:, 0]) ** 2
    if kind == "multi_label_classification":
        p = 1 / (1 + torch.exp(-s))
        hard = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean(-1)
        q, ps = 1 / (1 + torch.exp(-t / T)), 1 / (1 + torch.exp(-s / T))
        soft = -(q * torch.log(ps) + (1 - q) * torch.log(1 - ps)).mean(-1)
    else:
        log_p = s - torch.logsumexp(s, -1, keepdim=True)
        hard = -log_p[torch.arange(len(y)), y]
        log_q, log_ps = (
            t / T - torch.logsumexp(t / T, -1, keepdim=True),
            s / T - torch.logsumexp(s / T, -1, keepdim=True),
        )
        soft = (torch.exp(log_q) * (log_q - log_ps)).sum(-1)
    if soft_loss == "kl":
        return alpha * gold * hard + (1 - alpha) * T**2 * soft
    diff = s - t
    if kind == "single_label_classification":  # a softmax ignores a shift common to all classes
        diff = diff - diff.mean(-1, keepdim=True)
    return alpha * gold * hard + (1 - alpha) * (diff**2).mean(-1)


@pytest.mark.parametrize("kind", ["single_label_classification", "multi_label_classification", "regression"])
def test_distill_loss_matches_the_formula_in_float64(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 6, 1 if kind == "regression" else 4
    student, teacher = torch.randn(n, k, generator=g) * 3, torch.randn(n, k, generator=g) * 3
    if kind == "single_label_classification":
        labels = torch.randint(0, k, (n,), generator=g)
    elif kind == "multi_label_classification":
        labels = (torch.rand(n, k, generator=g) > 0.5).float()
    else:
        labels = torch.randn(n, generator=g)
    gold = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])  # unlabeled rows: the teacher's term alone
    for T, alpha, soft_loss in (
        (2.0, 0.5, "kl"),
        (1.0, 0.0, "kl"),
        (4.0, 1.0, "kl"),
        (3.0, 0.3, "kl"),
        (2.0, 0.0, "mse"),
        (1.0, 0.5, "mse"),
    ):
        got = fp32_distill_loss(student.bfloat16(), labels, teacher, gold, kind, T, alpha, soft_loss)
        assert got.dtype == torch.float32 and got.shape == (n,)
        want = _reference(student.bfloat16().float(), labels, teacher, gold, kind, T, alpha, soft_loss)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # a student that is its teacher has no soft loss: alpha 0 leaves 0 (single-label KL) or the teacher's entropy
    same = fp32_distill_loss(teacher, labels, teacher, gold, kind, 2.0, 0.0, "kl")
    if kind != "multi_label_classification":
        torch.testing.assert_close(same, torch.zeros(n), atol=1e-5, rtol=0)
    # logit matching: a student whose logits are the teacher's (shifted by a constant, for a softmax) has none
    shift = 5.0 if kind == "single_label_classification" else 0.0
    matched = fp32_distill_loss(teacher + shift, labels, teacher, gold, kind, 2.0, 0.0, "mse")
    torch.testing.assert_close(matched, torch.zeros(n), atol=1e-5, rtol=0)


def test_distill_refuses_focal_and_label_smoothing(tmp_path: Path) -> None:
    cfg = write_tiny_config(tmp_path, {"distill.teacher": str(tmp_path / "t")})
    for override in ("train.loss=focal", "train.label_smoothing=0.1"):
        with pytest.raises(UserError, match="distill.teacher trains on the teacher's outputs"):
            load_config(cfg, [override])
    assert load_config(cfg, []).distill.temperature == 2.0


# ----------------------------------------------------------------------------------------------
# The training rows.

TASKS = {
    "multi_label_classification": (
        {
            "data.train_file": "goemotions/dev.tsv",
            "data.validation_file": "goemotions/test.tsv",
            "data.header": False,
            "data.quoting": "minimal",
            "data.column_names": ["text", "labels", "id"],
            "data.text_column": "text",
            "data.label_column": "labels",
            "data.label_delimiter": ",",
            "data.labels_file": "goemotions/emotions.txt",
        },
        "goemotions/test.tsv",
        0,
    ),
    "regression": (
        {
            "data.train_file": "stsb/dev.tsv",
            "data.validation_file": "stsb/dev.tsv",
            "data.text_column": "sentence1",
            "data.text_pair_column": "sentence2",
            "data.label_column": "score",
        },
        "stsb/dev.tsv",
        1,
    ),
}


@pytest.mark.parametrize("kind", list(TASKS))
def test_training_rows_carry_the_teacher_outputs(kind: str, tmp_path: Path, data_dir: Path) -> None:
    updates, source, header = TASKS[kind]
    lines = (data_dir / source).read_text().splitlines()
    (tmp_path / "unlabeled.tsv").write_text("\n".join(lines[:header] + lines[-8:]) + "\n")
    cfg = load_config(
        write_tiny_config(
            tmp_path,
            {
                **updates,
                "model.problem_type": kind,
                "data.label_map": None,
                "data.max_train_samples": 16,
                "distill.teacher": str(tmp_path / "teacher"),
                "distill.unlabeled_file": str(tmp_path / "unlabeled.tsv"),
            },
        )
    )
    seen: dict[str, object] = {}

    def teacher(texts: list[str], pairs: list[str] | None, names: list[str], problem_type: str) -> np.ndarray:
        seen.update(texts=texts, pairs=pairs, kind=problem_type)
        return np.arange(len(texts) * len(names), dtype=np.float32).reshape(len(texts), len(names))

    data = build_data(cfg, build_tokenizer(cfg), teacher)
    k = len(data.label_names)
    assert seen["kind"] == kind and len(seen["texts"]) == 16 + 8  # type: ignore[arg-type]
    assert (seen["pairs"] is not None) == (kind == "regression")
    train, placeholder = data.train, [0.0] * k if kind == "multi_label_classification" else 0.0
    assert data.report["splits"]["train"]["unlabeled_rows"] == 8 and "unlabeled" in data.sha256
    for doc, logits, gold, label in zip(
        train["doc"][:], train["teacher_logits"][:], train["gold"][:], train["labels"][:], strict=True
    ):
        assert logits == [float(doc * k + j) for j in range(k)] and gold == float(doc < 16)
        assert doc < 16 or label == placeholder
    batch = Collator(build_tokenizer(cfg))(WindowedDataset(train).__getitems__([(i, 4, 1.0) for i in (0, 15, 16, 23)]))
    assert batch["teacher_logits"].dtype == batch["gold"].dtype == batch["labels"].dtype == torch.float32
    assert batch["teacher_logits"].shape == (4, k) and batch["gold"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert "teacher_logits" not in data.validation.column_names  # evaluation reads the labels alone


# ----------------------------------------------------------------------------------------------
# Runs.


def _unlabeled(directory: Path, data_dir: Path, rows: int = 64) -> Path:
    """SST-2 training texts after the first 1,000, as a TSV with the text column only."""
    lines = (data_dir / "sst2" / "train.tsv").read_text().splitlines()[1001 : 1001 + rows]
    path = directory / "unlabeled.tsv"
    path.write_text("sentence\n" + "".join(line.split("\t")[0] + "\n" for line in lines))
    return path


def _tiny(directory: Path, name: str, **updates: object) -> Path:
    return write_tiny_config(
        directory,
        {
            "run.output_dir": str(directory / name),
            "data.max_train_samples": 64,
            "data.max_eval_samples": 32,
            "data.max_length": 32,
            "train.micro_batch_size": 16,
            "train.gradient_accumulation_steps": 2,
            "train.eval_every_steps": None,
            "checkpoint.every_steps": 2,
            **updates,
        },
        f"{name}.yaml",
    )


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """A tiny teacher's final/ (64 SST-2 rows, 2 epochs)."""
    directory = tmp_path_factory.mktemp("teacher")
    assert cli_main(["train", "--config", str(_tiny(directory, "teacher", **{"train.epochs": 2}))]) == 0
    return directory / "teacher" / "final"


@pytest.mark.slow
def test_distill_resumed_after_sigterm_equals_uninterrupted(
    teacher: Path, tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    unlabeled = _unlabeled(tmp_path, data_dir)
    updates = {
        "distill.unlabeled_file": str(unlabeled),
        "distill.temperature": 3.0,
        "distill.alpha": 0.4,
        "distill.loss": "kl",
    }
    whole, stopped = _tiny(tmp_path, "whole", **updates), _tiny(tmp_path, "stopped", **updates)
    calls: list[tuple[float, float, str]] = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(args[-3:])  # type: ignore[arg-type]
        return fp32_distill_loss(*args)  # type: ignore[arg-type]

    monkeypatch.setattr("finetune.train.fp32_distill_loss", counted)
    assert cli_main(["distill", "--teacher", str(teacher), "--config", str(whole)]) == 0
    assert calls == [(3.0, 0.4, "kl")] * 8  # every micro-batch of 4 windows of 2 learns from the teacher

    monkeypatch.setenv(faults.ENV, "sigterm_at_step:3")
    assert cli_main(["distill", "--teacher", str(teacher), "--config", str(stopped)]) == 143
    err = capfd.readouterr().err
    assert f"finetune distill --teacher {teacher} --config {stopped}" in err and "checkpoint.resume=auto" in err
    monkeypatch.delenv(faults.ENV)
    cache = tmp_path / "stopped" / TEACHER_DIR
    manifest = json.loads((cache / MANIFEST).read_text())
    assert manifest["rows"] == 64 + 64 and manifest["chunk_size"] == 1024  # labelled and unlabeled rows
    files = sorted(cache.iterdir())
    written = {p.name: p.stat().st_mtime_ns for p in files}
    assert [p.name for p in files] == ["chunk-00000.npy", MANIFEST]
    assert np.load(cache / "chunk-00000.npy", allow_pickle=False).shape == (128, 2)

    assert cli_main(["distill", "--teacher", str(teacher), "--config", str(stopped), "checkpoint.resume=auto"]) == 0
    assert "resumed from" in capfd.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in sorted(cache.iterdir())} == written  # read, not computed again
    a = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    b = load_file(tmp_path / "stopped" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    report = json.loads((tmp_path / "whole" / "data_report.json").read_text())
    assert report["splits"]["train"]["unlabeled_rows"] == 64
    card = (tmp_path / "whole" / "final" / "README.md").read_text()
    assert (
        f"distilled from the teacher `{teacher}` (KL at temperature 3, alpha 0.4" in card
        and "64 unlabeled rows" in card
    )
    from transformers import pipeline

    clf = pipeline("text-classification", model=str(tmp_path / "whole" / "final"), device="cpu")
    assert {p["label"] for p in clf(["a fine film", "a dull mess"])} <= {"negative", "positive"}


@pytest.mark.slow
def test_distill_refuses_a_teacher_of_other_labels(
    teacher: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _tiny(tmp_path, "student", **{"data.label_map": {"0": "neg", "1": "pos"}})
    assert cli_main(["distill", "--teacher", str(teacher), "--config", str(cfg)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: distill.teacher: ") and "['negative', 'positive']" in err[-1]
    assert "['neg', 'pos']" in err[-1] and len([e for e in err if e.startswith("error")]) == 1
    assert not (tmp_path / "student").exists()


def test_distill_refuses_a_missing_teacher_or_unlabeled_file(
    tmp_path: Path, data_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _tiny(tmp_path, "student")
    assert cli_main(["distill", "--teacher", str(tmp_path / "nowhere"), "--config", str(cfg)]) == 2
    assert "error: distill.teacher: " in capfd.readouterr().err
    missing = f"distill.unlabeled_file={tmp_path / 'none.tsv'}"
    assert cli_main(["distill", "--teacher", str(tmp_path), "--config", str(cfg), missing]) == 2
    assert f"error: distill.unlabeled_file: {tmp_path / 'none.tsv'} does not exist" in capfd.readouterr().err
    (tmp_path / "other.tsv").write_text("text\nsome words\n")
    other = f"distill.unlabeled_file={tmp_path / 'other.tsv'}"
    assert cli_main(["distill", "--teacher", str(tmp_path), "--config", str(cfg), other]) == 2
    assert "has no column 'sentence' (data.text_column)" in capfd.readouterr().err
    assert not (tmp_path / "student").exists()


@pytest.mark.slow
def test_teacher_cache_computes_only_missing_chunks(teacher: Path, tmp_path: Path) -> None:
    texts = ["a fine film", "a dull mess", "not bad", "sharp and funny", "too long"]
    cache = tmp_path / "cache"
    first = teacher_logits(teacher, texts, None, cache, chunk_size=2)
    assert first.shape == (5, 2) and first.dtype == np.float32
    chunks = sorted(cache.glob("chunk-*.npy"))
    assert [p.name for p in chunks] == ["chunk-00000.npy", "chunk-00001.npy", "chunk-00002.npy"]
    kept = chunks[0].stat().st_mtime_ns
    chunks[1].unlink()  # a run stopped before its second chunk was written
    again = teacher_logits(teacher, texts, None, cache, chunk_size=2)
    assert np.array_equal(again, first) and chunks[1].is_file() and chunks[0].stat().st_mtime_ns == kept
    other = teacher_logits(teacher, [*texts[:4], "something else"], None, cache, chunk_size=2)  # other texts
    assert np.array_equal(other[:4], first[:4]) and chunks[0].stat().st_mtime_ns != kept  # the cache started again
