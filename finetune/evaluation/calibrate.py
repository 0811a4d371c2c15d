"""Calibrated probabilities for single-label classification: temperature scaling (Guo et al., 2017).

One temperature T is fitted on the validation logits of the exported weights by minimising the
negative log-likelihood of softmax(logits / T). The fit is over the inverse temperature b = 1/T, in
which the NLL is convex (log-sum-exp of b * z minus b * z_y), so a bounded scalar search finds the
global minimum. T is then folded into the classifier's output layer (W / T, b / T): final/ gives the
calibrated probabilities through `transformers.pipeline`, `finetune predict` and ONNX with no extra code,
and the argmax (so accuracy) is unchanged.

A temperature is fitted only from MIN_ROWS validation rows, and kept only where it lowers the NLL on rows it
was not fitted on: validation is split in two halves (seeded, stratified by label), the temperature fitted on
one half is scored on the other, both ways, and the two halves' measures averaged (`cross_fitted`). The
in-sample measures (fitted and scored on the same rows) flatter the temperature; the cross-fitted ones and,
where there is one, the test split's say what it does on new texts.

Measures: the expected calibration error over 15 equal-width confidence bins (`ece`) and the Brier
score (`brier`: the mean over texts of sum_k (p_k - y_k)^2, Brier's original multi-class form, 0 to 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax

from finetune.config.tasks import SINGLE
from finetune.evaluation.metrics import predictions
from finetune.model.load import output_layer

ECE_BINS = 15
# the search range of the inverse temperature: T from 0.01 to 100
INVERSE_TEMPERATURE_BOUNDS = (0.01, 100.0)
# fewer validation rows: no temperature. scripts/bench_calibration.py (docs/results/calibration.jsonl): on synthetic
# logits of a known temperature (0.8 to 2, 2 to 77 classes), below this many rows a fitted temperature raised the
# NLL on new rows in more draws than it lowered it in some case (a few rows, all predicted right, are fitted by the
# sharpest temperature searched); the cross-fitted check does not catch that, its halves are as small
MIN_ROWS = 64


def nll(logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of the labels under softmax(logits / temperature)."""
    z = log_softmax(np.asarray(logits, np.float64) / temperature, axis=1)
    return float(-z[np.arange(len(labels)), labels].mean())


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error: texts binned by confidence (the top probability) into `bins`
    equal-width bins (lo, hi]; the bins' |accuracy - mean confidence| weighted by their share of texts."""
    confidence = probs.max(1)
    correct = (probs.argmax(1) == labels).astype(np.float64)
    # bin i holds confidences in (i/bins, (i+1)/bins]; the top probability is at least 1/num_labels > 0
    which = np.clip(np.ceil(confidence * bins).astype(np.int64) - 1, 0, bins - 1)
    total = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            total += mask.mean() * abs(correct[mask].mean() - confidence[mask].mean())
    return float(total)


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean over texts of sum_k (p_k - y_k)^2 with y the one-hot label."""
    onehot = np.eye(probs.shape[1])[labels]
    return float(((probs - onehot) ** 2).sum(1).mean())


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """The temperature minimising the NLL of `labels` under softmax(logits / T) (1.0 for no texts)."""
    z, y = np.asarray(logits, np.float64), np.asarray(labels, np.int64)
    if len(y) == 0:
        return 1.0
    found = minimize_scalar(
        lambda b: nll(z * b, y), bounds=INVERSE_TEMPERATURE_BOUNDS, method="bounded", options={"xatol": 1e-6}
    )
    return float(1.0 / found.x)


def calibration_report(logits: np.ndarray, labels: np.ndarray, temperature: float) -> dict[str, float]:
    """ECE, Brier score and NLL of softmax(logits) (`*_before`) and of softmax(logits / T) (`*_after`)."""
    z, y = np.asarray(logits, np.float64), np.asarray(labels, np.int64)
    out: dict[str, float] = {}
    for when, t in (("before", 1.0), ("after", temperature)):
        p, _ = predictions(z / t, SINGLE)
        out |= {f"ece_{when}": ece(p, y), f"brier_{when}": brier(p, y), f"nll_{when}": nll(z, y, t)}
    return out


def split_halves(labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two halves of the row indices, stratified: each label's rows in a seeded random order, one label after the
    other, dealt alternately to the halves (every label and the halves within one row of even)."""
    y = np.asarray(labels, np.int64)
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(np.flatnonzero(y == k)) for k in np.unique(y)])
    return np.sort(order[0::2]), np.sort(order[1::2])


