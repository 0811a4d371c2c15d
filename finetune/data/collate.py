"""A batch from tokenized items: dynamic padding, plus the bookkeeping fields the loss and evaluation
read (labels, the window's sample count and per-sample weights stamped by `window.WindowedBatchSampler`,
the text a long text's window belongs to). `packing.PackingCollator` builds packed rows on top of it.
"""

from __future__ import annotations

from typing import Any

import torch


class Collator:
    """Dynamic padding plus the bookkeeping fields (labels, weights, window size, token counts)."""

    MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        keys = [k for k in self.MODEL_KEYS if k in features[0]]
        if "attention_mask" not in keys:  # the tokenizer knows whether its model takes a mask
            model_feats = [{k: f[k] for k in keys} for f in features]
            return self.add_bookkeeping(dict(self.tokenizer.pad(model_feats, return_tensors="pt")), features)
        return self.add_bookkeeping(self.pad(features, keys), features)

    def pad(self, features: list[dict[str, Any]], keys: list[str]) -> dict[str, torch.Tensor]:
        """`tokenizer.pad` for rows that carry their attention mask, in one list pass per key: the
        tokenizer's own pad walks each row through its Python checks, a host cost every micro-batch pays."""
        longest = max(len(f["input_ids"]) for f in features)
        fill = {
            "input_ids": self.tokenizer.pad_token_id or 0,
            "attention_mask": 0,
            "token_type_ids": self.tokenizer.pad_token_type_id,
        }
        left = self.tokenizer.padding_side == "left"
        batch = {}
        for key in keys:
            pad = [fill[key]]
            rows = [
                pad * (longest - len(f[key])) + list(f[key]) if left else list(f[key]) + pad * (longest - len(f[key]))
                for f in features
            ]
            batch[key] = torch.tensor(rows, dtype=torch.long)
        return batch

    @staticmethod
    def add_bookkeeping(batch: dict[str, torch.Tensor], features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Labels, and for training items the window size, per-sample weights and a distilling run's teacher
        logits and gold flags."""
        if "labels" in features[0]:  # ids: int64; multi-hot rows and regression scores: float32
            labels = torch.tensor([f["labels"] for f in features])
            batch["labels"] = labels.float() if labels.is_floating_point() else labels
        if "doc" in features[0]:  # chunked texts: evaluation aggregates the windows of each text
            batch["doc"] = torch.tensor([f["doc"] for f in features], dtype=torch.long)
        if "teacher_logits" in features[0]:  # distillation: the teacher's outputs and whether the label counts
            batch["teacher_logits"] = torch.tensor([f["teacher_logits"] for f in features], dtype=torch.float32)
            batch["gold"] = torch.tensor([f["gold"] for f in features], dtype=torch.float32)
        if "window_samples" in features[0]:
            batch["window_samples"] = torch.tensor(features[0]["window_samples"], dtype=torch.float32)
            batch["sample_weight"] = torch.tensor([f["sample_weight"] for f in features], dtype=torch.float32)
        return batch
