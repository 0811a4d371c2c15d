"""Calibrated probabilities for single-label classification: temperature scaling (Guo et al., 2017).

One temperature T is fitted on the validation logits of the exported weights by minimising the
negative log-likelihood of softmax(logits / T). The fit is over the inverse temperature b = 1/T, in
which the NLL is convex (log-sum-exp of b * z minus b * z_y), so a bounded scalar search finds the
global minimum. T is then folded into the classifier's output layer (W / T, b / T): final/ gives the
calibrated probabilities through `transformers.pipeline`, `finetune predict` and ONNX with no extra code,
and the argmax (so accuracy) is unchanged.

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


def calibrate(logits: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """The fitted temperature with the before/after measures (eval.json's `calibration`)."""
    temperature = fit_temperature(logits, labels)
    return {"temperature": temperature, "bins": ECE_BINS, "num_samples": int(len(labels))} | calibration_report(
        logits, labels, temperature
    )


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


def plot_reliability(logits: np.ndarray, labels: np.ndarray, temperature: float, out_file: Path) -> None:
    """reliability.png: accuracy against confidence per bin, before and after the temperature, with ECE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    z, y = np.asarray(logits, np.float64), np.asarray(labels, np.int64)
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", label="perfect calibration")
    for name, t, marker in (("softmax", 1.0, "o"), (f"T = {temperature:.3f}", temperature, "s")):
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
    ax.set_title("reliability on validation")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out_file, dpi=90)
    plt.close(fig)
