"""Metrics per problem type (scikit-learn, scipy), evaluation over a prepared loader, metrics rows, curves.

single_label_classification: accuracy, macro-F1, per class, confusion matrix. multi_label_classification:
micro- and macro-F1, per-label F1 and subset accuracy at per-label decision thresholds (tuned on the
data given, or passed in: the test split uses validation's). regression: Pearson, Spearman, MSE.

`predictions` turns logits into probabilities and predictions for every reader: metrics, predictions.jsonl,
calibration and deploy's `finetune predict`, `evaluate` and `export`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    f1_score,
    mean_squared_error,
    precision_recall_fscore_support,
)

from finetune.config.tasks import HEADLINE, MULTI, PROBLEM_TYPES, REGRESSION
from finetune.core import faults
from finetune.core.errors import UserError
from finetune.core.fileio import METRICS_FILE, read_jsonl
from finetune.memory.monitor import latest_report, plot_memory
from finetune.model.precision import fp32_per_sample_loss

logger = logging.getLogger("finetune")


def above_thresholds(probs: np.ndarray, thresholds: Sequence[float] | None) -> np.ndarray:
    """Multi-label decisions: per text and label, whether its probability is at or above the label's
    threshold (0.5 for every label without thresholds)."""
    cut = thresholds if thresholds is not None and len(thresholds) else [0.5] * probs.shape[-1]
    return probs >= np.asarray(cut, dtype=np.float64)


def predictions(
    logits: np.ndarray, problem_type: str, thresholds: Sequence[float] | None = None
) -> tuple[np.ndarray | None, np.ndarray]:
    """What the model predicts from its logits (one row per text), in float64: the one rule that metrics,
    predictions.jsonl, calibration, `finetune predict`, `evaluate` and `export` read logits by.

    Returns `(probabilities, predicted)`: single-label, the softmax and the argmax label id; multi-label, the
    sigmoid per label and whether each is at or above its threshold (`above_thresholds`); regression, None
    and the value itself.
    """
    z = np.asarray(logits, dtype=np.float64)
    if problem_type == REGRESSION:
        return None, z[:, 0]
    if problem_type == MULTI:
        probs = 1.0 / (1.0 + np.exp(-z))
        return probs, above_thresholds(probs, thresholds)
    shifted = np.exp(z - z.max(-1, keepdims=True))  # scipy.special.softmax's arithmetic
    return shifted / shifted.sum(-1, keepdims=True), z.argmax(-1)


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


THRESHOLD_GRID = np.round(np.arange(0.05, 0.951, 0.05), 2)


def tune_thresholds(y_true: np.ndarray, probs: np.ndarray) -> list[float]:
    """Per label, the decision threshold on a 0.05 grid that maximises that label's F1 on this data
    (ties: the one nearest 0.5; a label without positives keeps 0.5)."""
    out = []
    for j in range(y_true.shape[1]):
        if y_true[:, j].sum() == 0:
            out.append(0.5)
            continue
        scores = [f1_score(y_true[:, j], probs[:, j] >= t, zero_division=0) for t in THRESHOLD_GRID]
        best = max(range(len(THRESHOLD_GRID)), key=lambda k: (scores[k], -abs(THRESHOLD_GRID[k] - 0.5)))
        out.append(float(THRESHOLD_GRID[best]))
    return out


def multilabel_metrics(
    y_true: np.ndarray, probs: np.ndarray, label_names: list[str], thresholds: list[float]
) -> dict[str, Any]:
    """Micro/macro-F1, per-label precision/recall/F1/support and subset accuracy at `thresholds`."""
    pred = above_thresholds(probs, thresholds)
    p, r, f, s = precision_recall_fscore_support(y_true, pred, zero_division=0)
    return {
        "micro_f1": float(f1_score(y_true, pred, average="micro", zero_division=0)),
        "macro_f1": float(f1_score(y_true, pred, average="macro", zero_division=0)),
        "subset_accuracy": float(accuracy_score(y_true, pred)),
        "micro_f1_at_0.5": float(f1_score(y_true, above_thresholds(probs, None), average="micro", zero_division=0)),
        "per_label": {
            name: {
                "precision": float(p[i]),
                "recall": float(r[i]),
                "f1": float(f[i]),
                "support": int(s[i]),
                "threshold": thresholds[i],
            }
            for i, name in enumerate(label_names)
        },
        "thresholds": list(thresholds),
        "num_samples": int(len(y_true)),
    }


def _correlation(fn: Any, a: np.ndarray, b: np.ndarray) -> float:
    if len(a) < 2 or np.std(a) == 0 or np.std(b) == 0:
        return 0.0  # undefined for a constant prediction: no correlation to report
    return float(fn(a, b)[0])


def regression_metrics(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, Any]:
    """Pearson and Spearman correlation and mean squared error."""
    return {
        "pearson": _correlation(pearsonr, y_pred, y_true),
        "spearman": _correlation(spearmanr, y_pred, y_true),
        "mse": float(mean_squared_error(y_true, y_pred)),
        "num_samples": int(len(y_true)),
    }


def compute_metrics(
    problem_type: str,
    y_true: np.ndarray,
    logits: np.ndarray,
    label_names: list[str],
    thresholds: list[float] | None = None,
) -> dict[str, Any]:
    """The metrics of `problem_type` from gathered labels and logits (multi-label: thresholds tuned
    on these rows when none are given)."""
    probs, predicted = predictions(logits, problem_type, thresholds)
    if problem_type == REGRESSION:
        return regression_metrics(y_true.astype(np.float64), predicted)
    if problem_type == MULTI:
        return multilabel_metrics(y_true, probs, label_names, thresholds or tune_thresholds(y_true, probs))
    return classification_metrics(y_true.tolist(), predicted.tolist(), label_names)


def _f1(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
    """F1 from counts; 0 where it is undefined (no positives predicted or present: sklearn's zero_division=0)."""
    denominator = 2 * tp + fp + fn
    return np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)


