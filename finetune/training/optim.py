"""Optimizers, learning-rate schedule and gradient clipping.

Both the training loop and the memory planner build their optimizer here, so a plan measures the
optimizer state training will hold. The batch arithmetic (micro-batch x accumulation x processes)
is `finetune.data.window`'s.
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType
from torch.optim.lr_scheduler import LambdaLR
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from finetune.config.schema import Config
from finetune.core.errors import UserError
from finetune.model.load import classifier_of, head_names, layer_index
from finetune.model.precision import Bf16AdamW, refuse_adamw8bit_off_cuda

# process layouts where every process holds whole parameters and gradients (no FSDP/DeepSpeed sharding)
_WHOLE_GRADIENTS = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def build_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW (or SGD) over `parameter_groups`: no weight decay on biases and norm weights.

    Plain SGD makes the update proportional to the gradient, which is what tests of exact
    accumulation compare; AdamW's update is nearly invariant to the gradient's scale.
    """
    groups = parameter_groups(cfg, model)
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.learning_rate, momentum=t.momentum)
    if t.optimizer == "adafactor":
        # factored second moment, no first moment (beta1=None): state ~ rows + columns per matrix;
        # a fixed learning rate (no relative step / parameter scaling) so the scheduler drives it
        from transformers.optimization import Adafactor  # imports peft: only when chosen (start-up time)

        return Adafactor(groups, lr=t.learning_rate, scale_parameter=False, relative_step=False, warmup_init=False)
    if t.optimizer == "adamw8bit":
        return build_adamw8bit(cfg, groups)
    if cfg.precision.mode == "bf16-true":  # bf16 weights: an update that keeps small steps (precision.bf16_update)
        return Bf16AdamW(
            groups,
            lr=t.learning_rate,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_epsilon,
            update=cfg.precision.bf16_update,
        )
    return torch.optim.AdamW(
        groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon, fused=_fused_adamw_ok(cfg)
    )


def parameter_groups(cfg: Config, model: torch.nn.Module) -> list[dict[str, Any]]:
    """Trainable parameters in groups of one learning rate and weight decay each, top first.

    Weight decay skips biases and norm weights (every parameter with ndim < 2). Without recipes
    that is two groups at `train.learning_rate`. `train.head_learning_rate` gives the head its own
    rate; `train.layer_lr_decay` d < 1 gives numbered block i of L the rate lr x d^(L - i) and the
    embeddings lr x d^(L + 1), while the head and what sits above the blocks (final norm, pooler)
    keep lr (the ULMFiT / ELECTRA recipe). Each group has a `name` for the log.

    Raises:
        UserError: train.layer_lr_decay < 1 on a model without numbered layers.
    """
    t = cfg.train
    hf = classifier_of(model)
    heads = set(head_names(hf))
    named = [(n, p) for n, p in hf.named_parameters() if p.requires_grad]
    depth = {n: layer_index(n) for n, _ in named}
    layers = max((d for d in depth.values() if d is not None), default=-1) + 1
    if t.layer_lr_decay < 1 and layers == 0:
        raise UserError(f"train.layer_lr_decay needs numbered layers; {type(hf).__name__} has none: remove it")

    def place(name: str) -> tuple[str, float]:
        if name.split(".")[0] in heads:
            return "head", t.head_learning_rate or t.learning_rate
        index = depth[name]
        if index is not None:
            return f"layer {index}", t.learning_rate * t.layer_lr_decay ** (layers - index)
        if "embed" in name:
            return "embeddings", t.learning_rate * t.layer_lr_decay ** (layers + 1)
        return "top", t.learning_rate  # final norm, pooler: above the last block

    groups: dict[tuple[str, bool], dict[str, Any]] = {}
    for name, param in named:
        where, lr = place(name) if (t.layer_lr_decay < 1 or t.head_learning_rate) else ("all", t.learning_rate)
        decay = param.ndim >= 2
        group = groups.setdefault(
            (where, decay), {"params": [], "lr": lr, "name": where, "weight_decay": t.weight_decay if decay else 0.0}
        )
        group["params"].append(param)
    # the head or top first (the logged lr is the first group's), decayed parameters before the rest
    return [g for (_, decay), g in sorted(groups.items(), key=lambda kv: (-kv[1]["lr"], not kv[0][1]))]


