"""Classification metrics (scikit-learn), evaluation over a prepared loader, metrics rows, curves."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_recall_fscore_support

from finetune import faults
from finetune.errors import UserError
from finetune.precision import fp32_cross_entropy

logger = logging.getLogger("finetune")


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


def _forward_in_chunks(model: torch.nn.Module, batch: dict[str, torch.Tensor], rows: int | None) -> torch.Tensor:
    """Logits of `batch`, computed `rows` rows at a time (all at once when None)."""
    n = batch["input_ids"].shape[0]
    step = rows or n
    return torch.cat([model(**{k: v[i : i + step] for k, v in batch.items()}).logits for i in range(0, n, step)])


def batch_logits(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], rows: int | None, fault_step: int
) -> tuple[torch.Tensor, int | None]:
    """Logits of an evaluation batch, halving the rows per forward after an out-of-memory error;
    returns the logits and the rows per forward that worked (kept for the following batches).

    Raises:
        UserError: out of memory with one row per forward.
    """
    n = batch["input_ids"].shape[0]
    while True:
        try:
            faults.oom_point("oom_in_eval", fault_step)
            return _forward_in_chunks(model, batch, rows), rows
        except torch.OutOfMemoryError as exc:
            current = rows or n
            if current == 1:
                raise UserError(
                    f"out of memory in evaluation at one row per forward ({str(exc).strip().splitlines()[0]}); "
                    "lower data.max_length"
                ) from None
            rows = max(1, current // 2)
            logger.warning(f"out of memory in evaluation at {current} rows per forward: retrying with {rows}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, loader: Any, accelerator: Accelerator, label_names: list[str], fault_step: int = 0
) -> dict[str, Any]:
    """Metrics over a prepared loader; `gather_for_metrics` drops the duplicates of padded batches.

    An out-of-memory error halves the rows per forward (the batches and results stay the same).

    Raises:
        UserError: out of memory even one row at a time.
    """
    model.eval()
    preds, refs, losses = [], [], []
    rows = None
    for batch in loader:
        labels = batch.pop("labels")
        logits, rows = batch_logits(model, batch, rows, fault_step)
        # the loss goes through gather_for_metrics too: the refilled tail of the last batch
        # (even_batches) must not count twice
        p, r, loss = accelerator.gather_for_metrics((logits.argmax(-1), labels, fp32_cross_entropy(logits, labels)))
        preds.append(p.cpu())
        refs.append(r.cpu())
        losses.append(loss.cpu())
    model.train()
    y_pred, y_true = torch.cat(preds).tolist(), torch.cat(refs).tolist()
    metrics = classification_metrics(y_true, y_pred, label_names)
    metrics["loss"] = float(torch.cat(losses).sum()) / max(1, len(y_true))
    return metrics


def record_row(accelerator: Accelerator, metrics_file: Path, row: dict[str, Any]) -> None:
    """One metrics.jsonl line (written by the main process only) and the same values to the trackers."""
    if accelerator.is_main_process:
        with metrics_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
    accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])


def eval_row(step: int, metrics: dict[str, Any], prefix: str = "eval") -> dict[str, Any]:
    """The metrics.jsonl fields of an evaluation."""
    return {"step": step, f"{prefix}_accuracy": metrics["accuracy"], f"{prefix}_macro_f1": metrics["macro_f1"],
            f"{prefix}_loss": metrics["loss"]}


def final_summary(final: dict[str, Any], final_dir: Path) -> str:
    """The run's last log line: what final/ holds and how it scores."""
    summary = f"done: final/ holds the {final.get('exported', 'last')} weights (step {final['step']})"
    if "accuracy" in final:
        summary += f"; validation accuracy {final['accuracy']:.4f}, macro-F1 {final['macro_f1']:.4f}"
    if "test" in final:
        summary += f"; test accuracy {final['test']['accuracy']:.4f}"
    return summary + f"; model in {final_dir}"
