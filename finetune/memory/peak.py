"""One training window's peak memory, measured: the categories reported (parameters, gradients,
optimizer state, activations, temporaries, cuBLAS workspace), the CUDA margin, and the harness the
planner runs on fake tensors (`measure_window` through MemTracker's global peak), with stand-ins for
what fake tensors cannot run (bitsandbytes' quantized layers, its 8-bit Adam).

`finetune.memory.planner` builds the model and batches and turns a `Measurement` into a plan.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

from finetune.memory.monitor import PeakTracker
from finetune.model.load import classifier_of, head_names
from finetune.model.precision import fp32_cross_entropy, within

GiB = 1 << 30
MiB = 1 << 20

# The categories reported (MemTracker's buffers go with parameters, and its "other" - the
# input batch - with activations).
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "cublas_workspace")
_CATEGORY_OF = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.BUFFER: "parameters",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer_state",
    _MemRefType.ACT: "activations",
    _MemRefType.OTH: "activations",
    _MemRefType.TEMP: "temporaries",
}

# Planning for CUDA adds what the tensor count does not see: the CUDA context (driver, cuBLAS and
# kernel images: 300-500 MiB on recent GPUs, outside `max_memory_allocated`) and the caching
# allocator's rounding and fragmentation (blocks rounded to 512 B / 2 MiB segments; reserved
# exceeds allocated by roughly 5-15% in training). CPU plans get no margin.
CUDA_CONTEXT_BYTES = 512 * MiB
CPU_AUTOCAST_NOTE = "; CPU autocast semantics (CUDA autocast also keeps softmax/layer_norm in fp32)"
CUDA_ALLOCATOR_FRACTION = 0.10


def cublas_workspace_bytes() -> int:
    """cuBLAS workspace torch allocates through the caching allocator (so `max_memory_allocated`
    counts it), one per (handle, stream); the forward and the autograd engine's backward thread
    use different handles, so a training step holds two. Size: CUBLAS_WORKSPACE_CONFIG when set,
    else torch's default, 32 MiB on Hopper and newer (sm >= 9.0) and 8 MiB + 128 KiB before; a
    CPU planning for CUDA assumes the larger."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if pairs:
            return sum(int(size) * int(count) for size, count in pairs) * 1024 * 2
    hopper = not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 9
    return 2 * (32 * MiB if hopper else 4096 * 1024 * 2 + 16 * 1024 * 8)


@contextlib.contextmanager
def cuda_attention_for_planning() -> Any:
    """Plan attention as CUDA runs it: `scaled_dot_product_attention` on CUDA dispatches to the
    flash / memory-efficient kernels, which keep the output and a log-sum-exp per row for the
    backward but neither the L x L probabilities nor a dropout mask (the CPU kernels keep both:
    the 39-52% over-prediction docs/MEMORY.md measured on an H200). The memory-efficient op has
    fake-tensor support on a CPU-only build, so the planner calls it directly."""
    real = torch.nn.functional.scaled_dot_product_attention

    def efficient(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            repeat = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:  # as SDPA converts a boolean mask
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(~bias, float("-inf"))
        elif bias is not None:
            bias = bias.to(query.dtype)
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale
        )[0]

    torch.nn.functional.scaled_dot_product_attention = efficient
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


def margin_bytes(peak_bytes: int, device: str) -> int:
    """Bytes added to a predicted peak for the CUDA context and allocator rounding (0 on CPU)."""
    if device != "cuda":
        return 0
    return CUDA_CONTEXT_BYTES + int(CUDA_ALLOCATOR_FRACTION * peak_bytes)


# ----------------------------------------------------------------------------------------------
# Measuring one window.


@dataclass
class Measurement:
    """Peak bytes of one optimizer window and its split by category (at the moment of the peak), and
    each phase's own peak split alike (`PHASES`): the window's peak is the largest, and which one it
    is can change with the depth (a shallow model can peak in its optimizer step or below its layers)."""

    peak_bytes: int
    categories: dict[str, int]
    phases: dict[str, dict[str, int]] = field(default_factory=dict)


# the forward and the backward through the layer stack; the backward below it; clip and optimizer step
PHASES = ("layers", "embeddings", "step")


def autocast_context(mode: str, device_type: str = "cpu") -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The forward's autocast as Accelerate sets it up for `precision.mode` (CPU semantics by default)."""
    if mode in ("bf16", "fp16"):
        dtype = torch.bfloat16 if mode == "bf16" else torch.float16
        return lambda: torch.autocast(device_type, dtype=dtype)
    return contextlib.nullcontext


