"""Precision policy: modes, fp32 norms, fp32 loss, bf16 optimizer updates, dtype audit,
non-finite handling and torch.compile.

Modes (`precision.mode`):
- `fp32`: everything fp32.
- `fp16` / `bf16`: Accelerate mixed precision (fp32 master weights, autocast around the model's
  forward, a GradScaler for fp16).
- `bf16-true`: weights, gradients and optimizer state in bf16, no autocast. What that breaks
  is fixed here explicitly: norm modules are kept in fp32 (`apply_precision_policy`), the loss
  is computed from fp32 logits (`fp32_cross_entropy`), and the optimizer does not round small
  updates away (`Bf16AdamW` with Kahan compensation or stochastic rounding).

See docs/PRECISION.md for why each fix exists and how it was measured.
"""

from __future__ import annotations

import json
import logging
import math
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from finetune.core.errors import UserError

logger = logging.getLogger("finetune")


# ----------------------------------------------------------------------------------------------
# Modes.


def accelerate_mixed_precision(mode: str) -> str:
    """Accelerate's `mixed_precision` for a `precision.mode` (bf16-true runs without autocast)."""
    return {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "bf16-true": "no"}[mode]


def refuse_fp16_on_cpu(mode: str, device: str, *, planning: bool = False) -> None:
    """The one fp16-on-CPU rule, for training (`check_supported`) and planning (`planner.check_plannable`):
    Accelerate silently ignores fp16 on CPU, so the run would be fp32 while its config says fp16.

    Raises:
        UserError: `mode` is fp16 and `device` is "cpu" (the remedy named for a run or for `finetune plan`).
    """
    if mode == "fp16" and device == "cpu":
        fix = "plan with --device cuda, or use bf16/fp32" if planning else "use bf16 or fp32"
        raise UserError(f"precision.mode=fp16 needs a CUDA GPU (Accelerate silently ignores it on CPU); {fix}")


def refuse_adamw8bit_off_cuda(optimizer: str, device: str, *, planning: bool = False) -> None:
    """The one adamw8bit rule, for training (`optim.build_adamw8bit`) and planning (`finetune plan`, with
    or without --grid): bitsandbytes' 8-bit optimizer kernels run on CUDA only.

    Raises:
        UserError: `optimizer` is adamw8bit and `device` is not "cuda" (the remedy named for a run or a plan).
    """
    if optimizer == "adamw8bit" and device != "cuda":
        if planning:
            raise UserError(
                "train.optimizer=adamw8bit (bitsandbytes) needs a CUDA GPU; plan with --device cuda, "
                "or use adamw/adafactor"
            )
        raise UserError(
            "train.optimizer=adamw8bit needs a CUDA GPU (bitsandbytes' 8-bit kernels); on CPU use adamw or adafactor"
        )


def check_supported(mode: str, device: torch.device) -> None:
    """Refuse combinations Accelerate would silently ignore or the hardware cannot run.

    Raises:
        UserError: the precision mode cannot run on `device`.
    """
    refuse_fp16_on_cpu(mode, device.type)
    if mode in ("bf16", "bf16-true") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"precision.mode={mode}: this GPU has no bf16 support; use fp16 or fp32")


# Families refused in fp16 (mixed precision with a GradScaler), with the reason; every other family
# is accepted in fp16 on CUDA (fp32 master weights, autocast, loss scaling). README: "Bring your own model".
FP16_REFUSED = {
    "gemma": "Gemma's activations exceed fp16's range (its checkpoints are bf16)",
    "gemma2": "Gemma 2's activations exceed fp16's range (its checkpoints are bf16)",
    "gemma3": "Gemma 3's activations exceed fp16's range (its checkpoints are bf16)",
    "gemma3_text": "Gemma 3's activations exceed fp16's range (its checkpoints are bf16)",
}


def check_family_precision(model_type: str | None, mode: str) -> None:
    """Refuse precision modes a model family cannot train in.

    Raises:
        UserError: the family is refused in this mode (`FP16_REFUSED`).
    """
    if mode == "fp16" and model_type in FP16_REFUSED:
        raise UserError(f"precision.mode=fp16: {FP16_REFUSED[model_type]}; use precision.mode=bf16 or fp32")


