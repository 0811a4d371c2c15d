"""Imbalanced classes and texts longer than the model's window: class weights, focal loss,
head/tail/head_tail truncation and overlapping chunks, exact under accumulation.

Exactness: plain SGD through the real loop against a plain-torch reference that weights each
sample's loss and divides by the window's summed weights (texts split into windows weigh
1/windows each). Truncation and aggregation against direct computations.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import PLAIN_SGD, sgd_from_saved_start, write_tiny_config
from safetensors.torch import load_file

from finetune.cli import main as cli_main
from finetune.config.files import load_config
from finetune.data.build import Windowing, encode_texts, sample_weights
from finetune.data.window import WindowedBatchSampler
from finetune.evaluation.metrics import per_text
from finetune.model.load import build_tokenizer
from finetune.model.precision import fp32_per_sample_loss
from finetune.train import main

pytestmark = pytest.mark.usefixtures("one_thread", "data_dir")  # conftest.py

SGD = {**PLAIN_SGD, "data.max_eval_samples": 16}


def _one_line_error(capfd: pytest.CaptureFixture[str]) -> str:
    err = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {"train.class_weights": [1.0, 3.0]},
        {"data.max_length": 12, "data.chunk_stride": 3, "data.max_train_samples": 16, "train.class_weights": "auto"},
    ],
    ids=["class_weights", "chunks_and_auto_weights"],
)
def test_weighted_accumulation_equals_the_weighted_full_batch_gradient(extra: dict[str, Any], tmp_path: Path) -> None:
    scratch, tok, data, model, cfg = sgd_from_saved_start(tmp_path, {**SGD, **extra}, seed=3)
    init = tmp_path / "init"
    assert main(["--config", str(cfg)]) == 0
    train = data.train
    docs, labels = train["doc"][:], train["labels"][:]
    # the weights, computed here from their definition: class weight x 1 / (windows of the text)
    windows = {d: docs.count(d) for d in set(docs)}
    if extra["train.class_weights"] == "auto":
        per_text_label = {d: y for d, y in zip(docs, labels, strict=True)}
        counts = [list(per_text_label.values()).count(c) for c in range(2)]
        inverse = [1 / c for c in counts]
        class_w = [x / (sum(inverse) / 2) for x in inverse]
        assert max(windows.values()) > 1, "the slice must hold texts longer than one window"
    else:
        class_w = extra["train.class_weights"]
    weights = [class_w[y] / windows[d] for d, y in zip(docs, labels, strict=True)]
    assert sample_weights(train, data.label_names, extra["train.class_weights"]) == pytest.approx(weights)
    sampler = WindowedBatchSampler(
        train["length"][:],
        batch_size=8,
        accumulation=2,
        seed=scratch.run.seed,
        group_by_length=scratch.data.group_by_length,
    )
    sampler.set_epoch(0)
    batches = list(sampler)
    model.train()
    for w in range(0, len(batches), 2):
        idx = [i for b in batches[w : w + 2] for (i, _, _) in b]
        rows = [train[i] for i in idx]
        enc = tok.pad(
            [{k: r[k] for k in ("input_ids", "attention_mask", "token_type_ids")} for r in rows], return_tensors="pt"
        )
        ce = torch.nn.functional.cross_entropy(
            model(**enc).logits, torch.tensor([r["labels"] for r in rows]), reduction="none"
        )
        wt = torch.tensor([weights[i] for i in idx])
        loss = (ce * wt).sum() / wt.sum()
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad
    final = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    start = load_file(str(init / "model.safetensors"))
    ref = model.state_dict()
    diff = max(float((final[k] - ref[k]).abs().max()) for k in final)
    moved = max(float((final[k] - start[k]).abs().max()) for k in final)
    assert diff <= 1e-4 * moved and moved > 1e-3, (diff, moved)


def test_focal_loss_against_its_formula() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 3, dtype=torch.bfloat16), torch.tensor([0, 1, 2, 0, 1, 2])
    p_true = torch.softmax(logits.float(), -1)[torch.arange(6), labels]
    expected = -((1 - p_true) ** 2) * torch.log(p_true)
    got = fp32_per_sample_loss(logits, labels, "single_label_classification", focal_gamma=2.0)
    assert got.dtype == torch.float32 and torch.allclose(got, expected, atol=1e-6)
    plain = fp32_per_sample_loss(logits, labels, "single_label_classification")
    assert torch.allclose(fp32_per_sample_loss(logits, labels, "single_label_classification", 0.0), plain)
    hot = torch.tensor([[1.0, 0.0, 1.0]] * 6)
    p = torch.sigmoid(logits.float())
    pt = torch.where(hot == 1, p, 1 - p)
    multi = fp32_per_sample_loss(logits, hot, "multi_label_classification", focal_gamma=1.5)
    assert torch.allclose(multi, (-((1 - pt) ** 1.5) * torch.log(pt)).mean(-1), atol=1e-6)


def test_truncation_modes_keep_the_right_tokens(tmp_path: Path) -> None:
    tok = build_tokenizer(load_config(write_tiny_config(tmp_path)))
    text = " ".join(f"w{i}" for i in range(40))
    inner = tok(text, add_special_tokens=False)["input_ids"]
    assert len(inner) > 20
    budget = 20 - 2  # [CLS] ... [SEP]
    head = encode_texts(tok, [text], None, Windowing(20))["input_ids"][0]
    tail = encode_texts(tok, [text], None, Windowing(20, "tail"))["input_ids"][0]
    both = encode_texts(tok, [text], None, Windowing(20, "head_tail", head_fraction=0.25))["input_ids"][0]
    cls, sep = tok.cls_token_id, tok.sep_token_id
    assert head == [cls, *inner[:budget], sep]
    assert tail == [cls, *inner[-budget:], sep]
    k = round(budget * 0.25)
    assert both == [cls, *inner[:k], *inner[-(budget - k) :], sep]
    chunks = encode_texts(tok, [text, "short one"], None, Windowing(20, chunk_stride=5))
    assert chunks["doc"][-1] == 1 and chunks["doc"].count(0) == math.ceil((len(inner) - 5) / (budget - 5))
    first, second = chunks["input_ids"][0], chunks["input_ids"][1]
    assert first[-6:-1] == second[1:6]  # consecutive windows overlap by the stride
    assert chunks["truncated"] == [True] * chunks["doc"].count(0) + [False]


def test_per_text_aggregation_of_windows() -> None:
    logits = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 5.0], [2.0, 2.0]])
    docs, labels = torch.tensor([7, 7, 3, 7]), torch.tensor([1, 1, 0, 1])
    mean, ys, _ = per_text(logits, labels, docs, "mean")
    assert mean.tolist() == [[0.0, 5.0], pytest.approx([2.0, 4 / 3])] and ys.tolist() == [0, 1]
    assert per_text(logits, labels, docs, "max")[0].tolist() == [[0.0, 5.0], [3.0, 2.0]]


@pytest.mark.slow
def test_chunked_run_scores_texts_and_predicts_as_it_evaluates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_tiny_config(
        tmp_path,
        {
            "data.max_length": 12,
            "data.chunk_stride": 4,
            "data.max_train_samples": 48,
            "data.max_eval_samples": 20,
            "train.max_steps": 2,
            "data.chunk_aggregate": "max",
        },
    )
    assert main(["--config", str(cfg)]) == 0
    run = tmp_path / "run"
    report = json.loads((run / "eval.json").read_text())
    assert report["num_samples"] == 20  # texts, not windows
    final_cfg = json.loads((run / "final" / "config.json").read_text())
    assert (final_cfg["chunk_stride"], final_cfg["chunk_aggregate"]) == (4, "max")
    # finetune evaluate on final/ alone windows and aggregates as training's evaluation did
    assert cli_main(["evaluate", "--model", str(run / "final"), "--config", str(cfg)]) == 0
    result = json.loads(capsys.readouterr().out)["validation"]
    assert result["num_samples"] == 20 and result["confusion_matrix"] == report["confusion_matrix"]


@pytest.mark.parametrize(
    "updates, message",
    [
        ({"train.class_weights": [1.0, 2.0, 3.0]}, "3 weights for 2 labels"),
        ({"data.chunk_stride": 10, "data.max_length": 11}, "must be smaller than data.max_length minus"),
        ({"data.chunk_stride": 2, "data.truncation": "tail"}, "exclude each other"),
        ({"train.class_weights": "auto", "model.problem_type": "regression", "data.label_map": None}, "class_weights"),
        ({"train.loss": "focal", "model.problem_type": "regression", "data.label_map": None}, "focal"),
    ],
    ids=["weights_length", "stride_too_large", "truncation_and_chunks", "weights_regression", "focal_regression"],
)
def test_bad_values_are_one_line(
    updates: dict[str, Any], message: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(write_tiny_config(tmp_path, updates))]) == 2
    assert message in _one_line_error(capfd)
    assert not (tmp_path / "run").exists()
