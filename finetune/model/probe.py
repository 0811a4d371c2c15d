"""A linear probe as the output layer's starting point (`model.head_init=probe`).

With a handful of rows a class, a randomly initialised head makes the first steps of fine-tuning move the
encoder to fit noise; a logistic regression on the starting model's features (what the output layer reads)
starts from the best linear read-out of the pretrained features, and fine-tuning then improves on it (linear
probing then fine-tuning: Kumar et al. 2022, arXiv 2202.10054). scikit-learn's LogisticRegression (L2, C = 1,
lbfgs, the head SetFit fits) does the fitting.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from transformers import PreTrainedModel

from finetune.model.load import output_layer

INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")
ABSENT_LOGIT = -10.0  # the bias of a class no training row has: never predicted over one that has rows


class HeadInput:
    """The input of a model's output layer at its latest forward (None until one ran)."""

    value: torch.Tensor | None = None


@contextmanager
def head_input(model: torch.nn.Module, keep: bool = True) -> Iterator[HeadInput]:
    """Within the block, `.value` holds what `model`'s output layer read (`train.contrastive_steps` compares it);
    `keep=False` hooks nothing."""
    tap = HeadInput()
    layer = output_layer(model) if keep else None
    handle = layer.register_forward_pre_hook(lambda _m, args: setattr(tap, "value", args[0])) if layer else None
    try:
        yield tap
    finally:
        if handle is not None:
            handle.remove()


def probe_features(model: torch.nn.Module, batches: Iterable[dict[str, Any]]) -> tuple[np.ndarray, ...]:
    """(features, labels, weights): what the output layer reads for each row of `batches` (eval mode, no
    gradients), with the rows' labels and sample weights (1 where the batches carry none)."""
    captured, labels, weights = [], [], []
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with torch.no_grad(), head_input(model) as tap:
            for batch in batches:
                model(**{k: batch[k].to(device) for k in INPUT_KEYS if k in batch})
                assert tap.value is not None
                captured.append(tap.value.float().cpu())
                labels.append(batch["labels"].cpu())
                weights.append(batch.get("sample_weight", torch.ones(len(batch["labels"]))).float().cpu())
    finally:
        model.train(was_training)
    return torch.cat(captured).numpy(), torch.cat(labels).numpy(), torch.cat(weights).numpy()


def probe_head(model: PreTrainedModel, batches: Iterable[dict[str, Any]]) -> str:
    """Fit the logistic regression on the training rows' features and write it into the output layer (binary:
    the one logit split as -z/2, +z/2, which softmax reads as the same probability); returns a log line."""
    layer = output_layer(model)
    if layer is None:
        return "head init probe: no output layer found; the model's own init kept"
    x, y, w = probe_features(model, batches)
    keep = w > 0
    x, y, w = x[keep], y[keep], w[keep]
    if len(set(y.tolist())) < 2:
        return "head init probe: the training rows hold fewer than 2 classes; the model's own init kept"
    fit = LogisticRegression(C=1.0, max_iter=2000).fit(x, y, sample_weight=w)
    classes = [int(c) for c in fit.classes_]
    coef, intercept = fit.coef_, fit.intercept_
    if len(classes) == 2:  # scikit-learn's binary model: one row, the second class's log-odds
        coef, intercept = np.stack([-coef[0] / 2, coef[0] / 2]), np.array([-intercept[0] / 2, intercept[0] / 2])
    weight = torch.zeros_like(layer.weight, dtype=torch.float64)
    bias = torch.full((layer.out_features,), ABSENT_LOGIT, dtype=torch.float64)
    for row, c in enumerate(classes):
        weight[c] = torch.from_numpy(coef[row])
        bias[c] = float(intercept[row])
    with torch.no_grad():
        layer.weight.copy_(weight.to(layer.weight.dtype))
        if layer.bias is not None:
            layer.bias.copy_(bias.to(layer.bias.dtype))
    accuracy = float((fit.predict(x) == y).mean()) if len(y) else 0.0
    return (
        f"head init: a logistic regression on the model's features of {len(y)} training rows "
        f"({len(classes)} classes, training accuracy {accuracy:.3f}) written into the output layer"
    )