def headline_metrics(
    problem_type: str, y_true: np.ndarray, logits: np.ndarray, num_labels: int, thresholds: list[float] | None
) -> dict[str, float]:
    """The problem type's headline metrics (`tasks.PROBLEM_TYPES`) as `compute_metrics` defines them (the
    tests compare them), from counts in numpy: ~0.1 ms against sklearn's ~3 ms, and a bootstrap repeats
    it a thousand times."""
    return _headline_of(problem_type, y_true, predictions(logits, problem_type, thresholds)[1], num_labels)


def _headline_of(problem_type: str, y_true: np.ndarray, pred: np.ndarray, num_labels: int) -> dict[str, float]:
    """`headline_metrics` from the predictions (`predictions`' second value)."""
    if problem_type == REGRESSION:
        gold = y_true.astype(np.float64)
        return {
            "pearson": _correlation(pearsonr, pred, gold),
            "spearman": _correlation(spearmanr, pred, gold),
            "mse": float(np.mean((pred - gold) ** 2)),
        }
    if problem_type == MULTI:
        gold = y_true.astype(bool)
        tp, fp, fn = (pred & gold).sum(0), (pred & ~gold).sum(0), (~pred & gold).sum(0)
        return {
            "micro_f1": float(_f1(tp.sum(), fp.sum(), fn.sum())),
            "macro_f1": float(_f1(tp, fp, fn).mean()),
            "subset_accuracy": float(np.mean((pred == gold).all(1))),
        }
    counts = np.bincount(y_true.astype(np.int64) * num_labels + pred, minlength=num_labels**2)
    confusion = counts.reshape(num_labels, num_labels)  # rows: gold, columns: predicted
    tp = np.diag(confusion)
    f1 = _f1(tp, confusion.sum(0) - tp, confusion.sum(1) - tp)
    return {"accuracy": float(tp.sum() / len(y_true)), "macro_f1": float(f1.mean())}


