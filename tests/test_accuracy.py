"""Accuracy recipes and trustworthy numbers: layer-wise learning rates, a head learning rate,
re-initialised top layers, bootstrap intervals, predictions.jsonl and `finetune report --errors`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_tiny_config
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score
from transformers import AutoConfig, AutoModelForSequenceClassification

from finetune.cli import main as cli_main
from finetune.config.files import load_config
from finetune.config.tasks import PROBLEM_TYPES
from finetune.core.errors import UserError
from finetune.evaluation.metrics import bootstrap_ci, compute_metrics, headline_metrics
from finetune.model.load import reinit_top_layers
from finetune.training.optim import build_optimizer, parameter_groups

pytestmark = pytest.mark.usefixtures("one_thread")

_ENC = {
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "vocab_size": 100,
}
# model_type -> (architecture, {where: regex on the parameter name}); a numbered group is a layer
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "bert": (
        _ENC,
        {
            "head": r"^classifier\.",
            "top": r"^bert\.pooler\.",
            "layer": r"^bert\.encoder\.layer\.(\d+)\.",
            "embeddings": r"^bert\.embeddings\.",
        },
    ),
    "distilbert": (
        {"dim": 32, "n_layers": 3, "n_heads": 2, "hidden_dim": 64, "max_position_embeddings": 64, "vocab_size": 100},
        {
            "head": r"^(pre_)?classifier\.",
            "layer": r"^distilbert\.transformer\.layer\.(\d+)\.",
            "embeddings": r"^distilbert\.embeddings\.",
        },
    ),
    "llama": (
        {**_ENC, "num_key_value_heads": 1, "head_dim": 16, "pad_token_id": 0},
        {
            "head": r"^score\.",
            "layer": r"^model\.layers\.(\d+)\.",
            "embeddings": r"^model\.embed_tokens\.",
            "top": r"^model\.norm\.",
        },
    ),
    "modernbert": (
        {
            **_ENC,
            "local_attention": 16,
            "global_attn_every_n_layers": 2,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "cls_token_id": 1,
            "sep_token_id": 2,
        },
        {
            "head": r"^(head|classifier)\.",
            "layer": r"^model\.layers\.(\d+)\.",
            "embeddings": r"^model\.embeddings\.",
            "top": r"^model\.final_norm\.",
        },
    ),
}


def _expected_lr(name: str, layout: dict[str, str], lr: float, head_lr: float, decay: float, layers: int) -> float:
    for where, pattern in layout.items():
        found = re.search(pattern, name)
        if found is None:
            continue
        if where == "layer":
            return lr * decay ** (layers - int(found.group(1)))
        return {"head": head_lr, "top": lr, "embeddings": lr * decay ** (layers + 1)}[where]
    raise AssertionError(f"{name} matches no part of the layout")


@pytest.mark.parametrize(("family", "lora"), [*((f, False) for f in LAYOUTS), ("llama", True)])
def test_parameter_groups_give_each_layer_its_decayed_rate(family: str, lora: bool, tmp_path: Path) -> None:
    arch, layout = LAYOUTS[family]
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(family, num_labels=3, **arch))
    updates = {"train.layer_lr_decay": 0.5, "train.head_learning_rate": 7e-3, "train.learning_rate": 1e-3}
    if lora:
        from finetune.model.load import add_lora

        cfg = load_config(write_tiny_config(tmp_path, {**updates, "model.lora": {"r": 2}}))
        model = add_lora(model, cfg.model.lora)
    cfg = load_config(write_tiny_config(tmp_path, updates))
    groups = parameter_groups(cfg, model)
    lr_of = {id(p): (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert sum(len(g["params"]) for g in groups) == len(trainable) == len(lr_of)  # each once, none frozen
    hf = model.base_model.model if lora else model
    for name, param in hf.named_parameters():
        if not param.requires_grad:
            continue
        expected = _expected_lr(name, layout, 1e-3, 7e-3, 0.5, 3)
        lr, decay = lr_of[id(param)]
        assert lr == pytest.approx(expected), name
        assert decay == (cfg.train.weight_decay if param.ndim >= 2 else 0.0), name
    assert groups[0]["lr"] == pytest.approx(7e-3)  # the logged lr is the first group's: the highest


def test_groups_reach_the_optimizer_one_sgd_step(tmp_path: Path) -> None:
    """An SGD step moves each parameter by its own group's rate x its gradient (plain-torch reference)."""
    arch, _ = LAYOUTS["bert"]
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("bert", num_labels=2, **arch))
    sgd = {"train.optimizer": "sgd", "train.weight_decay": 0.0, "train.layer_lr_decay": 0.5, "train.learning_rate": 0.1}
    cfg = load_config(write_tiny_config(tmp_path, sgd))
    optimizer = build_optimizer(cfg, model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(input_ids=torch.tensor([[1, 5, 7, 2]]), labels=torch.tensor([1])).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    for name, rate in (
        ("bert.encoder.layer.2.output.dense.weight", 0.05),
        ("bert.encoder.layer.0.output.dense.weight", 0.0125),
        ("bert.embeddings.word_embeddings.weight", 0.00625),
        ("classifier.weight", 0.1),
    ):
        after = dict(model.named_parameters())[name].detach()
        torch.testing.assert_close(after, before[name] - rate * grads[name], rtol=0, atol=1e-7)


def test_no_recipe_keeps_two_groups_and_decay_without_layers_is_refused(tmp_path: Path) -> None:
    arch, _ = LAYOUTS["bert"]
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("bert", num_labels=2, **arch))
    groups = parameter_groups(load_config(write_tiny_config(tmp_path)), model)
    assert [g["weight_decay"] > 0 for g in groups] == [True, False] and len({g["lr"] for g in groups}) == 1

    class Flat(torch.nn.Module):  # no numbered layers
        def __init__(self) -> None:
            super().__init__()
            self.inner = AutoModelForSequenceClassification.from_config(
                AutoConfig.for_model("bert", num_labels=2, **{**arch, "num_hidden_layers": 0})
            )

    with pytest.raises(UserError, match="layer_lr_decay needs numbered layers"):
        parameter_groups(load_config(write_tiny_config(tmp_path, {"train.layer_lr_decay": 0.9})), Flat())