def fp32_norms_enabled(mode: str, fp32_norms: bool | None) -> bool:
    """`precision.fp32_norms`, resolved: unset means on for bf16-true and off otherwise
    (mixed modes already hold fp32 norm weights, and CUDA autocast runs norms in fp32)."""
    return mode == "bf16-true" if fp32_norms is None else fp32_norms


def fp32_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-sample cross-entropy computed in fp32 from upcast logits (F.cross_entropy has no dtype=)."""
    return F.cross_entropy(logits.float(), labels, reduction="none", label_smoothing=label_smoothing)


def fp32_pair_losses(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's contrastive loss against the other rows of its micro-batch, in fp32 (`train.contrastive_steps`):
    the mean of (cos - 1)^2 over the rows of its label and the mean of cos^2 over the rows of other labels,
    averaged (a row without partners of one kind takes the other mean alone)."""
    e = F.normalize(features.float(), dim=-1)
    cos = e @ e.T
    same = labels[:, None] == labels[None, :]
    own = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    pos, neg = (same & ~own).float(), (~same).float()
    pulled = ((cos - 1) ** 2 * pos).sum(1) / pos.sum(1).clamp(min=1)
    pushed = (cos**2 * neg).sum(1) / neg.sum(1).clamp(min=1)
    kinds = (pos.sum(1) > 0).float() + (neg.sum(1) > 0).float()
    return (pulled + pushed) / kinds.clamp(min=1)


def fp32_per_sample_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    problem_type: str,
    focal_gamma: float | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """One fp32 loss per sample, from upcast logits: cross-entropy (single-label, with `label_smoothing`), binary
    cross-entropy averaged over the labels (multi-label), squared error (regression, one output).
    With `focal_gamma` the classification losses are focal: each term times (1 - p_true)^gamma,
    p_true = exp(-term), so confidently right samples weigh little.

    Per sample, so the loop can weight samples and normalise by the whole window's sample weight.
    """
    if problem_type == "regression":
        return (logits.float().squeeze(-1) - labels.float()) ** 2
    if problem_type == "multi_label_classification":
        terms = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    else:
        terms = fp32_cross_entropy(logits, labels, label_smoothing)
    if focal_gamma is not None:
        terms = (1.0 - torch.exp(-terms)) ** focal_gamma * terms
    return terms.mean(-1) if problem_type == "multi_label_classification" else terms


def fp32_distill_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    teacher: torch.Tensor,
    gold: torch.Tensor,
    problem_type: str,
    temperature: float,
    alpha: float,
    soft_loss: str,
) -> torch.Tensor:
    """One fp32 distillation loss per sample, from upcast student and teacher logits: alpha x gold x the loss
    against the label (as `fp32_per_sample_loss`) + (1 - alpha) x the loss against the teacher's outputs.
    `gold` is 1.0 where the label counts and 0.0 for an unlabeled row (its label a placeholder).

    - single-label: T^2 x KL(softmax(teacher/T) || softmax(student/T)) (Hinton et al., 2015); T^2 keeps the soft
      term's gradients the size of the hard term's as T grows.
    - multi-label: each label is its own two-class problem, so the soft term is the binary cross-entropy of
      sigmoid(student/T) against sigmoid(teacher/T), x T^2, averaged over the labels as the hard term is. It
      differs from the binary KL by the teacher's entropy, a constant of the student: same gradients, and the
      form torch computes stably from logits.
    - regression: (student - teacher)^2; a temperature has nothing to soften.
    - the above is `soft_loss="kl"` (`distill.loss`, whose default lives in the schema); `soft_loss="mse"` (logit
      matching; Kim et al., IJCAI 2021, show that KL tends to it as T grows, and that it distils better): the mean
      squared difference of the logits, single-label ones centred first since a softmax ignores a shift common to
      all classes; the temperature does not enter.

    Per sample, so the loop weights samples and normalises by the whole window's sample weight as it does the
    plain loss.
    """
    s, t = logits.float(), teacher.float()
    if problem_type == "regression":
        s, t = s.squeeze(-1), t.squeeze(-1)
        return alpha * gold * (s - labels.float()) ** 2 + (1.0 - alpha) * (s - t) ** 2
    hard = fp32_per_sample_loss(s, labels, problem_type)
    if soft_loss == "mse":
        if problem_type == "single_label_classification":
            s, t = s - s.mean(-1, keepdim=True), t - t.mean(-1, keepdim=True)
        return alpha * gold * hard + (1.0 - alpha) * ((s - t) ** 2).mean(-1)
    if problem_type == "multi_label_classification":
        target = torch.sigmoid(t / temperature)
        soft = F.binary_cross_entropy_with_logits(s / temperature, target, reduction="none").mean(-1)
    else:
        log_p = F.log_softmax(t / temperature, dim=-1)
        soft = F.kl_div(F.log_softmax(s / temperature, dim=-1), log_p, reduction="none", log_target=True).sum(-1)
    return alpha * gold * hard + (1.0 - alpha) * temperature**2 * soft


