"""A handful of rows a class: the mean-pooling layer (`model.pooling=mean`) against a plain-torch mean of the
token states, the linear-probe head (`model.head_init=probe`) against scikit-learn fitted on independently
computed features, a run with both that resumes exactly and whose final/ predicts in `transformers.pipeline` as
the training code's model does, and `finetune init`'s choice on few and many rows a class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_tiny_config
from safetensors.torch import load_file
from sklearn.linear_model import LogisticRegression
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, pipeline

from finetune.core import faults
from finetune.core.errors import UserError
from finetune.model.pooling import append_mean_layer
from finetune.model.precision import fp32_pair_losses
from finetune.model.probe import probe_head
from finetune.model.sources import resolve_model_path
from finetune.train import main
from finetune.training import runtime

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TEXTS = ["a fine film", "dull and far too long for what it is , and then some more", "bad", "the best of the year"]


def tiny_bert(num_labels: int = 2, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=num_labels,
    )
    return AutoModelForSequenceClassification.from_config(config).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_path("minilm-l6"))


def test_mean_layer_reads_the_masked_mean_of_the_token_states(tokenizer: Any) -> None:
    model = tiny_bert()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model.bert(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        mean = (states * mask).sum(1) / mask.sum(1)  # padding excluded, [CLS] and [SEP] included
        expected = torch.nn.functional.layer_norm(mean, (32,), eps=model.config.layer_norm_eps)
        append_mean_layer(model)
        got = model.bert(**batch).last_hidden_state[:, 0]
        alone = torch.cat([model.bert(**tokenizer([t], return_tensors="pt")).last_hidden_state[:, 0] for t in TEXTS])
    assert model.config.num_hidden_layers == 3 and model.config.finetune_mean_pooling
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=0)  # the residual weighs 1/MEAN_SCALE
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)  # padding takes no share of the mean
    assert not any(p.requires_grad for p in model.bert.encoder.layer[-1].parameters())


def test_mpnet_gets_the_layer_in_its_own_names_and_an_identity_head_dense() -> None:
    from transformers import MPNetConfig

    torch.manual_seed(0)
    config = MPNetConfig(
        vocab_size=30527, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    model = AutoModelForSequenceClassification.from_config(config).eval()
    ids = torch.tensor([[0, 100, 200, 300, 2, 1], [0, 150, 250, 2, 1, 1]])
    mask = (ids != 1).long()
    with torch.no_grad():
        states = model.mpnet(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        expected = torch.nn.functional.layer_norm((states * m).sum(1) / m.sum(1), (32,), eps=config.layer_norm_eps)
        append_mean_layer(model)
        got = model.mpnet(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
    # the relative position bias (random and small here) tilts the even weights: near the mean, not at it
    assert (got - expected).abs().max() < 0.25
    assert torch.equal(model.classifier.dense.weight, torch.eye(32)) and model.config.num_hidden_layers == 3


def test_mean_layer_refuses_an_unknown_family() -> None:
    model = AutoModelForSequenceClassification.from_config(
        __import__("transformers").DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    )
    with pytest.raises(UserError, match="model.pooling=mean: no mean-pooling layer for model_type 'distilbert'"):
        append_mean_layer(model)


@pytest.mark.parametrize("num_labels", [2, 3])
def test_probe_head_is_scikit_learns_logistic_regression(tokenizer: Any, num_labels: int) -> None:
    model = tiny_bert(num_labels)
    rng = np.random.default_rng(0)
    texts = [f"{w} {v}" for w in ("good", "bad", "odd", "fine", "long") for v in ("film", "book", "day", "meal")]
    labels = torch.tensor(rng.integers(0, num_labels, len(texts)))
    batches = []
    for i in range(0, len(texts), 8):
        b = dict(tokenizer(texts[i : i + 8], padding=True, return_tensors="pt"))
        batches.append(b | {"labels": labels[i : i + 8]})
    with torch.no_grad():  # the reference features: BERT's pooled output, computed without the head's hook
        feats = torch.cat([model.bert(**{k: v for k, v in b.items() if k != "labels"}).pooler_output for b in batches])
    reference = LogisticRegression(C=1.0, max_iter=2000).fit(feats.numpy(), labels.numpy())
    note = probe_head(model, batches)
    assert f"{len(texts)} training rows" in note
    with torch.no_grad():
        probs = torch.cat([model(**{k: v for k, v in b.items() if k != "labels"}).logits for b in batches]).softmax(-1)
    np.testing.assert_allclose(probs.numpy(), reference.predict_proba(feats.numpy()), atol=1e-4)


def test_pair_losses_are_the_pairwise_formula_in_float64() -> None:
    torch.manual_seed(0)
    features = torch.randn(7, 5, dtype=torch.bfloat16)
    labels = torch.tensor([0, 0, 1, 2, 1, 0, 2])
    got = fp32_pair_losses(features, labels)
    x = features.double()
    expected = []
    for i in range(7):
        cos = [float(torch.nn.functional.cosine_similarity(x[i], x[j], dim=0)) for j in range(7)]
        same = [(cos[j] - 1) ** 2 for j in range(7) if j != i and labels[j] == labels[i]]
        other = [cos[j] ** 2 for j in range(7) if labels[j] != labels[i]]
        expected.append((sum(same) / len(same) + sum(other) / len(other)) / 2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    alone = fp32_pair_losses(features[:3], torch.tensor([0, 1, 1]))  # row 0 has no same-label partner
    c = torch.nn.functional.cosine_similarity(x[0:1], x[1:3]).pow(2).mean()
    torch.testing.assert_close(alone[0].double(), c, atol=1e-5, rtol=1e-5)


FEW = {
    "model.name_or_path": "minilm-l6",
    "model.architecture": ...,
    "model.tokenizer": ...,
    "model.pooling": "mean",
    "model.head_init": "probe",
    "data.max_train_samples": 16,
    "data.max_length": 32,
    "train.micro_batch_size": 8,
    "train.gradient_accumulation_steps": 1,
    "train.learning_rate": 5e-5,
    "train.max_steps": 4,
    "train.epochs": 2,
    "train.contrastive_steps": 3,  # stopped inside the contrastive opening, resumed across its end
    "checkpoint.every_steps": 3,
    "model.dropout": 0.0,
}


@pytest.mark.slow
def test_fewshot_run_resumes_exactly_and_final_predicts_in_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for d in ("ref", "cut"):
        (tmp_path / d).mkdir()
    ref_cfg = write_tiny_config(tmp_path / "ref", FEW)
    assert main(["--config", str(ref_cfg)]) == 0
    cfg = write_tiny_config(tmp_path / "cut", FEW)
    monkeypatch.setenv(faults.ENV, "sigterm_at_step:2")
    assert main(["--config", str(cfg)]) == runtime.EXIT_CODES["SIGTERM"]
    monkeypatch.delenv(faults.ENV)
    assert main(["--config", str(cfg), "checkpoint.resume=auto"]) == 0
    final = tmp_path / "ref" / "run" / "final"
    ref, got = (load_file(str(d / "run" / "final" / "model.safetensors")) for d in (tmp_path / "ref", tmp_path / "cut"))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert "bert.encoder.layer.6.attention.self.query.weight" in ref  # MiniLM's 6 layers and the mean layer
    log = (tmp_path / "ref" / "run" / "train.log").read_text()
    assert "head init: a logistic regression" in log and "model.pooling=mean" in log
    assert "step 3: contrastive steps done; head init: a logistic regression" in log
    # final/ in a pipeline: the same probabilities as the stock class loaded by hand, text by text
    clf = pipeline("text-classification", model=str(final), top_k=None)
    model = AutoModelForSequenceClassification.from_pretrained(str(final)).eval()
    tok = AutoTokenizer.from_pretrained(str(final))
    assert model.config.num_hidden_layers == 7
    for text, out in zip(TEXTS, clf(TEXTS, batch_size=4), strict=True):
        with torch.no_grad():
            p = model(**tok(text, return_tensors="pt")).logits.softmax(-1)[0]
        by_label = {o["label"]: o["score"] for o in out}
        expected = {model.config.id2label[i]: float(p[i]) for i in range(2)}
        assert by_label.keys() == expected.keys()
        assert all(abs(by_label[k] - expected[k]) < 1e-5 for k in expected)
    assert json.loads((final / "config.json").read_text())["finetune_mean_pooling"] is True
    card = (final / "README.md").read_text()
    assert "- mean pooling:" in card and "the first 3 optimizer steps were contrastive" in card


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        ({"train": {"contrastive_steps": 4}, "data": {"packing": True}}, "not with data.packing"),
        ({"train": {"contrastive_steps": 4}, "model": {"problem_type": "regression"}}, "single-label data"),
        ({"model": {"head_init": "probe", "problem_type": "multi_label_classification"}}, "single-label logistic"),
    ],
)
def test_few_shot_keys_refuse_what_they_cannot_do(keys: dict[str, Any], said: str) -> None:
    from finetune.config.files import validate_config

    raw: dict[str, Any] = {
        "run": {"output_dir": "x"},
        "model": {"name_or_path": "minilm-l6"},
        "data": {"train_file": "t"},
    }
    for section, values in keys.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(UserError, match=said):
        validate_config(raw)