def test_reinit_top_layers_redraws_only_the_top(tmp_path: Path) -> None:
    arch, _ = LAYOUTS["bert"]
    saved = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("bert", num_labels=2, **arch))
    with torch.no_grad():  # values no initialiser draws: a weight left alone keeps them
        for name, p in saved.named_parameters():
            p.fill_(2.0 if "LayerNorm" in name else 0.5)
    saved.save_pretrained(tmp_path / "base")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base")  # flags its weights initialised
    reinit_top_layers(model, 2)
    layers = model.bert.encoder.layer
    assert torch.all(layers[0].output.dense.weight == 0.5) and torch.all(layers[0].output.LayerNorm.weight == 2.0)
    for layer in layers[1:]:
        w = layer.output.dense.weight
        assert abs(w.std().item() - model.config.initializer_range) < 0.3 * model.config.initializer_range
        assert torch.all(layer.output.LayerNorm.weight == 1.0) and torch.all(layer.output.dense.bias == 0.0)
    assert torch.all(model.bert.embeddings.word_embeddings.weight == 0.5)
    with pytest.raises(UserError, match="reinit_top_layers=4, but BertForSequenceClassification has 3"):
        reinit_top_layers(model, 4)


# ----------------------------------------------------------------------------------------------
# Bootstrap intervals against a plain numpy bootstrap.


def _problem(kind: str, rng: np.random.Generator, n: int = 300) -> tuple[np.ndarray, np.ndarray, int]:
    if kind == "regression":
        y = rng.normal(size=n)
        return y, (y + rng.normal(size=n))[:, None], 1
    if kind == "multi_label_classification":
        y = (rng.random((n, 4)) < 0.3).astype(np.float32)
        return y, rng.normal(size=(n, 4)) + 2 * y - 1, 4
    y = rng.integers(0, 3, n)
    logits = rng.normal(size=(n, 3))
    logits[np.arange(n), y] += 1.0
    return y, logits, 3


def _reference(kind: str, y: np.ndarray, logits: np.ndarray, thresholds: list[float] | None) -> dict[str, float]:
    """The headline metrics through scipy and scikit-learn directly."""
    if kind == "regression":
        return {
            "pearson": pearsonr(logits[:, 0], y)[0],
            "spearman": spearmanr(logits[:, 0], y)[0],
            "mse": float(np.mean((logits[:, 0] - y) ** 2)),
        }
    if kind == "multi_label_classification":
        pred = (1 / (1 + np.exp(-logits))) >= np.asarray(thresholds)
        return {
            "micro_f1": f1_score(y, pred, average="micro", zero_division=0),
            "macro_f1": f1_score(y, pred, average="macro", zero_division=0),
            "subset_accuracy": accuracy_score(y, pred),
        }
    pred = logits.argmax(-1)
    return {"accuracy": accuracy_score(y, pred), "macro_f1": f1_score(y, pred, average="macro", labels=[0, 1, 2])}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(PROBLEM_TYPES))