def bootstrap_ci(
    problem_type: str,
    y_true: np.ndarray,
    logits: np.ndarray,
    num_labels: int,
    thresholds: list[float] | None = None,
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, Any]:
    """Percentile bootstrap intervals of the headline metrics: resample the texts with replacement
    `resamples` times (numpy's default_rng(seed), one draw of n indices per resample), recompute,
    take the (1 - level)/2 and (1 + level)/2 quantiles. Thresholds stay fixed (tuned once, not per resample).

    Returns `{metric}_ci: [low, high]` per headline metric and `bootstrap` (resamples, seed, level, method).
    """
    n = len(y_true)
    if resamples == 0 or n == 0:
        return {}
    rng = np.random.default_rng(seed)
    values: dict[str, list[float]] = {k: [] for k in PROBLEM_TYPES[problem_type].headline}
    _, pred = predictions(logits, problem_type, thresholds)  # per text: a resample's are these rows' own
    for _ in range(resamples):
        rows = rng.integers(0, n, n)
        for key, value in _headline_of(problem_type, y_true[rows], pred[rows], num_labels).items():
            values[key].append(value)
    tails = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    out: dict[str, Any] = {f"{k}_ci": [float(x) for x in np.percentile(v, tails)] for k, v in values.items()}
    out["bootstrap"] = {"resamples": resamples, "seed": seed, "level": level, "method": "percentile"}
    return out


def headline(metrics: dict[str, Any]) -> str:
    """`accuracy 0.8712, macro_f1 0.8701` from whatever headline metrics the dict has (with their
    bootstrap intervals where the dict has them)."""

    def one(key: str) -> str:
        ci = metrics.get(f"{key}_ci")
        return f"{key} {metrics[key]:.4f}" + (f" [95% CI {ci[0]:.4f}-{ci[1]:.4f}]" if ci else "")

    return ", ".join(one(k) for k in HEADLINE if k in metrics)


