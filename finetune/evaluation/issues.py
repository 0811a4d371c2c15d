"""Which given labels are likely wrong, from out-of-sample predicted probabilities: confident learning
(Northcutt et al., cleanlab's `find_label_issues`), ranked by the probability the model gives the given label.

cleanlab does the statistics (the confident joint, the per-class noise rates, which rows to prune); this module
only turns the run's label ids into what cleanlab takes and its answer into ranked rows with a suggested label.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from finetune.config.tasks import MULTI, REGRESSION
from finetune.core.errors import UserError


@dataclass(frozen=True)
class LabelIssue:
    """One row whose given label the probabilities contradict: its position among the audited rows, the given
    and suggested label ids (lists of ids for multi-label) and `score`, the probability of the given label
    (multi-label: cleanlab's self-confidence per label, pooled over the labels by its exponential moving average
    of the sorted scores, which weighs the worst label most); lower is likelier wrong."""

    index: int
    given: Any
    suggested: Any
    score: float


def check_cleanlab() -> Any:
    """cleanlab, imported when an audit runs (it checks this before its folds train).

    Raises:
        UserError: cleanlab is not installed.
    """
    try:
        import cleanlab.filter
    except ImportError:
        raise UserError("finetune audit needs cleanlab: pip install cleanlab (requirements.txt pins it)") from None
    return cleanlab


def find_label_issues(
    labels: list[Any], probs: np.ndarray, problem_type: str, filter_by: str = "low_self_confidence"
) -> list[LabelIssue]:
    """The rows of `labels` (label ids; multi-label: lists of ids) whose label is likely wrong given `probs`
    (out-of-sample probabilities, one row per label row), most likely wrong first.

    Raises:
        UserError: a regression task (no label to be wrong), or cleanlab missing.
    """
    if problem_type == REGRESSION:
        raise UserError("finetune audit finds wrong class labels; a regression target has none")
    cl = check_cleanlab()
    probs = np.asarray(probs, dtype=np.float64)
    if problem_type == MULTI:
        from cleanlab.multilabel_classification.filter import find_label_issues as find_multi
        from cleanlab.multilabel_classification.rank import get_label_quality_scores

        flagged = find_multi(labels=labels, pred_probs=probs, filter_by=filter_by)
        scores = get_label_quality_scores(labels, probs, method="self_confidence")
        suggested = [[j for j in range(probs.shape[1]) if probs[i, j] >= 0.5] for i in range(len(labels))]
    else:
        given = np.asarray(labels, dtype=np.int64)
        flagged = cl.filter.find_label_issues(labels=given, pred_probs=probs, filter_by=filter_by)
        scores = probs[np.arange(len(given)), given]
        suggested = probs.argmax(1).tolist()
    order = sorted(np.flatnonzero(flagged).tolist(), key=lambda i: (scores[i], i))
    return [LabelIssue(i, labels[i], suggested[i], float(scores[i])) for i in order]


def swap_counts(issues: list[LabelIssue], label_names: list[str], top: int = 5) -> list[tuple[str, int]]:
    """The most frequent (given -> suggested) label pairs among `issues`, as "given -> suggested" with counts."""
    counts = Counter(f"{label_text(x.given, label_names)} -> {label_text(x.suggested, label_names)}" for x in issues)
    return counts.most_common(top)


def label_text(ids: Any, label_names: list[str]) -> str:
    """A label id (or a list of them) by name, as label_issues.csv and the summary spell it: a multi-label set as
    names joined by '|' ('(none)' when empty)."""
    if isinstance(ids, list):
        return "|".join(label_names[i] for i in ids) or "(none)"
    return label_names[int(ids)]