def test_bootstrap_interval_equals_a_plain_numpy_bootstrap(kind: str) -> None:
    y, logits, k = _problem(kind, np.random.default_rng(3))
    thresholds = [0.4, 0.5, 0.6, 0.5] if kind == "multi_label_classification" else None
    got = bootstrap_ci(kind, y, logits, k, thresholds, resamples=200, seed=11)
    rng, draws = np.random.default_rng(11), {m: [] for m in PROBLEM_TYPES[kind].headline}
    for _ in range(200):
        idx = rng.integers(0, len(y), len(y))
        for m, v in _reference(kind, y[idx], logits[idx], thresholds).items():
            draws[m].append(v)
    for m, values in draws.items():
        np.testing.assert_allclose(got[f"{m}_ci"], np.percentile(values, [2.5, 97.5]), rtol=0, atol=1e-9)
        point = compute_metrics(kind, y, logits, [str(i) for i in range(k)], thresholds)[m]
        assert got[f"{m}_ci"][0] <= point <= got[f"{m}_ci"][1]
    assert got["bootstrap"] == {"resamples": 200, "seed": 11, "level": 0.95, "method": "percentile"}
    assert bootstrap_ci(kind, y, logits, k, thresholds, resamples=0) == {}


@pytest.mark.parametrize("kind", list(PROBLEM_TYPES))
def test_headline_metrics_match_compute_metrics_with_absent_classes(kind: str) -> None:
    y, logits, k = _problem(kind, np.random.default_rng(5), n=40)
    if kind == "single_label_classification":
        y, logits = np.where(y == 2, 0, y), logits[:, :2].copy()  # class 2 neither present nor predicted
        logits = np.concatenate([logits, np.full((40, 1), -9.0)], axis=1)
    thresholds = [0.5] * k if kind == "multi_label_classification" else None
    full = compute_metrics(kind, y, logits, [str(i) for i in range(k)], thresholds)
    fast = headline_metrics(kind, y, logits, k, thresholds)
    assert fast == pytest.approx({m: full[m] for m in PROBLEM_TYPES[kind].headline}, abs=1e-12)


# ----------------------------------------------------------------------------------------------
# predictions.jsonl, eval.json's intervals, report --errors (the shared tiny run).


@pytest.mark.slow
def test_predictions_and_intervals_describe_final(
    tiny_run: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    final = json.loads((tiny_run / "eval.json").read_text())
    rows = [json.loads(line) for line in (tiny_run / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == final["num_samples"] and [r["id"] for r in rows] == list(range(len(rows)))
    assert {tuple(r) for r in rows} == {("split", "id", "text", "gold", "prediction", "probabilities", "loss")}
    for r in rows:
        probs = r["probabilities"]
        assert sum(probs.values()) == pytest.approx(1.0) and r["prediction"] == max(probs, key=probs.get)
        assert r["loss"] == pytest.approx(-np.log(probs[r["gold"]]), rel=1e-5)  # the row's own cross-entropy
    assert np.mean([r["gold"] == r["prediction"] for r in rows]) == pytest.approx(final["accuracy"])
    assert np.mean([r["loss"] for r in rows]) == pytest.approx(final["loss"], rel=1e-5)
    dev = [line.split("\t") for line in (data_dir / "sst2" / "dev.tsv").read_text().splitlines()[1:]]
    assert [(r["text"], r["gold"]) for r in rows[:5]] == [(t, ["negative", "positive"][int(y)]) for t, y in dev[:5]]
    for key in ("accuracy", "macro_f1"):
        low, high = final[f"{key}_ci"]
        assert 0 <= low <= final[key] <= high <= 1 and high - low > 0
    assert final["bootstrap"]["resamples"] == 1000

    assert cli_main(["report", str(tiny_run), "--errors", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    wrong = [r for r in rows if r["gold"] != r["prediction"]]
    wrong.sort(key=lambda r: -r["probabilities"][r["prediction"]])
    assert len(lines) == min(3, len(wrong))
    for line, r in zip(lines, wrong, strict=False):
        assert line.startswith(f"validation#{r['id']} p={r['probabilities'][r['prediction']]:.3f}")
        assert f"gold={r['gold']} predicted={r['prediction']}" in line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [(["--errors", "0"], "positive count"), (["--errors", "2", "--split", "test"], "no test predictions")],
)
def test_report_errors_bad_arguments(
    tiny_run: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["report", str(tiny_run), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_report_errors_without_predictions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["report", str(tmp_path), "--errors", "5"]) == 2
    assert "predictions.jsonl not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("updates", "message"),
    [
        ({"model.quantization": "4bit", "model.lora": {"r": 2}}, "model.quantization freezes them"),
        ({}, "model.architecture builds every layer fresh"),
    ],
)
def test_reinit_refused_where_it_cannot_work(tmp_path: Path, updates: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message):
        load_config(write_tiny_config(tmp_path, {"train.reinit_top_layers": 1, **updates}))
