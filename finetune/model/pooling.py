"""Mean pooling inside the family's own classifier (`model.pooling=mean`).

Sentence-transformers checkpoints (all-MiniLM-L6-v2, all-mpnet-base-v2) were trained to be read through the mean
of their token states; their [CLS] state is a weaker feature (a frozen MiniLM with a logistic regression on 8 rows
a class: lower accuracy from [CLS] than from the mean, docs/ARCHITECTURE.md). transformers' BERT and MPNet
classifiers read the first token only, and a custom class would need `trust_remote_code` to load. So the pooling
is expressed as one more encoder layer of the family's own kind, set so that every position's output is
LayerNorm(c * mean + own state):

- query and key at zero: every attention score is equal, so softmax spreads evenly over the unmasked tokens
  (padding gets none), and value = identity makes each head's output the mean of the token states;
- the attention's output projection at c * identity (c = MEAN_SCALE): the residual adds the token's own state,
  which the LayerNorm (scale-free) then weighs 1/c against the mean;
- the feed-forward block at zero (gelu(0) = 0), so the last LayerNorm receives an already normalised vector.

final/ is then the family's own `*ForSequenceClassification` with one more layer (`config.num_hidden_layers`)
and `config.finetune_mean_pooling` set, which `transformers.pipeline` loads as any other checkpoint. The layer is
frozen: training moves the layers below it and the head. MPNet adds its relative position bias to every layer's
scores, so there the weights are the bias's softmax over the positions rather than exactly even.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from finetune.core.errors import UserError

MEAN_SCALE = 1000.0  # the mean's weight against the residual: large, and c * |state| stays within fp16's range
MARKER = "finetune_mean_pooling"  # the config attribute a model that already holds the layer carries


@dataclass(frozen=True)
class LayerParts:
    """Attribute paths inside one encoder layer of a family."""

    query: str
    key: str
    value: str
    attention_out: str
    attention_norm: str
    ffn_in: str
    ffn_out: str
    output_norm: str


BERT_PARTS = LayerParts(
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "attention.output.LayerNorm",
    "intermediate.dense",
    "output.dense",
    "output.LayerNorm",
)
FAMILIES: dict[str, LayerParts] = {
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "electra", "camembert"), BERT_PARTS),
    "mpnet": LayerParts(
        "attention.attn.q",
        "attention.attn.k",
        "attention.attn.v",
        "attention.attn.o",
        "attention.LayerNorm",
        "intermediate.dense",
        "output.dense",
        "output.LayerNorm",
    ),
}


def has_mean_layer(model: PreTrainedModel) -> bool:
    """Whether `model` already ends in the mean-pooling layer (a final/ of a `model.pooling=mean` run)."""
    return bool(getattr(model.config, MARKER, False))


def append_mean_layer(model: PreTrainedModel) -> str:
    """Append the mean-pooling layer (module docstring) to `model`'s encoder, frozen; returns a log line.

    Raises:
        UserError: a family without a known encoder layer layout (FAMILIES).
    """
    kind = getattr(model.config, "model_type", "")
    if has_mean_layer(model):
        return "model.pooling=mean: the checkpoint already ends in its mean-pooling layer; kept as loaded"
    layers = getattr(getattr(getattr(model, model.base_model_prefix, None), "encoder", None), "layer", None)
    if kind not in FAMILIES or not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise UserError(
            f"model.pooling=mean: no mean-pooling layer for model_type {kind!r} "
            f"(known: {', '.join(sorted(FAMILIES))}); use model.pooling=first"
        )
    parts = FAMILIES[kind]
    layer = copy.deepcopy(layers[-1])

    def part(path: str) -> torch.nn.Module:
        module: torch.nn.Module = layer
        for name in path.split("."):
            module = getattr(module, name)
        return module

    with torch.no_grad():
        for path, weight in (
            (parts.query, 0.0),
            (parts.key, 0.0),
            (parts.value, 1.0),
            (parts.attention_out, MEAN_SCALE),
            (parts.ffn_in, 0.0),
            (parts.ffn_out, 0.0),
        ):
            linear = part(path)
            linear.weight.copy_(weight * torch.eye(linear.out_features, linear.in_features))
            if linear.bias is not None:
                linear.bias.zero_()
        for path in (parts.attention_norm, parts.output_norm):
            part(path).weight.fill_(1.0)
            part(path).bias.zero_()
    for p in layer.parameters():
        p.requires_grad_(False)
    if hasattr(layer, "layer_idx"):
        layer.layer_idx = len(layers)
    layers.append(layer)
    model.config.num_hidden_layers = len(layers)
    setattr(model.config, MARKER, True)
    head = getattr(model, "classifier", None)
    dense = getattr(head, "dense", None)  # MPNet's head: dense + tanh on the first token, no pretrained pooler
    if kind == "mpnet" and isinstance(dense, torch.nn.Linear) and dense.in_features == dense.out_features:
        torch.nn.init.eye_(dense.weight)
        torch.nn.init.zeros_(dense.bias)
    return (
        f"model.pooling=mean: a frozen layer appended to the encoder ({len(layers)} layers) reads the mean of the "
        "token states into the first position, which the classifier reads"
    )