def train_micro_step(
    model: nn.Module, batch: dict[str, torch.Tensor], autocast: Callable[[], Any], scale: float
) -> None:
    """Forward (under autocast), fp32 loss from upcast logits, backward: the loop's micro-step."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with autocast():
        logits = model(**inputs).logits
    loss = fp32_cross_entropy(logits, labels).sum() * scale
    loss.backward()


def train_window(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[dict[str, torch.Tensor]],
    autocast: Callable[[], Any],
    max_grad_norm: float | None,
    tracker: MemTracker | None = None,
) -> None:
    """One accumulation window: micro-steps, clip, optimizer step, zero_grad(set_to_none)."""
    total = sum(int(b["labels"].shape[0]) for b in batches)
    for batch in batches:
        if tracker is not None:
            tracker.reset_mod_stats()  # MemTracker refuses a second root forward otherwise
        train_micro_step(model, batch, autocast, 1.0 / total)
    step_and_zero(model, optimizer, max_grad_norm)


def step_and_zero(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> None:
    """The end of a window: clip, optimizer step, zero_grad(set_to_none)."""
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_window(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[], dict[str, torch.Tensor]],
    accumulation: int,
    mode: str,
    max_grad_norm: float | None,
    device: str = "cpu",
) -> Measurement:
    """Peak memory of the SECOND optimizer window (the first creates the optimizer state).

    `device="cuda"` on fake tensors: attention as CUDA's kernels keep it, plus the cuBLAS
    workspaces (`cuda_attention_for_planning`, `cublas_workspace_bytes`).

    A window of G >= 2 micro-steps peaks like one of 2: from the second micro-step on, the
    gradients exist for the whole forward and backward. So at most 2 micro-steps are run.
    Works on real and on fake tensors alike (make_batch creates the batch in the active mode).
    Each phase of `PHASES` keeps its own peak (`Measurement.phases`).
    """
    micro_steps = min(accumulation, 2)
    autocast = autocast_context(mode)
    model.train()
    kernels = cuda_attention_for_planning() if device == "cuda" else contextlib.nullcontext()
    with kernels:
        # the first window only creates the optimizer state: one micro-step does
        train_window(model, optimizer, [make_batch()], autocast, max_grad_norm)
        tracker = PeakTracker()
        tracker.track_external(model, optimizer)
        phases = PhasePeaks(tracker)
        with tracker, below_the_layers(model, phases):
            batches = [make_batch() for _ in range(micro_steps)]
            total = sum(int(b["labels"].shape[0]) for b in batches)
            for batch in batches:
                tracker.reset_mod_stats()  # MemTracker refuses a second root forward otherwise
                phases.enter("layers")
                train_micro_step(model, batch, autocast, 1.0 / total)
            phases.enter("step")
            step_and_zero(model, optimizer, max_grad_norm)
            phases.enter(None)
    workspace = cublas_workspace_bytes() if device == "cuda" else 0
    split = {name: by_category(phases.peaks.get(name, {}), workspace) for name in PHASES}
    categories = max(split.values(), key=lambda c: sum(c.values()))
    return Measurement(sum(categories.values()), dict(categories), split)


class PhasePeaks:
    """The peak of each phase of a window under a MemTracker, a phase made of one or more stretches
    of time (one per micro-step): entering a phase keeps the peak of the stretch that ends and
    starts the next stretch's peak from the memory held then, as MemTracker does on `__enter__`."""

    def __init__(self, tracker: MemTracker) -> None:
        self.tracker = tracker
        self.current: str | None = None
        self.peaks: dict[str, dict[Any, dict[str, int]]] = {}

    def enter(self, phase: str | None) -> None:
        """End the current stretch and start one of `phase` (None: the last stretch ends)."""
        if self.current is not None:
            kept = self.peaks.setdefault(self.current, {})
            for dev, snap in self.tracker.get_tracker_snapshot("peak").items():
                if snap.get(_TOTAL_KEY, 0) > kept.get(dev, {}).get(_TOTAL_KEY, 0):
                    kept[dev] = snap
        now = self.tracker.get_tracker_snapshot()
        # MemTracker's own reset of its peak (its __enter__), done between two ops
        self.tracker._peak_mem_snap = now
        self.tracker._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in now.items()}
        self.current = phase


@contextlib.contextmanager
def below_the_layers(model: nn.Module, phases: PhasePeaks) -> Any:
    """Enter the phase "embeddings" when the backward has gone through the layer stack (the longest
    `nn.ModuleList`): a gradient hook on the first block's input. Below it the backward allocates what
    no layer count changes (the input embeddings' dense gradient), so its peak is a phase of its own."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists or not len(max(lists, key=len)):
        yield
        return

    def on_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad and torch.is_grad_enabled():
            hidden.register_hook(lambda grad: phases.enter("embeddings"))

    handle = max(lists, key=len)[0].register_forward_pre_hook(on_input, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def by_category(snap: dict[Any, dict[str, int]], workspace: int) -> dict[str, int]:
    """A MemTracker snapshot's bytes by reported category, summed over devices (plus the cuBLAS workspace)."""
    categories = dict.fromkeys(CATEGORIES, 0)
    for dev_snap in snap.values():
        for reftype, nbytes in dev_snap.items():
            if reftype in _CATEGORY_OF:
                categories[_CATEGORY_OF[reftype]] += int(nbytes)
    categories["cublas_workspace"] = workspace
    return categories


