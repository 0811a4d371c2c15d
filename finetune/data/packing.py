"""Packed training batches (`data.packing`), both sides in one place: the batching side places several
sequences per row (`pack_rows`) and builds the batch with `segment_ids` (`PackingCollator`); the model
side masks attention block-diagonally and pools each sequence at its own first token (`packed_logits`).
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from finetune.core.errors import UserError
from finetune.data.collate import Collator
from finetune.model.load import classifier_of

# The module whose input is the whole sequence output and which reads its first token, per model
# type; a forward pre-hook hands it the first token of every packed sequence instead.
PACKED_POOLING = {
    "bert": "base_model.pooler",
    "roberta": "classifier",
    "xlm-roberta": "classifier",
    "electra": "classifier",
    "mpnet": "classifier",  # its relative attention bias depends on j - i only: unchanged within a packed sequence
}
# position embeddings of these start at padding_idx + 1
POSITIONS_AFTER_PAD = ("roberta", "xlm-roberta", "mpnet")


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


def pack_rows(lengths: list[int], max_length: int, attention_cost: float) -> tuple[int, list[tuple[int, int]]]:
    """Place sequences of `lengths` into rows: (row width, [(row, offset)] per sequence).

    For each candidate row count R (from the fewest rows that `max_length` allows up to one row
    per sequence, ~k sequences per row for each k), sequences go longest first into the currently
    emptiest row, which balances
    the rows; the width W is the fullest row. The R minimising the modelled cost
    R x W x (1 + attention_cost x W) wins: the per-token work of the linear layers is fixed, the
    attention's grows with the row width, so packing short sequences into long rows is not free
    (`attention_cost` = 1 / (2 hidden + intermediate) for a Transformer encoder layer). Rows
    never exceed max(max_length, longest sequence).
    """
    n = len(lengths)
    order = sorted(range(n), key=lambda i: -lengths[i])
    cap = max(max_length, max(lengths))
    fewest = max(1, -(-sum(lengths) // cap))
    # about k sequences per row for every k: O(sqrt(n)) candidates keep large micro-batches cheap
    candidates = sorted({max(fewest, -(-n // k)) for k in range(1, n + 1)})
    best: tuple[float, int, list[tuple[int, int]]] | None = None
    for rows in candidates:
        heap = [(0, r) for r in range(rows)]  # (fill, row): the emptiest row on top
        place: list[tuple[int, int]] = [(0, 0)] * n
        for i in order:
            filled, row = heapq.heappop(heap)
            if filled + lengths[i] > cap:
                break  # does not fit in this many rows
            place[i] = (row, filled)
            heapq.heappush(heap, (filled + lengths[i], row))
        else:
            fill = [f for f, _ in heap]
            if min(fill) == 0:
                continue  # an empty row: fewer rows do the same
            width = max(fill)
            cost = rows * width * (1.0 + attention_cost * width)
            if best is None or cost < best[0]:
                best = (cost, width, place)
    assert best is not None  # rows = len(lengths) always fits
    return best[1], best[2]


class PackingCollator(Collator):
    """Training batches with several sequences per row and block-diagonal attention.

    Output: `input_ids`, `token_type_ids`, `position_ids` (restarting at 0 for every sequence)
    and `segment_ids` (1.. per sequence in its row, 0 on padding) of shape (rows, C); `cls_index`
    (one flat index into rows x C per sequence, in sample order, where its first token sits);
    `sequence_lengths`; labels, weights and window size per sequence as in `Collator`. The model
    side (`finetune.data.packing.packed_logits`) turns `segment_ids` into the attention mask and pools
    at `cls_index`, so the logits equal those of the unpacked sequences.
    """

    def __init__(self, tokenizer: Any, max_length: int, attention_cost: float) -> None:
        super().__init__(tokenizer)
        self.max_length = max_length
        self.attention_cost = attention_cost

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = [len(f["input_ids"]) for f in features]
        capacity, place = pack_rows(lengths, self.max_length, self.attention_cost)
        rows = 1 + max(r for r, _ in place)
        input_ids = torch.full((rows, capacity), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        token_type_ids = torch.zeros((rows, capacity), dtype=torch.long)
        position_ids = torch.zeros((rows, capacity), dtype=torch.long)
        segment_ids = torch.zeros((rows, capacity), dtype=torch.long)
        segments_in_row = [0] * rows
        cls_index = []
        for f, n, (row, offset) in zip(features, lengths, place, strict=True):
            segments_in_row[row] += 1
            input_ids[row, offset : offset + n] = torch.tensor(f["input_ids"])
            if "token_type_ids" in f:
                token_type_ids[row, offset : offset + n] = torch.tensor(f["token_type_ids"])
            position_ids[row, offset : offset + n] = torch.arange(n)
            segment_ids[row, offset : offset + n] = segments_in_row[row]
            cls_index.append(row * capacity + offset)
        batch = {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "position_ids": position_ids,
            "segment_ids": segment_ids,
            "cls_index": torch.tensor(cls_index),
            "sequence_lengths": torch.tensor(lengths),
        }
        return self.add_bookkeeping(batch, features)
