"""Defaults that give a good model: the head's starting point (`model.head_init`) against plain computations
from the raw files, and the multi-label decision rule on constructed scores."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import write_tiny_config
from test_tasks import GOEMOTIONS, STSB

from finetune.assemble import train_targets
from finetune.config.files import load_config
from finetune.data.build import build_data
from finetune.model.load import build_model, build_tokenizer, output_layer

pytestmark = pytest.mark.usefixtures("one_thread", "data_dir")  # conftest.py


def _build(tmp_path: Path, updates: dict[str, Any], seed: int = 3) -> tuple[Any, torch.nn.Linear]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_config(write_tiny_config(tmp_path, updates))
    tok = build_tokenizer(cfg)
    data = build_data(cfg, tok)
    torch.manual_seed(seed)
    model = build_model(cfg, data.label_names, tok, targets=train_targets(data))
    layer = output_layer(model)
    assert layer is not None
    return model, layer


def test_multi_label_bias_starts_at_each_labels_log_odds(tmp_path: Path, data_dir: Path) -> None:
    _, layer = _build(tmp_path, GOEMOTIONS)
    # independent reference: the raw file, read with csv (ids joined by commas in column 2)
    with open(data_dir / "goemotions" / "dev.tsv", newline="", encoding="utf-8") as f:
        rows = [r[1].split(",") for r in csv.reader(f, delimiter="\t")][:256]  # the tiny config's max_train_samples
    for j in range(28):
        rate = min(max(sum(str(j) in ids for ids in rows) / len(rows), 1e-4), 1 - 1e-4)  # unseen: a finite logit
        assert layer.bias[j].item() == pytest.approx(math.log(rate / (1 - rate)), abs=1e-5)
    # a sigmoid at the bias alone is the label's base rate, far from 0.5 for every label
    assert torch.sigmoid(layer.bias).max().item() < 0.4


@pytest.mark.slow
def test_regression_head_starts_at_the_target_mean_and_spread(tmp_path: Path, data_dir: Path) -> None:
    with open(data_dir / "stsb" / "dev.tsv", encoding="utf-8") as f:
        lines = list(f)[1:257]  # a header, then the tiny config's 256 training rows
    scores = torch.tensor([float(line.rstrip("\n").split("\t")[-1]) for line in lines], dtype=torch.float64)
    _, random_layer = _build(tmp_path / "a", {**STSB, "model.head_init": "random"})
    model, layer = _build(tmp_path / "b", STSB)  # same seed: the same random weights before the init
    assert layer.bias.item() == pytest.approx(scores.mean().item(), abs=1e-5)
    torch.testing.assert_close(layer.weight, random_layer.weight * scores.std().item())
    # the untrained model predicts near the mean: the first steps fit the text, not the offset
    assert abs(layer.bias.item() - random_layer.bias.item()) > 2.0


@pytest.mark.slow
def test_a_classifier_checkpoint_keeps_its_head(tmp_path: Path) -> None:
    # continued fine-tuning from a saved classifier: its trained head is not reset to the prior
    model, layer = _build(tmp_path / "a", {**STSB, "model.head_init": "random"})
    model.save_pretrained(tmp_path / "ckpt")
    saved = {**STSB, "model.name_or_path": str(tmp_path / "ckpt"), "model.architecture": None}
    _, again = _build(tmp_path / "b", saved)
    torch.testing.assert_close(again.bias, layer.bias)
    torch.testing.assert_close(again.weight, layer.weight)