def plot_curves(metrics_file: Path, out_file: Path) -> None:
    """curves.png: training and evaluation loss on one axis, the headline evaluation metric,
    the learning rate and throughput (samples/s) against optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_file)
    train = [r for r in rows if "loss" in r]
    key = next((f"eval_{k}" for k in HEADLINE if any(f"eval_{k}" in r for r in rows)), "eval_loss")
    evals = [r for r in rows if key in r]
    losses = [r for r in rows if "eval_loss" in r]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="training")
    axes[0].plot([r["step"] for r in losses], [r["eval_loss"] for r in losses], marker="o", label="evaluation")
    axes[0].set_title("loss")
    axes[0].legend()
    axes[1].plot([r["step"] for r in evals], [r[key] for r in evals], marker="o")
    axes[1].set_title(key.replace("_", " "))
    axes[2].plot([r["step"] for r in train], [r["lr"] for r in train])
    axes[2].set_title("learning rate")
    axes[3].plot([r["step"] for r in train], [r.get("samples_per_s", float("nan")) for r in train])
    axes[3].set_title("samples/s (training, per log interval)")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_file, dpi=90)
    plt.close(fig)


def plot_run(run: Path) -> list[Path]:
    """`finetune report --plots`: the run's curves.png and memory.png drawn again from its metrics.jsonl;
    returns the files written.

    Raises:
        UserError: the run has no metrics.jsonl.
    """
    metrics = run / METRICS_FILE
    if not metrics.is_file():
        raise UserError(f"{run} has no metrics.jsonl to plot")
    plot_curves(metrics, run / "curves.png")
    plot_memory(metrics, run / "memory.png", report=latest_report(run))
    return [run / "curves.png", run / "memory.png"]


def _forward_in_chunks(model: torch.nn.Module, batch: dict[str, torch.Tensor], rows: int | None) -> torch.Tensor:
    """Logits of `batch`, computed `rows` rows at a time (all at once when None)."""
    n = batch["input_ids"].shape[0]
    step = rows or n
    return torch.cat([model(**{k: v[i : i + step] for k, v in batch.items()}).logits for i in range(0, n, step)])


def batch_logits(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], rows: int | None, alone: bool = True
) -> tuple[torch.Tensor, int | None]:
    """Logits of an evaluation batch, halving the rows per forward after an out-of-memory error;
    returns the logits and the rows per forward that worked (kept for the following batches).

    Raises:
        UserError: out of memory with one row per forward.
    """
    n = batch["input_ids"].shape[0]
    while True:
        try:
            faults.oom_point("oom_in_eval", faults.last_step())
            return _forward_in_chunks(model, batch, rows), rows
        except torch.OutOfMemoryError as exc:
            current = rows or n
            if not alone:  # with several processes every rank must run the same forwards
                raise UserError(
                    f"out of memory in evaluation on one of several processes "
                    f"({str(exc).strip().splitlines()[0]}); lower train.micro_batch_size"
                ) from None
            if current == 1:
                raise UserError(
                    f"out of memory in evaluation at one row per forward ({str(exc).strip().splitlines()[0]}); "
                    "lower data.max_length"
                ) from None
            rows = max(1, current // 2)
            logger.warning(f"out of memory in evaluation at {current} rows per forward: retrying with {rows}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


@dataclass
class Outputs:
    """One split's model outputs, one row per text (its windows aggregated), in the split's order."""

    logits: torch.Tensor  # fp32
    labels: torch.Tensor
    docs: torch.Tensor  # each row's text: its index in the split


@torch.no_grad()
def collect_outputs(model: torch.nn.Module, loader: Any, accelerator: Accelerator, aggregate: str = "mean") -> Outputs:
    """Logits and labels of a prepared loader, per text; `gather_for_metrics` drops the duplicates
    of padded batches. Rows that are windows of one text (`data.chunk_stride`) are scored as that
    text: their logits averaged (`aggregate="mean"`) or maxed. An out-of-memory error halves the
    rows per forward (the batches and results stay the same).

    Raises:
        UserError: out of memory even one row at a time.
    """
    model.eval()
    outs, refs, docs = [], [], []
    rows = None
    for batch in loader:
        labels, doc = batch.pop("labels"), batch.pop("doc")  # doc: the text a row (a window) belongs to
        logits, rows = batch_logits(model, batch, rows, accelerator.num_processes == 1)
        out, ref, doc = accelerator.gather_for_metrics((logits.float(), labels, doc))
        outs.append(out.cpu())
        refs.append(ref.cpu())
        docs.append(doc.cpu())
    model.train()
    return Outputs(*per_text(torch.cat(outs), torch.cat(refs), torch.cat(docs), aggregate))


def score(
    outputs: Outputs, problem_type: str, label_names: list[str], thresholds: list[float] | None = None
) -> dict[str, Any]:
    """The metrics of `outputs` (`compute_metrics`) and their mean loss; `num_samples` counts texts."""
    logits, labels = outputs.logits, outputs.labels
    metrics = compute_metrics(problem_type, labels.numpy(), logits.numpy(), label_names, thresholds)
    metrics["loss"] = float(fp32_per_sample_loss(logits, labels, problem_type).mean()) if len(labels) else 0.0
    return metrics


def per_text(
    logits: torch.Tensor, labels: torch.Tensor, docs: torch.Tensor, aggregate: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per text, in text order: the mean (or max) of its windows' logits, its label and its index."""
    ids, inverse = torch.unique(docs, return_inverse=True)
    if len(ids) == len(docs):
        order = torch.argsort(inverse)
        return logits[order], labels[order], docs[order]
    index = inverse.unsqueeze(-1).expand_as(logits)
    if aggregate == "max":
        out = torch.full((len(ids), logits.shape[1]), float("-inf")).scatter_reduce(0, index, logits, "amax")
    else:
        counts = torch.zeros(len(ids)).index_add_(0, inverse, torch.ones(len(docs)))
        out = torch.zeros(len(ids), logits.shape[1]).index_add_(0, inverse, logits) / counts[:, None]
    first = torch.zeros(len(ids), dtype=torch.long).scatter_(0, inverse.flip(0), torch.arange(len(docs)).flip(0))
    return out, labels[first], ids


def prediction_rows(
    split: str,
    outputs: Outputs,
    texts: list[str],
    pairs: list[str] | None,
    problem_type: str,
    label_names: list[str],
    thresholds: list[float] | None,
) -> list[dict[str, Any]]:
    """predictions.jsonl rows of one split: `split`, `id` (the text's row in the split), `text`
    (`text_pair`), `gold`, `prediction`, `probabilities` (per label; none for regression) and `loss`
    (the training loss of that text alone)."""
    losses = fp32_per_sample_loss(outputs.logits, outputs.labels, problem_type).tolist() if len(outputs.docs) else []
    probs, predicted = predictions(outputs.logits.numpy(), problem_type, thresholds)
    labels = outputs.labels
    rows = []
    for i, doc in enumerate(outputs.docs.tolist()):
        row: dict[str, Any] = {"split": split, "id": doc, "text": texts[doc]}
        if pairs is not None:
            row["text_pair"] = pairs[doc]
        if probs is None:  # regression
            row |= {"gold": float(labels[i]), "prediction": float(predicted[i]), "probabilities": None}
        elif problem_type == MULTI:
            row |= {
                "gold": [n for n, y in zip(label_names, labels[i].tolist(), strict=True) if y >= 0.5],
                "prediction": [n for n, on in zip(label_names, predicted[i].tolist(), strict=True) if on],
                "probabilities": dict(zip(label_names, probs[i].tolist(), strict=True)),
            }
        else:
            row |= {
                "gold": label_names[int(labels[i])],
                "prediction": label_names[int(predicted[i])],
                "probabilities": dict(zip(label_names, probs[i].tolist(), strict=True)),
            }
        rows.append(row | {"loss": losses[i]})
    return rows