# ----------------------------------------------------------------------------------------------
# Fake tensors and stand-ins.


def to_fake(model: nn.Module, fake_mode: FakeTensorMode) -> nn.Module:
    """Replace every parameter and buffer by a fake tensor in place (shared tensors stay shared).

    Building the real model first and converting it is how adapters (peft) and checkpointing
    hooks survive: peft cannot create its layers under FakeTensorMode.
    """
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:  # an empty model's parameter: a fake CPU tensor of its shape and dtype
            with fake_mode:
                return torch.empty(t.shape, dtype=t.dtype)
        return fake_mode.from_tensor(t)

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(fake(p.detach()), requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]  # type: ignore[assignment]
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = fake(b)
            module._buffers[name] = memo[id(b)]
    return model


class _QuantMatmul(torch.autograd.Function):
    """bitsandbytes' matmul on a quantized weight, as memory: the weight is dequantized into a
    temporary for the forward and again for the input gradient (4-bit: `MatMul4Bit`, bf16 compute,
    nothing saved but the weight; 8-bit: `MatMul8bitFp` on CPU, `MatMul8bitLt` on CUDA, input dtype, the input
    kept as a ctx attribute)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, shape: tuple[int, int], dtype: Any, save_input: bool
    ) -> torch.Tensor:
        ctx.shape, ctx.dtype, ctx.x_dtype = shape, dtype, x.dtype
        if save_input:
            # an attribute, not save_for_backward, as MatMul8bitFp does (`ctx.A = A`): autograd frees saved
            # tensors as each node's backward runs, but an attribute lives until the graph is dropped
            ctx.x = x
        w = torch.zeros(shape, dtype=dtype or x.dtype, device=x.device)
        return torch.nn.functional.linear(x.to(w.dtype), w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        w = torch.zeros(ctx.shape, dtype=ctx.dtype or ctx.x_dtype, device=grad.device)
        return (grad.to(w.dtype) @ w).to(ctx.x_dtype), None, None, None, None


class QuantizedLinearStandIn(nn.Module):
    """Memory stand-in for bitsandbytes' `Linear4bit` (NF4, double quantization: two 4-bit values
    per uint8, one uint8 absmax per 64 weights plus an fp32 one per 256 of those) and `Linear8bitLt`
    (int8 weight, one fp32 scale per output row). Planning only: it computes zeros."""

    def __init__(self, linear: nn.Linear, kind: str) -> None:
        super().__init__()
        out_f, in_f = linear.weight.shape
        n, dev = out_f * in_f, linear.weight.device
        self.kind, self.shape = kind, (out_f, in_f)
        if kind == "4bit":
            self.weight = nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device=dev), requires_grad=False)
            self.register_buffer("absmax", torch.empty(math.ceil(n / 64), dtype=torch.uint8, device=dev))
            self.register_buffer("absmax2", torch.empty(math.ceil(n / 64 / 256), dtype=torch.float32, device=dev))
        else:
            self.weight = nn.Parameter(torch.empty(out_f, in_f, dtype=torch.int8, device=dev), requires_grad=False)
            self.register_buffer("scale", torch.empty(out_f, dtype=torch.float32, device=dev))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        four = self.kind == "4bit"
        y = _QuantMatmul.apply(x, self.weight, self.shape, torch.bfloat16 if four else None, not four)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        # Linear4bit casts its output back to the input's dtype; Linear8bitLt returns what its matmul
        # gave (bf16 under autocast)
        return y.to(x.dtype) if four else y


def quantize_for_planning(model: nn.Module, kind: str) -> int:
    """Swap the base's `nn.Linear` layers (LoRA's base layers included; the head, which
    `load_quantized` keeps, and the adapters excluded) for `QuantizedLinearStandIn`; returns how many."""
    hf = classifier_of(model)
    heads = head_names(hf)
    swapped = 0
    for name, module in list(hf.named_modules()):
        if within(name, heads):
            continue
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and not within(full, heads) and ".lora_" not in f".{full}":
                setattr(module, child_name, QuantizedLinearStandIn(child, kind))
                swapped += 1
    return swapped


class Adam8bitStandIn(torch.optim.Optimizer):
    """Memory stand-in for bitsandbytes AdamW8bit (for planning only: it updates nothing).

    Its state has bitsandbytes' layout: tensors of >= 4,096 elements keep both moments in uint8
    with one fp32 absmax per 256-element block each; smaller ones keep fp32 moments. The step
    allocates an fp32 temporary of one tensor's size (bitsandbytes dequantizes blockwise in
    its kernel; this is an upper bound on its workspace).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: D102
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    if p.numel() >= 4096:
                        blocks = math.ceil(p.numel() / 256)
                        st["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    else:
                        st["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        st["state2"] = torch.zeros_like(p, dtype=torch.float32)
                tmp = p.grad.float()
                del tmp
