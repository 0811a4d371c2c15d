"""Temperature scaling (finetune/evaluation/calibrate.py): ECE and Brier against hand computations, the fitted
temperature against a brute-force search, the test split's block and the cross-fitted estimate against plain numpy,
the row-count and keep-only-if-the-cross-fitted-NLL-drops rules, the fold into the output layer against dividing
the logits (plain and LoRA), and a run whose final/ gives the calibrated probabilities eval.json reports."""

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
from finetune.evaluation.calibrate import (
    MIN_ROWS,
    brier,
    calibrate,
    cross_fitted,
    ece,
    fit_temperature,
    fold_temperature,
    nll,
    report_on_test,
    split_halves,
)
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


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _numpy_measures(z: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """ECE over 15 equal-width bins (lo, hi], Brier score and NLL of softmax(z), written out plainly."""
    p = _softmax(z)
    confidence, correct = p.max(1), (p.argmax(1) == y).astype(float)
    edges = np.linspace(0.0, 1.0, 16)
    ece_sum = 0.0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        inside = (confidence > lo) & (confidence <= hi)
        if inside.any():
            ece_sum += inside.mean() * abs(correct[inside].mean() - confidence[inside].mean())
    onehot = np.eye(z.shape[1])[y]
    return {
        "ece": ece_sum,
        "brier": float(((p - onehot) ** 2).sum(1).mean()),
        "nll": float(-np.log(p[np.arange(len(y)), y]).mean()),
    }


def _overconfident(rows: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, rows)
    return 4.0 * (rng.normal(size=(rows, classes)) + 1.5 * np.eye(classes)[labels]), labels


def test_test_block_applies_the_validation_temperature_to_test() -> None:
    """final/'s test logits are already divided by T: the block's `before` is softmax(logits * T), `after`
    softmax(logits), each against plain numpy."""
    z, y = _overconfident(300, 4, seed=1)  # the logits as trained
    t = 2.3
    block = report_on_test(z / t, y, t)  # what final/ computes on test
    before, after = _numpy_measures(z, y), _numpy_measures(z / t, y)
    for when, expected in (("before", before), ("after", after)):
        for name in ("ece", "brier", "nll"):
            assert block[f"{name}_{when}"] == pytest.approx(expected[name], abs=1e-9), f"{name}_{when}"
    assert block["ece_after"] < block["ece_before"]


def test_too_few_rows_fit_no_temperature() -> None:
    z, y = _overconfident(MIN_ROWS, 3, seed=2)
    below = calibrate(z[:-1], y[:-1])
    assert below["temperature"] == 1.0 and str(MIN_ROWS - 1) in below["skipped"]
    assert "ece_after" not in below and "cross_fitted" not in below
    at = calibrate(z, y)
    assert "skipped" not in at and at["kept"] and at["temperature"] > 1.5
    assert "skipped" in calibrate(z, y, min_rows=MIN_ROWS + 1)


def test_halves_are_seeded_stratified_and_cover_the_rows() -> None:
    y = np.array([0] * 7 + [1] * 10 + [2] * 3)
    a, b = split_halves(y, seed=5)
    assert sorted(np.concatenate([a, b]).tolist()) == list(range(len(y)))
    assert abs(len(a) - len(b)) <= 1
    for k in range(3):
        assert abs(int((y[a] == k).sum()) - int((y[b] == k).sum())) <= 1
    assert all(np.array_equal(u, v) for u, v in zip(split_halves(y, 5), (a, b), strict=True))
    assert not np.array_equal(split_halves(y, 6)[0], a)


def test_cross_fitted_is_the_mean_of_the_two_held_out_halves() -> None:
    z, y = _overconfident(120, 3, seed=3)
    got = cross_fitted(z, y, seed=7)
    a, b = split_halves(y, seed=7)
    halves = []
    for fit, scored in ((a, b), (b, a)):
        t = fit_temperature(z[fit], y[fit])
        halves.append((t, _numpy_measures(z[scored], y[scored]), _numpy_measures(z[scored] / t, y[scored])))
    assert got["temperatures"] == pytest.approx([t for t, _, _ in halves])
    for name in ("ece", "brier", "nll"):
        assert got[f"{name}_before"] == pytest.approx(np.mean([h[1][name] for h in halves]), abs=1e-9)
        assert got[f"{name}_after"] == pytest.approx(np.mean([h[2][name] for h in halves]), abs=1e-9)
    assert "seed 7" in got["note"]


def test_a_temperature_that_does_not_lower_the_cross_fitted_nll_is_not_kept() -> None:
    """One half all right with a margin (its fit sharpens), the other half half wrong with the same margin (its
    fit flattens): each half's temperature raises the other half's NLL, so T stays 1."""
    y = np.arange(MIN_ROWS) % 2
    a, b = split_halves(y, seed=0)
    z = np.zeros((MIN_ROWS, 2))
    z[a, y[a]] = 3.0
    wrong = b[::2]
    z[b, y[b]] = 3.0
    z[wrong], z[wrong, y[wrong]] = 3.0, 0.0  # the other class at 3
    report = calibrate(z, y, seed=0)
    crossed = report["cross_fitted"]
    assert crossed["nll_after"] >= crossed["nll_before"]
    assert report["kept"] is False and report["temperature"] == 1.0 and "cross-fitted NLL" in report["reason"]
    assert report["fitted_temperature"] != pytest.approx(1.0, abs=1e-3)
    assert report["ece_after"] == report["ece_before"] and report["nll_after"] == report["nll_before"]
    kept = calibrate(*_overconfident(MIN_ROWS, 2, seed=4))  # an overconfident classifier: the fit helps
    assert kept["kept"] is True and kept["temperature"] == kept["fitted_temperature"] > 1.0
    assert kept["cross_fitted"]["nll_after"] < kept["cross_fitted"]["nll_before"]


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
def test_final_holds_the_calibrated_model(tiny_config: Callable[..., Path], tmp_path: Path, data_dir: Path) -> None:
    """On by default for single-label with validation: final/ = the last checkpoint with the output layer
    divided by eval.json's temperature, and final/'s probabilities on validation give eval.json's ECE; on a
    test split of other rows, eval.json's `calibration.test` is what final/'s test probabilities give."""
    folder = tmp_path / "data"
    (folder / "sst2").mkdir(parents=True)
    train = (data_dir / "sst2" / "train.tsv").read_text().splitlines(keepends=True)
    dev = (data_dir / "sst2" / "dev.tsv").read_text().splitlines(keepends=True)
    (folder / "sst2" / "train.tsv").write_text("".join(train[:201]))
    (folder / "sst2" / "dev.tsv").write_text("".join(dev[:65]))
    (folder / "sst2" / "test.tsv").write_text("".join(dev[:1] + dev[65:129]))  # the header, then 64 other rows
    cfg = tiny_config(
        {
            "train.calibrate": True,
            "checkpoint.every_steps": 100,
            "log.plots": True,
            "data.data_dir": str(folder),
            "data.test_file": "sst2/test.tsv",
            "data.max_train_samples": 96,
            "data.max_eval_samples": MIN_ROWS,
        }
    )
    assert main(["--config", str(cfg)]) == 0
    run = tmp_path / "run"
    report = json.loads((run / "eval.json").read_text())["calibration"]
    t = report["temperature"]
    assert report["kept"] and t != pytest.approx(1.0, abs=1e-3)
    assert set(report["cross_fitted"]) >= {"ece_before", "ece_after", "nll_before", "nll_after", "note"}
    assert (run / "reliability.png").stat().st_size > 0
    trained = load_file(str(ckpt.list_checkpoints(run)[-1] / "model.safetensors"))
    exported = load_file(str(run / "final" / "model.safetensors"))
    trained = {k.removeprefix("_orig_mod."): v for k, v in trained.items()}
    for name, value in exported.items():
        expected = trained[name] / t if name.startswith("classifier.") else trained[name]
        assert torch.allclose(value, expected, atol=1e-7, rtol=1e-6), name
    tok, model = load_final(run / "final")
    split_rows = [json.loads(x) for x in (run / "predictions.jsonl").read_text().splitlines()]
    tested = [r for r in split_rows if r["split"] == "test"]
    p_test = np.array([[r["probabilities"][n] for n in ("negative", "positive")] for r in tested], np.float64)
    y_test = np.array([["negative", "positive"].index(r["gold"]) for r in tested])
    assert len(tested) == report["test"]["num_samples"] == MIN_ROWS
    for when, z in (("before", np.log(p_test) * t), ("after", np.log(p_test))):  # log p: the logits up to a shift
        expected = _numpy_measures(z, y_test)
        for name in ("ece", "brier", "nll"):
            assert report["test"][f"{name}_{when}"] == pytest.approx(expected[name], abs=1e-5), f"{name}_{when}"
    rows = [r for r in split_rows if r["split"] == "validation"]
    preds = predict_texts(tok, model, [r["text"] for r in rows])
    probs = np.array([[p["probabilities"][n] for n in ("negative", "positive")] for p in preds])
    labels = np.array([["negative", "positive"].index(r["gold"]) for r in rows])
    assert ece(probs, labels) == pytest.approx(report["ece_after"], abs=1e-5)
    assert brier(probs, labels) == pytest.approx(report["brier_after"], abs=1e-5)
    # predictions.jsonl describes final/: its probabilities are the calibrated ones
    assert np.allclose([r["probabilities"]["positive"] for r in rows], probs[:, 1], atol=1e-5)