def describe_groups(optimizer: torch.optim.Optimizer) -> str | None:
    """`learning rates: head 1.0e-03, top 1.0e-04, layer 5 8.0e-05, ...` when the recipes split them."""
    rates = {g["name"]: g.get("initial_lr", g["lr"]) for g in optimizer.param_groups if "name" in g}  # peak, not warmup
    if set(rates) <= {"all"}:
        return None
    return "learning rates: " + ", ".join(f"{name} {lr:.1e}" for name, lr in rates.items())


def _fused_adamw_ok(cfg: Config) -> bool:
    """Use torch's fused AdamW kernel: the same update, ~8x cheaper than the default per-parameter
    loop on CPU (MiniLM: 13 vs 105 ms a step, one thread); Trainer's default too. Not with fp16
    (the GradScaler hands a fused step its skip flag, which hides skipped steps from Accelerate)
    nor under FSDP/DeepSpeed, which wrap or shard the parameters themselves."""
    state = PartialState()
    return (
        cfg.precision.mode in ("fp32", "bf16")
        and state.distributed_type in _WHOLE_GRADIENTS
        and state.device.type in _get_fused_kernels_supported_devices()
    )


def clipping_folds_into_step(optimizer: torch.optim.Optimizer, accelerator: Accelerator) -> bool:
    """Whether `fold_clipping_into_step` applies: torch's fused AdamW, no fp16 grad scaler (which
    owns `grad_scale`), gradients whole on each process (no FSDP/DeepSpeed sharding)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return (
        isinstance(inner, torch.optim.AdamW)
        and bool(inner.defaults.get("fused"))
        and accelerator.scaler is None
        and accelerator.distributed_type in _WHOLE_GRADIENTS
    )


def fold_clipping_into_step(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float
) -> torch.Tensor:
    """Clip by global norm inside fused AdamW's kernel; return the norm before clipping.

    `clip_grad_norm_` multiplies every gradient by min(1, max_norm / (norm + 1e-6)) in a pass of
    its own; fused AdamW already reads every gradient and divides it by `grad_scale` (the hook
    GradScaler uses), so setting grad_scale = max(1, (norm + 1e-6) / max_norm) gives the same
    update with one pass over the gradients fewer (2.6 of ~200 ms a step on MiniLM, CPU).
    """
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    inner = getattr(optimizer, "optimizer", optimizer)
    inner.grad_scale = torch.clamp(norm + 1e-6, min=max_norm) / max_norm  # type: ignore[attr-defined]
    return norm


def build_adamw8bit(cfg: Config, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """bitsandbytes' 8-bit AdamW (block-quantized moments): CUDA only, bitsandbytes optional.

    Raises:
        UserError: no CUDA GPU, or bitsandbytes is not installed.
    """
    t = cfg.train
    on_cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    refuse_adamw8bit_off_cuda(t.optimizer, "cpu" if on_cpu else "cuda")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError("train.optimizer=adamw8bit needs bitsandbytes: pip install bitsandbytes") from None
    return bnb.optim.AdamW8bit(groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon)


def planned_steps(cfg: Config, windows_per_epoch: int) -> tuple[int, int]:
    """(total optimizer steps, epochs to iterate): whichever of epochs and max_steps ends first."""
    total = math.ceil(cfg.train.epochs * windows_per_epoch)
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    return total, math.ceil(total / windows_per_epoch)


def lr_factor(step: int, *, warmup: int, total: int, shape: str) -> float:
    """The learning-rate multiplier at optimizer step `step`: linear warmup, then `shape` decay.

    The formulas of transformers' `get_scheduler` (linear, cosine with half a cycle,
    constant_with_warmup), on torch's LambdaLR: `transformers.optimization` imports peft whenever it
    is installed, which a run without LoRA should not pay for at start-up.
    """
    if step < warmup:
        return step / max(1, warmup)
    if shape == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if shape == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return max(0.0, 1.0 - progress)


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    """Warmup then linear/cosine/constant decay, counted in optimizer steps."""
    t = cfg.train
    warmup = t.warmup_steps if t.warmup_steps is not None else round(t.warmup_ratio * total_steps)
    return LambdaLR(optimizer, partial(lr_factor, warmup=warmup, total=total_steps, shape=t.lr_scheduler))
