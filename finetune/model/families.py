"""What a model family leaves to the caller: the pooler's starting point (`start_pooler`) and gradient
checkpointing where transformers has none for the family (`enable_checkpointing`: MPNet).

A sentence-transformers checkpoint (all-MiniLM-L6-v2, all-mpnet-base-v2) was trained through mean pooling:
a BERT-style pooler it carries was never trained, and MPNet's classification model has no pooler at all.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from finetune.core.errors import UserError


def pooler_dense(model: PreTrainedModel) -> torch.nn.Linear | None:
    """The pooler's square dense layer (BERT-family: tanh(W h_CLS + b) feeds the classifier), else None."""
    dense = getattr(getattr(getattr(model, model.base_model_prefix, None), "pooler", None), "dense", None)
    square = isinstance(dense, torch.nn.Linear) and dense.in_features == dense.out_features
    return dense if square else None


def is_sentence_transformers(folder: str | None) -> bool:
    """Whether `folder` (a resolved model path) holds a sentence-transformers checkpoint (its modules.json)."""
    return folder is not None and (Path(folder) / "modules.json").is_file()


def start_pooler(model: PreTrainedModel, how: str, folder: str | None) -> bool:
    """The pooler as `model.pooler_init` says: identity sets its dense layer to W = I, b = 0 (the classifier
    then reads tanh of the CLS state at full scale); auto does so where a pooler exists and `folder` is a
    sentence-transformers checkpoint, and nothing otherwise; checkpoint leaves it. Returns whether it was set.

    Raises:
        UserError: identity on a model without a square pooler dense layer (only BERT-family encoders have one).
    """
    dense = pooler_dense(model)
    if how == "checkpoint" or (how == "auto" and (dense is None or not is_sentence_transformers(folder))):
        return False
    if dense is None:
        raise UserError(
            f"model.pooler_init=identity: {type(model).__name__} has no pooler dense layer to set (auto: the "
            "identity only where one exists)"
        )
    torch.nn.init.eye_(dense.weight)
    torch.nn.init.zeros_(dense.bias)
    return True


def identity_pooler(model: PreTrainedModel) -> None:
    """The pooler's dense layer at W = I, b = 0.

    Raises:
        UserError: the model has no square pooler dense layer.
    """
    start_pooler(model, "identity", None)


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant gradient checkpointing (works with frozen inputs and under torch.compile): transformers'
    own where the family supports it, else each block of the encoder (`<base>.encoder.layer`: MPNet)
    recomputed through torch.utils.checkpoint.

    Raises:
        UserError: the family supports neither.
    """
    if model.supports_gradient_checkpointing:
        # transformers 5 renamed the method (the old name prints a FutureWarning on every run)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        blocks = getattr(getattr(model.base_model, "encoder", None), "layer", None)
        if not isinstance(blocks, torch.nn.ModuleList):
            raise UserError(
                f"model.gradient_checkpointing: {type(model).__name__} supports no gradient checkpointing; set "
                "model.gradient_checkpointing=false"
            )
        for block in blocks:  # an instance attribute: the state_dict keys and the saved model stay stock
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    model.config.use_cache = False
