"""Classification metrics (scikit-learn) and the training-curve plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_recall_fscore_support


def classification_metrics(y_true: Sequence[int], y_pred: Sequence[int], label_names: list[str]) -> dict[str, Any]:
    """Accuracy, macro-F1, per-class precision/recall/F1/support and the confusion matrix."""
    labels = list(range(len(label_names)))
    p, r, f, s = precision_recall_fscore_support(y_true, y_pred, labels=labels, zero_division=0)
    return {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "macro_f1": float(f1_score(y_true, y_pred, labels=labels, average="macro", zero_division=0)),
        "per_class": {
            name: {"precision": float(p[i]), "recall": float(r[i]), "f1": float(f[i]), "support": int(s[i])}
            for i, name in enumerate(label_names)
        },
        "confusion_matrix": confusion_matrix(y_true, y_pred, labels=labels).tolist(),
        "num_samples": len(y_true),
    }


def plot_curves(metrics_file: Path, out_file: Path) -> None:
    """curves.png: training loss, learning rate and eval accuracy against optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train])
    axes[0].set_title("training loss")
    axes[1].plot([r["step"] for r in train], [r["lr"] for r in train])
    axes[1].set_title("learning rate")
    axes[2].plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], marker="o")
    axes[2].set_title("eval accuracy")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_file, dpi=90)
    plt.close(fig)