def cross_fitted(logits: np.ndarray, labels: np.ndarray, seed: int) -> dict[str, Any]:
    """The measures of temperature scaling on rows it was not fitted on, from validation alone: a temperature
    fitted on one half (`split_halves`) and scored on the other, both ways; each measure the mean of the two."""
    z, y = np.asarray(logits, np.float64), np.asarray(labels, np.int64)
    halves = split_halves(y, seed)
    temperatures, reports = [], []
    for fit, scored in (halves, halves[::-1]):
        temperatures.append(fit_temperature(z[fit], y[fit]))
        reports.append(calibration_report(z[scored], y[scored], temperatures[-1]))
    return {key: float(np.mean([r[key] for r in reports])) for key in reports[0]} | {
        "temperatures": temperatures,
        "note": f"fitted on one half of the validation rows and scored on the other (seed {seed}, stratified by "
        "label), both ways, the mean of the two: what the temperature does on rows it was not fitted on",
    }


def report_on_test(logits: np.ndarray, labels: np.ndarray, temperature: float) -> dict[str, Any]:
    """The test split's measures under the temperature fitted on validation, from the logits of final/'s
    weights, which are already divided by it: before = softmax(logits * T), after = softmax(logits)."""
    before = np.asarray(logits, np.float64) * temperature
    return {"num_samples": int(len(labels))} | calibration_report(before, labels, temperature)


def calibrate(logits: np.ndarray, labels: np.ndarray, seed: int = 0, min_rows: int = MIN_ROWS) -> dict[str, Any]:
    """eval.json's `calibration` from the validation logits: the temperature to fold in, with the ECE, Brier
    score and NLL before and after on validation (in-sample) and cross-fitted (`cross_fitted`, split by `seed`).
    Under `min_rows` rows nothing is fitted (`skipped` says why); a fitted temperature that does not lower the
    cross-fitted NLL is not kept (`kept` false, `reason`). Either way `temperature` is then 1."""
    z, y = np.asarray(logits, np.float64), np.asarray(labels, np.int64)
    out: dict[str, Any] = {"temperature": 1.0, "bins": ECE_BINS, "num_samples": int(len(y))}
    if len(y) < min_rows:
        return out | {"skipped": f"{len(y)} validation rows, fewer than the {min_rows} a temperature is fitted on"}
    fitted = fit_temperature(z, y)
    crossed = cross_fitted(z, y, seed)
    kept = crossed["nll_after"] < crossed["nll_before"]
    out |= {"temperature": fitted if kept else 1.0, "fitted_temperature": fitted, "kept": kept}
    if not kept:
        out["reason"] = (
            f"the fitted temperature did not lower the cross-fitted NLL ({crossed['nll_before']:.4f} -> "
            f"{crossed['nll_after']:.4f})"
        )
    return out | calibration_report(z, y, out["temperature"]) | {"cross_fitted": crossed}


def fold_temperature(model: torch.nn.Module, temperature: float) -> torch.nn.Linear:
    """Divide the output layer's weight and bias by `temperature` in place, so that the model's logits
    are its old logits / temperature; returns the layer. Under LoRA the trained copy of the head is the
    one changed (peft's `modules_to_save`), which is what the merged export and the adapter hold.

    Raises:
        ValueError: the model has no output layer writing `num_labels` logits.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer = output_layer(base)
    if layer is None:
        raise ValueError("no output layer writing num_labels logits to fold the temperature into")
    with torch.no_grad():
        layer.weight.div_(temperature)
        if layer.bias is not None:
            layer.bias.div_(temperature)
    return layer


def reliability_points(probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> list[tuple[float, float, int]]:
    """Per non-empty bin: mean confidence, accuracy, number of texts."""
    confidence = probs.max(1)
    correct = (probs.argmax(1) == labels).astype(np.float64)
    which = np.clip(np.ceil(confidence * bins).astype(np.int64) - 1, 0, bins - 1)
    return [
        (float(confidence[which == b].mean()), float(correct[which == b].mean()), int((which == b).sum()))
        for b in range(bins)
        if (which == b).any()
    ]


def plot_reliability(
    logits: np.ndarray, labels: np.ndarray, temperature: float, out_file: Path, split: str = "validation"
) -> None:
    """reliability.png: accuracy against confidence per bin on `split`, before and after the temperature (`logits`
    as before it), with ECE; one curve where the temperature is 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    z, y = np.asarray(logits, np.float64), np.asarray(labels, np.int64)
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", label="perfect calibration")
    curves = [("softmax", 1.0, "o")] + ([(f"T = {temperature:.3f}", temperature, "s")] if temperature != 1.0 else [])
    for name, t, marker in curves:
        p, _ = predictions(z / t, SINGLE)
        points = reliability_points(p, y)
        ax.plot(
            [c for c, _, _ in points], [a for _, a, _ in points], marker=marker, label=f"{name}: ECE {ece(p, y):.4f}"
        )
    low = 1.0 / z.shape[1]
    ax.set_xlim(low - 0.02, 1.01)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel(f"confidence (top probability, {ECE_BINS} bins)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"reliability on {split}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out_file, dpi=90)
    plt.close(fig)