def confident_mistakes(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The `n` most confident mistakes: wrong predictions by the probability given to the predicted
    label (multi-label: by loss), or for regression the largest absolute errors."""
    if rows and rows[0]["probabilities"] is None:
        return sorted(rows, key=lambda r: -abs(r["prediction"] - r["gold"]))[:n]
    wrong = [r for r in rows if r["prediction"] != r["gold"]]
    if wrong and isinstance(wrong[0]["prediction"], str):
        return sorted(wrong, key=lambda r: -r["probabilities"][r["prediction"]])[:n]
    return sorted(wrong, key=lambda r: -r["loss"])[:n]


def format_mistakes(rows: list[dict[str, Any]], width: int = 100) -> str:
    """`finetune report --errors`: one line per mistake, the text shortened to `width` characters."""

    def show(value: Any) -> str:
        if isinstance(value, float):  # regression
            return f"{value:.3f}"
        if isinstance(value, list):  # multi-label: the label set
            return "|".join(value) or "-"
        return str(value)

    lines = []
    for r in rows:
        text = r["text"] + (f" || {r['text_pair']}" if "text_pair" in r else "")
        text = text if len(text) <= width else text[: width - 3] + "..."
        confidence = f"p={r['probabilities'][r['prediction']]:.3f} " if isinstance(r["prediction"], str) else ""
        lines.append(
            f"{r['split']}#{r['id']} {confidence}loss={r['loss']:.3f} gold={show(r['gold'])} "
            f"predicted={show(r['prediction'])}: {text}"
        )
    return "\n".join(lines)


def read_predictions(run: Path, split: str | None = None) -> list[dict[str, Any]]:
    """The rows of RUN/predictions.jsonl (of `split` only, when given).

    Raises:
        UserError: no predictions.jsonl, or none of `split`.
    """
    path = run / "predictions.jsonl"
    if not path.is_file():
        raise UserError(f"{path} not found: a finished run with validation or test data writes it")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if split is None or r["split"] == split]
    if not rows:
        raise UserError(f"{path} has no {split} predictions")
    return rows


def mistakes_report(run: Path, n: int, split: str | None = None) -> str:
    """`finetune report --errors N`: the `n` most confident mistakes of the run's predictions.jsonl, one per line.

    Raises:
        UserError: n < 1, no predictions.jsonl, or none of `split`.
    """
    if n < 1:
        raise UserError(f"--errors needs a positive count, got {n}")
    rows = read_predictions(run, split)
    mistakes = confident_mistakes(rows, n)
    return format_mistakes(mistakes) if mistakes else f"no mistakes among {len(rows)} predictions"


def record_row(accelerator: Accelerator, metrics_file: Path, row: dict[str, Any]) -> None:
    """One metrics.jsonl line (written by the main process only) and the same values to the trackers."""
    if accelerator.is_main_process:
        with metrics_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
    accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])


def eval_row(step: int, metrics: dict[str, Any], prefix: str = "eval") -> dict[str, Any]:
    """The metrics.jsonl fields of an evaluation: its headline metrics and loss."""
    keys = [k for k in (*HEADLINE, "loss") if k in metrics]
    return {"step": step, **{f"{prefix}_{k}": metrics[k] for k in keys}}


def final_summary(final: dict[str, Any], final_dir: Path) -> str:
    """The run's last log line: what final/ holds and how it scores."""
    summary = f"done: final/ holds the {final.get('exported', 'last')} weights (step {final['step']})"
    if headline(final):
        summary += f"; validation {headline(final)}"
    if "test" in final:
        summary += f"; test {headline(final['test'])}"
    return summary + f"; model in {final_dir}"
