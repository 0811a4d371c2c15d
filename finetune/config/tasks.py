"""Problem types and their metrics: the one registry.

Each problem type lists its headline metrics, the default `checkpoint.best_metric` first: what
eval.json gives bootstrap intervals for, what the log line and metrics.jsonl's evaluation rows show,
and (with `loss`) what `checkpoint.best_metric` may name. Each metric says whether lower is better
and what the Hub's model-index calls it. The schema (config), evaluation (metrics), checkpoints and
sweeps (direction) and the model card read them here; the computation itself is in metrics.py.

This module sits just above errors.py, below the schema, so every module may import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

SINGLE, MULTI, REGRESSION = "single_label_classification", "multi_label_classification", "regression"


@dataclass(frozen=True)
class Metric:
    """One evaluation metric: its eval.json key, its direction and its name on the model card."""

    name: str  # the key in eval.json and metrics.jsonl (`eval_<name>`)
    lower_is_better: bool
    hub_type: str | None  # the model-index metric type (a Hub metric id); None: not on the card
    hub_name: str | None = None  # the card's display name
    hub_args: Mapping[str, str] | None = None  # the model-index `args`
    proportion: bool = False  # a share of rows (a binomial standard error applies: checkpoint.best_within_se)


@dataclass(frozen=True)
class ProblemType:
    """One `model.problem_type`: its headline metrics (the default best metric first) and the card's line."""

    name: str
    headline: tuple[str, ...]
    description: str

    @property
    def best_metrics(self) -> tuple[str, ...]:
        """What `checkpoint.best_metric` may name: the headline metrics and the evaluation loss."""
        return (*self.headline, "loss")


# The order here is the order the card's tables and the config reference list them in.
METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("accuracy", False, "accuracy", "Accuracy", proportion=True),
        Metric("macro_f1", False, "f1", "Macro F1", {"average": "macro"}),
        Metric("micro_f1", False, "f1", "Micro F1", {"average": "micro"}),
        Metric("subset_accuracy", False, "accuracy", "Subset accuracy (exact match)", proportion=True),
        Metric("pearson", False, "pearsonr", "Pearson correlation"),
        Metric("spearman", False, "spearmanr", "Spearman correlation"),
        Metric("mse", True, "mse", "Mean squared error"),
        Metric("loss", True, None),  # the training loss on the split, every problem type's; not on the card
    )
}

PROBLEM_TYPES: dict[str, ProblemType] = {
    p.name: p
    for p in (
        ProblemType(
            SINGLE,
            ("accuracy", "macro_f1"),
            "single-label classification: one label per text (softmax over the labels)",
        ),
        ProblemType(
            MULTI,
            ("micro_f1", "macro_f1", "subset_accuracy"),
            "multi-label classification: any number of labels per text (a sigmoid per label, each with "
            "its decision threshold)",
        ),
        ProblemType(REGRESSION, ("pearson", "spearman", "mse"), "regression: one real-valued score per text"),
    )
}


def _merged(orders: list[tuple[str, ...]]) -> tuple[str, ...]:
    """One sequence holding every name, each input's names in that input's order: a name not yet placed
    goes just before the next name of its input that is (else at the end)."""
    out: list[str] = []
    for order in orders:
        for i, name in enumerate(order):
            if name not in out:
                later = [out.index(n) for n in order[i + 1 :] if n in out]
                out.insert(min(later) if later else len(out), name)
    return tuple(out)


# Every headline metric in the order logs and metrics.jsonl show them: a metrics dict holds one problem
# type's, and this lists each problem type's in its own order (the default best metric first).
HEADLINE = _merged([p.headline for p in PROBLEM_TYPES.values()])


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of `metric` is better (loss, mse); any other name is maximised."""
    return metric in METRICS and METRICS[metric].lower_is_better


def direction(metric: str) -> Literal["minimize", "maximize"]:
    """Optuna's direction for `metric`."""
    return "minimize" if lower_is_better(metric) else "maximize"
