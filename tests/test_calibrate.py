"""Temperature scaling (finetune/evaluation/calibrate.py): ECE and Brier against hand computations, the fitted
temperature against a brute-force search, the fold into the output layer against dividing the logits
(plain and LoRA), and a run whose final/ gives the calibrated probabilities eval.json reports."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from finetune.config.files import load_config
from finetune.deploy.final import load_final
from finetune.deploy.predict import predict_texts
from finetune.evaluation.calibrate import brier, calibrate, ece, fit_temperature, fold_temperature, nll
from finetune.model.load import build_model, build_tokenizer
from finetune.train import main
from finetune.training import checkpoint as ckpt


def test_ece_and_brier_by_hand() -> None:
    # confidences 0.9, 0.8, 0.6, 0.55 -> 15 bins of width 1/15: 0.9 in (13/15, 14/15], 0.8 in (11/15, 12/15],
    # 0.6 and 0.55 both in (8/15, 9/15]
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.45, 0.55]])
    labels = np.array([0, 0, 0, 0])  # right, wrong, right, wrong
    # bin 0.9: acc 1, conf 0.9 -> 0.1; bin 0.8: acc 0, conf 0.8 -> 0.8; bin {0.6, 0.55}: acc 0.5, conf 0.575 -> 0.075
    assert ece(probs, labels) == pytest.approx((0.1 + 0.8 + 2 * 0.075) / 4, abs=1e-12)
    # Brier: (0.1^2 + 0.1^2) + (0.8^2 + 0.8^2) + (0.4^2 + 0.4^2) + (0.55^2 + 0.55^2), over 4
    assert brier(probs, labels) == pytest.approx((0.02 + 1.28 + 0.32 + 0.605) / 4, abs=1e-12)
    # a top probability of exactly 1 falls in the last bin, never past it
    assert ece(np.array([[1.0, 0.0]]), np.array([1])) == pytest.approx(1.0)


def test_fitted_temperature_is_the_nll_minimum() -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 400)
    # overconfident logits: the right class boosted, everything scaled up by 4
    logits = 4.0 * (rng.normal(size=(400, 3)) + 1.5 * np.eye(3)[labels])
    t = fit_temperature(logits, labels)
    grid = np.exp(np.linspace(np.log(0.2), np.log(20), 4001))
    best = grid[int(np.argmin([nll(logits, labels, g) for g in grid]))]
    assert t == pytest.approx(best, rel=2e-3)
    assert t > 1.5  # overconfident: a temperature above 1 softens
    report = calibrate(logits, labels)
    assert report["nll_after"] <= report["nll_before"]
    assert report["ece_after"] < report["ece_before"]


def _tiny(tmp_path: Path, tiny_config: Callable[..., Path], updates: dict | None = None) -> tuple:
    cfg = load_config(tiny_config(updates or {}))
    tok = build_tokenizer(cfg)
    torch.manual_seed(0)
    return tok, build_model(cfg, ["negative", "positive"], tok)


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_folded_weights_give_the_divided_logits(tmp_path: Path, tiny_config: Callable[..., Path], lora: bool) -> None:
    tok, model = _tiny(tmp_path, tiny_config, {"model.lora": {"r": 4}} if lora else None)
    model.eval()
    with torch.no_grad():  # a head away from its zero start, so the check sees the weights' scale
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = tok(["a fine film", "dull and far too long for what it is"], padding=True, return_tensors="pt")
    with torch.no_grad():
        before = model(**batch).logits.double()
    fold_temperature(model, 2.5)
    with torch.no_grad():
        after = (model.merge_and_unload() if lora else model)(**batch).logits.double()
    assert torch.allclose(after, before / 2.5, atol=1e-6, rtol=1e-6)
    assert torch.allclose(torch.softmax(after, -1), torch.softmax(before / 2.5, -1), atol=1e-7)


@pytest.mark.slow
def test_final_holds_the_calibrated_model(tiny_config: Callable[..., Path], tmp_path: Path) -> None:
    """On by default for single-label with validation: final/ = the last checkpoint with the output layer
    divided by eval.json's temperature, and final/'s probabilities on validation give eval.json's ECE."""
    cfg = tiny_config(
        {
            "train.calibrate": True,
            "checkpoint.every_steps": 100,
            "log.plots": True,
            "data.max_train_samples": 96,
            "data.max_eval_samples": 64,
        }
    )
    assert main(["--config", str(cfg)]) == 0
    run = tmp_path / "run"
    report = json.loads((run / "eval.json").read_text())["calibration"]
    t = report["temperature"]
    assert t != pytest.approx(1.0, abs=1e-3)
    assert (run / "reliability.png").stat().st_size > 0
    trained = load_file(str(ckpt.list_checkpoints(run)[-1] / "model.safetensors"))
    exported = load_file(str(run / "final" / "model.safetensors"))
    trained = {k.removeprefix("_orig_mod."): v for k, v in trained.items()}
    for name, value in exported.items():
        expected = trained[name] / t if name.startswith("classifier.") else trained[name]
        assert torch.allclose(value, expected, atol=1e-7, rtol=1e-6), name
    tok, model = load_final(run / "final")
    rows = [json.loads(x) for x in (run / "predictions.jsonl").read_text().splitlines()]
    preds = predict_texts(tok, model, [r["text"] for r in rows])
    probs = np.array([[p["probabilities"][n] for n in ("negative", "positive")] for p in preds])
    labels = np.array([["negative", "positive"].index(r["gold"]) for r in rows])
    assert ece(probs, labels) == pytest.approx(report["ece_after"], abs=1e-5)
    assert brier(probs, labels) == pytest.approx(report["brier_after"], abs=1e-5)
    # predictions.jsonl describes final/: its probabilities are the calibrated ones
    assert np.allclose([r["probabilities"]["positive"] for r in rows], probs[:, 1], atol=1e-5)
