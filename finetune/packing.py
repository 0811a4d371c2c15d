"""The model side of packed training batches (`data.packing`): several sequences per row, block-diagonal
attention, each sequence pooled at its own first token. The batching side (rows packed, `segment_ids`) is
`finetune.data`'s `PackingCollator`.
"""

from __future__ import annotations

from typing import Any

import torch

from finetune.errors import UserError
from finetune.model import classifier_of

# The module whose input is the whole sequence output and which reads its first token, per model
# type; a forward pre-hook hands it the first token of every packed sequence instead.
PACKED_POOLING = {
    "bert": "base_model.pooler",
    "roberta": "classifier",
    "xlm-roberta": "classifier",
    "electra": "classifier",
}
# position embeddings of these start at padding_idx + 1
POSITIONS_AFTER_PAD = ("roberta", "xlm-roberta")


def check_packing(model: torch.nn.Module) -> None:
    """Refuse `data.packing` for models whose pooling or attention the packed path does not cover.

    Raises:
        UserError: the model family does not support packing.
    """
    hf = classifier_of(model)
    kind = hf.config.model_type
    if kind not in PACKED_POOLING:
        raise UserError(
            f"data.packing supports model types {sorted(PACKED_POOLING)}; this model is {kind!r}: set "
            "data.packing=false"
        )
    if hf.config.model_type == "bert" and getattr(hf.base_model, "pooler", None) is None:
        raise UserError("data.packing needs the BERT pooler (the classifier reads it): set data.packing=false")
    impl = getattr(hf.config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise UserError(f"data.packing works with sdpa or eager attention, not {impl!r}: set data.packing=false")


def attention_cost(model: torch.nn.Module) -> float:
    """Attention work per token per unit of row length, relative to the linear layers' per token:
    4·hidden·L against 2·(4·hidden² + 2·hidden·intermediate) FLOPs per layer = L / (2·hidden + intermediate)."""
    cfg = classifier_of(model).config
    hidden = getattr(cfg, "hidden_size", 0) or 0
    inter = getattr(cfg, "intermediate_size", 4 * hidden) or 4 * hidden
    return 1.0 / (2 * hidden + inter) if hidden else 0.0


def packed_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits (one row per sequence, in sample order) of a `PackingCollator` batch.

    Tokens attend only within their own sequence (padding attends to padding, so no softmax row is
    empty), positions restart per sequence, and the pooling module sees each sequence's first
    token: in eval mode the logits equal the unpacked ones up to rounding (tests/test_packing.py).
    The call goes through `model` itself, so DDP, autocast and peft wrappers all apply.
    """
    hf = classifier_of(model)
    segments = batch["segment_ids"]
    mask = segments[:, None, :, None] == segments[:, None, None, :]  # (rows, 1, C, C), True = attend
    if (getattr(hf.config, "_attn_implementation", None) or "eager") == "eager":
        dtype = hf.get_input_embeddings().weight.dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    positions = batch["position_ids"]
    if hf.config.model_type in POSITIONS_AFTER_PAD:
        positions = positions + hf.config.pad_token_id + 1
    cls_index = batch["cls_index"]
    pooling = hf.get_submodule(PACKED_POOLING[hf.config.model_type])

    def first_tokens(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        return (hidden.flatten(0, 1).index_select(0, cls_index).unsqueeze(1), *args[1:])

    handle = pooling.register_forward_pre_hook(first_tokens)
    try:
        return model(
            input_ids=batch["input_ids"],
            token_type_ids=batch["token_type_ids"],
            position_ids=positions,
            attention_mask=mask,
        ).logits
    finally:
        handle.remove()
