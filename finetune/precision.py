"""Precision policy: which Accelerate mixed-precision mode a config maps to, and the fp32 loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.errors import UserError


def accelerate_mixed_precision(mode: str) -> str:
    """Accelerate's `mixed_precision` for a `precision.mode` (bf16-true runs without autocast)."""
    return {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "bf16-true": "no"}[mode]


def check_supported(mode: str, device: torch.device) -> None:
    """Refuse combinations Accelerate would silently ignore or the hardware cannot run."""
    if mode == "fp16" and device.type == "cpu":
        raise UserError("precision.mode=fp16 needs a CUDA GPU (Accelerate silently ignores it on CPU); use bf16 or fp32")
    if mode in ("bf16", "bf16-true") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"precision.mode={mode}: this GPU has no bf16 support; use fp16 or fp32")


def fp32_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy computed in fp32 from upcast logits (F.cross_entropy has no dtype=)."""
    return F.cross_entropy(logits.float(), labels, reduction="none")