# ----------------------------------------------------------------------------------------------
# fp32 norms.

# Matched by type; subclasses (BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm*) included.
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)
# Matched by class name: models define their own norms (LlamaRMSNorm, T5LayerNorm, ...).
NORM_NAME_SUFFIXES = ("RMSNorm", "LayerNorm", "GroupNorm", "BatchNorm")


def is_norm_module(module: nn.Module, extra_class_names: Iterable[str] = ()) -> bool:
    """A normalization layer: by type, by class-name suffix, or named in `precision.norm_class_names`."""
    name = type(module).__name__
    return isinstance(module, NORM_TYPES) or name.endswith(NORM_NAME_SUFFIXES) or name in set(extra_class_names)


def within(name: str, roots: Iterable[str]) -> bool:
    """Whether module `name` is one of `roots` or inside one ("" is the whole model)."""
    return any(name == r or r == "" or name.startswith(r + ".") for r in roots)


def find_norm_modules(model: nn.Module, extra_class_names: Iterable[str] = ()) -> dict[str, nn.Module]:
    """Norm modules by qualified name (outermost only: a norm's children go with it)."""
    extra = set(extra_class_names)
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if within(name, found):
            continue
        if is_norm_module(module, extra):
            found[name] = module
    return found


def _cast_tensors(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_tensors(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_tensors(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_tensors(v, dtype) for k, v in value.items()}
    return value


def _fp32_norm_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run a norm on fp32 inputs with autocast off; return the caller's floating dtype."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        # the usual call, norm(hidden), without autocast (bf16-true has none): it runs once per norm per
        # forward, so no context manager and no walk over the arguments
        x = args[0]
        if not torch.is_autocast_enabled(x.device.type):
            out = self._fp32_inner_forward(x.float())
            return out.to(x.dtype) if isinstance(out, torch.Tensor) else _cast_tensors(out, x.dtype)
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if first is None:
        return self._fp32_inner_forward(*args, **kwargs)
    with torch.autocast(device_type=first.device.type, enabled=False):
        out = self._fp32_inner_forward(*_cast_tensors(args, torch.float32), **_cast_tensors(kwargs, torch.float32))
    return _cast_tensors(out, first.dtype)


def keep_norm_fp32(module: nn.Module) -> None:
    """Put a norm module's parameters and buffers in fp32 and make it compute in fp32.

    The forward is replaced on the instance (as Accelerate does for autocast), so the state_dict
    keys stay the same, `copy.deepcopy` rebinds it to the copy, and torch.compile traces through.
    """
    module.float()
    if getattr(module, "_fp32_norm", False):
        return
    module._fp32_inner_forward = module.forward  # the class's forward, or whatever was patched in before
    module.forward = types.MethodType(_fp32_norm_forward, module)
    module._fp32_norm = True


# ----------------------------------------------------------------------------------------------
# Applying the policy.


def strip_compile_prefix_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: accept checkpoints written through a `torch.compile(model)`
    wrapper, whose keys start with `_orig_mod.` (torch's own helper edits the dict in place)."""
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state_dict, prefix + "_orig_mod.")


def apply_precision_policy(
    model: nn.Module, mode: str, fp32_norms: bool | None, norm_class_names: Iterable[str] = ()
) -> list[str]:
    """Cast the model for `mode` and keep norms fp32 when enabled; return the fp32 norm names.

    Call after building the model (gradient checkpointing included) and before the optimizer
    and torch.compile. Also makes `load_state_dict` accept `_orig_mod.`-prefixed keys.
    """
    check_family_precision(getattr(getattr(model, "config", None), "model_type", None), mode)
    norms = find_norm_modules(model, norm_class_names) if fp32_norms_enabled(mode, fp32_norms) else {}
    if mode == "bf16-true":
        # cast the parameters outside the norms (not all, then norms back: that would round their
        # weights). Float buffers stay fp32: they are constants the model reads (rotary `inv_freq`,
        # Gemma's `embed_scale`), and a bf16 `inv_freq` puts position errors of several tokens into
        # long sequences (relative error 2**-9: up to 8 positions at position 4096); the models cast them
        # where they use them. Norm buffers follow the norm.
        for name, module in model.named_modules():
            if within(name, norms):
                continue
            for p in module.parameters(recurse=False):
                if p.is_floating_point():
                    p.data = p.data.to(torch.bfloat16)
    for module in norms.values():
        keep_norm_fp32(module)
    if not getattr(model, "_strips_compile_prefix", False):
        model.register_load_state_dict_pre_hook(strip_compile_prefix_hook)
        model._strips_compile_prefix = True
    return list(norms)


# ----------------------------------------------------------------------------------------------
# bf16 optimizer update.


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Write fp32 `src` into bf16 `dst` rounding up or down with probability proportional to the
    distance (unbiased: small updates survive in expectation). Adds 16 random low bits to the
    fp32 bit pattern, then truncates them; sign-magnitude makes this symmetric for negatives."""
    bits = src.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    dst.copy_(((bits + noise) & -65536).view(torch.float32))  # -65536 == 0xFFFF0000: exact in bf16
    return dst


class Bf16AdamW(torch.optim.Optimizer):
    """AdamW for bf16 parameters whose small updates are not rounded away.

    Math runs in fp32 per tensor; parameters and state stay in their own dtype (bf16 in
    bf16-true). `update` decides how the fp32 result goes back into a bf16 parameter:
    - `kahan`: round to nearest and keep the rounding error in a bf16 compensation buffer that is
      added to the next update (optimi / Zamirai et al. 2020); +2 bytes per parameter.
    - `stochastic`: stochastic rounding (unbiased), no extra memory.
    - `plain`: round to nearest, what torch.optim.AdamW on bf16 weights does (loses steps).
    With `kahan` and `stochastic` the bf16 moments are written back by stochastic rounding: with
    round-to-nearest `exp_avg_sq * 0.999` rounds back to itself in bf16 (8-bit mantissa), so the
    second moment would stop decaying. fp32 parameters take the exact fp32 path.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        update: str = "kahan",
    ) -> None:
        if update not in ("kahan", "stochastic", "plain"):
            raise ValueError(f"update must be kahan, stochastic or plain, not {update!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "update": update})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step (decoupled weight decay, bias-corrected moments).

        Tensors are updated together with `torch._foreach_*` in buckets of at most CHUNK elements (a large
        tensor in slices of CHUNK): one kernel per operation and bucket instead of one per parameter, and
        the fp32 temporaries bounded by CHUNK elements, not by the model (~8 copies of 45 MiB at once for
        MiniLM's word embeddings otherwise). The math is elementwise, so a bucket or a slice computes the
        same bits as a whole tensor (tests/test_precision.py); only stochastic rounding draws its random
        bits in another order.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple[Any, ...], list[list[torch.Tensor | None]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Bf16AdamW does not support sparse gradients")
                low = p.dtype != torch.float32
                state = self.state[p]
                if not state:
                    # on CPU: no device sync; made from data (not zeros) so that under FakeTensorMode
                    # (finetune plan) it stays a known constant and float(step) below still works
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if low and group["update"] == "kahan":
                        state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                tensors = [p, p.grad, state["exp_avg"], state["exp_avg_sq"], state.get("kahan_comp")]
                key = (low, float(state["step"]), p.device, p.dtype, tensors[4] is not None)
                for piece in self._pieces(tensors):
                    bucket = buckets.setdefault(key, [[] for _ in tensors])
                    if bucket[0] and sum(x.numel() for x in bucket[0]) + piece[0].numel() > self.CHUNK:
                        self._update(*bucket, key[1], group, low)
                        bucket = buckets[key] = [[] for _ in tensors]
                    for column, x in zip(bucket, piece, strict=True):
                        column.append(x)
            for (low, t, *_), bucket in buckets.items():
                self._update(*bucket, t, group, low)
        return loss

    CHUNK = 1 << 20  # elements per bucket of tensors (and per slice of a larger tensor)

    @classmethod
    def _pieces(cls, tensors: list[torch.Tensor | None]) -> list[list[torch.Tensor | None]]:
        """A parameter's tensors whole, or in flat slices of CHUNK elements when it is larger."""
        n = tensors[0].numel()
        if n <= cls.CHUNK or not all(x is None or x.is_contiguous() for x in tensors):
            return [tensors]
        flat = [None if x is None else x.view(-1) for x in tensors]
        return [[None if x is None else x[lo : lo + cls.CHUNK] for x in flat] for lo in range(0, n, cls.CHUNK)]

    @staticmethod
    def _update(
        ps: list[torch.Tensor],
        gs: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        comps: list[torch.Tensor | None],
        t: float,
        group: dict[str, Any],
        low: bool,
    ) -> None:
        """The AdamW update of a bucket of tensors (or slices), computed in fp32, written in place."""
        beta1, beta2 = group["betas"]
        lr, eps, wd, update = group["lr"], group["eps"], group["weight_decay"], group["update"]
        grads = [g.float() for g in gs]
        m = [x.float() for x in exp_avgs]  # fp32 state: the state itself, updated in place
        v = [x.float() for x in exp_avg_sqs]
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        for buf, val in zip([*exp_avgs, *exp_avg_sqs], [*m, *v], strict=True):
            if buf.dtype == torch.bfloat16 and update != "plain":
                stochastic_round_(buf, val)
            elif buf is not val:
                buf.copy_(val)
        denom = torch._foreach_sqrt(v)  # v may alias fp32 state
        torch._foreach_div_(denom, math.sqrt(1 - beta2**t))
        torch._foreach_add_(denom, eps)
        p32 = [p.float() for p in ps]
        # the update in fp32: decoupled weight decay plus the Adam step
        delta = torch._foreach_div(m, denom)
        torch._foreach_mul_(delta, -lr / (1 - beta1**t))
        torch._foreach_add_(delta, p32, alpha=-lr * wd)
        if not low:
            torch._foreach_add_(ps, delta)
        elif update == "kahan":
            torch._foreach_add_(delta, comps)  # what is owed from earlier roundings
            torch._foreach_copy_(ps, torch._foreach_add(p32, delta))
            applied = torch._foreach_sub([p.float() for p in ps], p32)
            torch._foreach_sub_(delta, applied)  # intended minus applied
            torch._foreach_copy_(comps, delta)
        elif update == "stochastic" and ps[0].dtype == torch.bfloat16:
            torch._foreach_add_(p32, delta)
            for p, x in zip(ps, p32, strict=True):
                stochastic_round_(p, x)
        else:
            torch._foreach_add_(p32, delta)
            torch._foreach_copy_(ps, p32)


def effective_weight(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """The value a parameter stands for: the bf16 weight plus its Kahan compensation, in fp32."""
    comp = optimizer.state.get(p, {}).get("kahan_comp")
    return p.float() if comp is None else p.float() + comp.float()


# ----------------------------------------------------------------------------------------------
# dtype audit.


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_audit(
    model: nn.Module,
    mode: str,
    fp32_norms: bool | None,
    norm_class_names: Iterable[str] = (),
    *,
    norm_names: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Parameter and buffer counts/bytes per dtype and per module type (`by_module_type` keys
    `param:<dtype>` / `buffer:<dtype>`), and every floating tensor whose dtype contradicts the
    policy: fp32 master weights in fp32/fp16/bf16; in bf16-true bf16 parameters except norms, which
    are fp32 when fp32 norms are on; floating buffers fp32 in every mode (rotary `inv_freq` & co)."""
    keep_fp32 = fp32_norms_enabled(mode, fp32_norms)
    norms = set(norm_names) if norm_names is not None else set(find_norm_modules(model, norm_class_names))
    totals: dict[str, dict[str, dict[str, int]]] = {"param": {}, "buffer": {}}
    by_type: dict[str, dict[str, dict[str, int]]] = {}
    contradictions: list[dict[str, str]] = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        in_norm = within(mod_name, norms)
        mtype = type(module).__name__
        tensors = [("param", n, t) for n, t in module.named_parameters(recurse=False)]
        tensors += [("buffer", n, t) for n, t in module.named_buffers(recurse=False)]
        for kind, name, t in tensors:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            dname = _dtype_name(t.dtype)
            for bucket in (
                totals[kind].setdefault(dname, {"count": 0, "numel": 0, "bytes": 0}),
                by_type.setdefault(mtype, {}).setdefault(f"{kind}:{dname}", {"count": 0, "numel": 0, "bytes": 0}),
            ):
                bucket["count"] += 1
                bucket["numel"] += t.numel()
                bucket["bytes"] += t.numel() * t.element_size()
            if not t.is_floating_point():
                continue  # position ids, num_batches_tracked: integer by design
            if mode != "bf16-true" or kind == "buffer":
                expected = torch.float32  # master weights, and buffers in every mode (model constants)
            else:
                expected = torch.float32 if (in_norm and keep_fp32) else torch.bfloat16
            if t.dtype != expected:
                full = f"{mod_name}.{name}" if mod_name else name
                contradictions.append(
                    {
                        "name": full,
                        "kind": kind,
                        "module_type": mtype,
                        "dtype": dname,
                        "expected": _dtype_name(expected),
                    }
                )
    return {
        "mode": mode,
        "fp32_norms": keep_fp32,
        "norm_modules": sorted(norms),
        "totals": totals,
        "by_module_type": by_type,
        "contradictions": contradictions,
    }


def format_audit(audit: dict[str, Any], max_rows: int = 10) -> str:
    """A short log table: per dtype counts and MiB, then the contradictions."""
    lines = [
        f"dtype audit ({audit['mode']}, fp32 norms {'on' if audit['fp32_norms'] else 'off'}, "
        f"{len(audit['norm_modules'])} norm modules):"
    ]
    lines.append(f"  {'kind':<7} {'dtype':<10} {'tensors':>8} {'elements':>12} {'MiB':>9}")
    for kind in ("param", "buffer"):
        for dname, b in sorted(audit["totals"][kind].items()):
            lines.append(f"  {kind:<7} {dname:<10} {b['count']:>8} {b['numel']:>12,} {b['bytes'] / 2**20:>9.2f}")
    rows = audit["contradictions"]
    if rows:
        lines.append(f"  {len(rows)} tensor(s) contradict the policy:")
        for r in rows[:max_rows]:
            lines.append(f"    {r['kind']} {r['name']} ({r['module_type']}): {r['dtype']}, expected {r['expected']}")
        if len(rows) > max_rows:
            lines.append(f"    ... and {len(rows) - max_rows} more (dtype_audit.json)")
    else:
        lines.append("  no tensor contradicts the policy")
    return "\n".join(lines)


def check_audit(audit: dict[str, Any], allow_mismatch: bool) -> None:
    """In bf16-true a dtype contradiction is an error unless `precision.allow_dtype_mismatch`.

    Raises:
        UserError: a tensor contradicts the precision policy (unless allowed).
    """
    rows = audit["contradictions"]
    if not rows:
        return
    names = ", ".join(f"{r['name']} ({r['dtype']}, expected {r['expected']})" for r in rows[:3])
    more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
    if audit["mode"] == "bf16-true" and not allow_mismatch:
        raise UserError(
            f"precision.mode=bf16-true: {len(rows)} tensor(s) contradict the dtype policy: {names}{more}; "
            "list custom norm classes in precision.norm_class_names or set precision.allow_dtype_mismatch=true"
        )
    logger.warning(f"warning: {len(rows)} tensor(s) contradict the dtype policy: {names}{more}")


def audit_json(audit: dict[str, Any]) -> str:
    """`dtype_audit.json` text."""
    return json.dumps(audit, indent=2)


# ----------------------------------------------------------------------------------------------
# torch.compile.


class _RecompileLimitLog(logging.Handler):
    """Counts dynamo's 'hit config.recompile_limit' warnings: past the limit dynamo silently runs
    the frame eagerly, and it keeps no counter of its own for that."""

    hits = 0
    graphs_at_compile = 0

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."):
            type(self).hits += 1


def _install_recompile_watch() -> None:
    log = logging.getLogger("torch._dynamo.convert_frame")
    if not any(isinstance(h, _RecompileLimitLog) for h in log.handlers):
        log.addHandler(_RecompileLimitLog())


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compiled_graphs() -> int:
    """Graphs dynamo compiled since the last `compile_model` (its counters outlive `reset()`)."""
    return _unique_graphs() - _RecompileLimitLog.graphs_at_compile


def compile_model(
    model: nn.Module, backend: str = "inductor", mode: str | None = None, dynamic: bool | None = None
) -> None:
    """Compile in place (`module.compile()`: state_dict keys stay free of `_orig_mod.`).

    Call after `apply_precision_policy` and gradient checkpointing. Accelerate's autocast wraps
    `model.forward`, which the compiled `_call_impl` calls, so autocast is inside the compiled
    region. `dynamic=None` (default): the first new sequence length marks the length dynamic,
    so an epoch of length-grouped batches compiles a handful of graphs instead of one per length
    (which would pass `recompile_limit` and fall back to eager).
    """
    import torch._dynamo

    torch._dynamo.reset()  # caches of an earlier run in this process would count toward this run's limit
    _install_recompile_watch()
    _RecompileLimitLog.hits = 0
    _RecompileLimitLog.graphs_at_compile = _unique_graphs()
    kwargs: dict[str, Any] = {"backend": backend, "dynamic": dynamic}
    if mode is not None:
        kwargs["mode"] = mode
    model.compile(**kwargs)


def recompile_limit_hits() -> int:
    """How often dynamo hit a recompile limit since `compile_model` (each falls back to eager)."""
    return _RecompileLimitLog.hits


# ----------------------------------------------------------------------------------------------
# Non-finite values, loss scale, cache release: what the loop asks at sync and log steps.


class NonFiniteError(UserError):
    """Training met a NaN/inf loss or gradient norm with `train.nonfinite=stop`."""


class PrecisionMonitor:
    """Run-time side of the policy, asked by the loop at optimizer (sync) steps only.

    - `step_ok(grad_norm, window_loss, step)`, at each optimizer step. fp16 defers to the GradScaler
      (it skips overflowing steps and lowers the scale). `train.nonfinite=stop` reads nothing back: the
      first non-finite step is recorded on the device and `raise_if_nonfinite()` (a host sync, at the
      loop's log rows, evaluations and checkpoints) stops with a NonFiniteError, so no checkpoint or
      evaluation ever sees the weights after it. `skip` must decide before the step: one host sync per step.
    - `after_step(skipped)`: counts scaler-skipped fp16 steps.
    - `fields()`: what every metrics.jsonl line gets (compile_graphs, loss_scale, skip counts).
    """

    def __init__(
        self,
        mode: str,
        nonfinite: str,
        scaler: Any = None,
        compiled: bool = False,
        num_processes: int = 1,
        last_checkpoint: Callable[[], Path | None] | None = None,
    ) -> None:
        self.mode, self.nonfinite, self.scaler, self.compiled = mode, nonfinite, scaler, compiled
        # the error of a stopped run names the checkpoint to resume from
        self.num_processes, self.last_checkpoint = num_processes, last_checkpoint
        self.scaler_skipped = 0
        self.nonfinite_skipped = 0
        self._limit_reported = False
        self._first_bad: torch.Tensor | None = (
            None  # stop: [step, loss, grad norm] of the first bad step; step 0 = none
        )

    @property
    def checks_grads(self) -> bool:
        """Whether the loop must compute the gradient norm even without clipping."""
        return self.mode != "fp16"

    def step_ok(self, grad_norm: torch.Tensor | float | None, window_loss: torch.Tensor, step: int) -> bool:
        """True to apply this optimizer step; False to skip it (`skip`). With `stop` always True: the step
        is recorded for `raise_if_nonfinite` without a host sync."""
        if not self.checks_grads:
            return True  # fp16: the GradScaler skips the step and lowers the scale
        loss = window_loss.detach().float()
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor norm; its value is the same on every rank
            grad_norm = grad_norm.full_tensor()
        norm = loss.new_zeros(()) if grad_norm is None else torch.as_tensor(grad_norm, device=loss.device).float()
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        if self.nonfinite == "stop":
            first = self._first_bad if self._first_bad is not None else loss.new_zeros(3)
            here = torch.stack([torch.full_like(loss, float(step)), loss, norm])  # a fill, not a host-to-device copy
            self._first_bad = torch.where(bad & (first[0] == 0), here, first)
            return True
        if self.num_processes > 1:  # every rank must take the same decision
            import torch.distributed as dist

            flag = bad.float().reshape(1)
            dist.all_reduce(flag)
            bad = flag[0] > 0
        if not bool(bad):  # skip: the one host sync per optimizer step
            return True
        self.nonfinite_skipped += 1
        logger.warning(
            f"warning: non-finite values at optimizer step {step} ({self._what(loss, norm, grad_norm is not None)}): "
            f"step skipped ({self.nonfinite_skipped} so far)"
        )
        return False

    @staticmethod
    def _what(loss: torch.Tensor, norm: torch.Tensor, has_norm: bool) -> str:
        return f"loss {float(loss):g}, gradient norm {float(norm) if has_norm else 'n/a'}"

    def raise_if_nonfinite(self) -> None:
        """Stop if a step since the start had a non-finite loss or gradient norm (`train.nonfinite=stop`).

        A host sync (and, with several processes, a collective every rank calls at the same step): call it
        where the loop reads values anyway, before a log row, an evaluation or a checkpoint.

        Raises:
            NonFiniteError: naming the first such step, its values and the last intact checkpoint.
        """
        if self._first_bad is None:
            return
        first = self._first_bad
        if self.num_processes > 1:  # a rank's own loss may be the only bad value: every rank stops
            import torch.distributed as dist

            first = first.clone()
            dist.all_reduce(first, op=dist.ReduceOp.MAX)
        step, loss, norm = first.tolist()
        if step == 0:
            return
        where = ""
        if self.last_checkpoint is not None:
            found = self.last_checkpoint()
            where = f"; the last checkpoint {found} is intact" if found else "; no checkpoint was written yet"
        raise NonFiniteError(
            f"training stopped: non-finite values at optimizer step {int(step)} (loss {loss:g}, "
            f"gradient norm {norm:g}) in precision.mode={self.mode}{where}; "
            "lower train.learning_rate, set train.max_grad_norm, try precision.mode=fp32, or set train.nonfinite=skip"
        )

    def after_step(self, skipped_by_scaler: bool) -> None:
        """Count an fp16 step the GradScaler skipped (Accelerate's `optimizer_step_was_skipped`)."""
        if skipped_by_scaler:
            self.scaler_skipped += 1

    def fields(self) -> dict[str, Any]:
        """Extra metrics.jsonl fields (a host sync for the scale: call at log/eval steps only)."""
        out: dict[str, Any] = {}
        if self.compiled:
            out["compile_graphs"] = compiled_graphs()
            hits = recompile_limit_hits()
            if hits:
                out["compile_recompile_limit_hits"] = hits
                if not self._limit_reported:
                    self._limit_reported = True
                    logger.warning(
                        "warning: torch.compile hit torch._dynamo.config.recompile_limit: the model now runs eagerly "
                        "for new shapes; keep model.compile_dynamic unset (null) or raise the limit"
                    )
        if self.scaler is not None:
            out["loss_scale"] = float(self.scaler.get_scale())
            out["fp16_skipped_steps"] = self.scaler_skipped
        if self.nonfinite_skipped:
            out["nonfinite_skipped_steps"] = self.nonfinite_skipped
        return out


def release_cached_memory(enabled: bool, device: torch.device) -> None:
    """`torch.cuda.empty_cache()` at epoch end and before evaluation only (never in the step):
    it hands cached blocks back, which helps evaluation's different shapes and other processes."""
    if enabled and device.type == "cuda":
        torch.cuda.empty_cache()
