"""Measured memory: what a run actually used, written into every checkpoint.

Three sources, each named in the report:
- exact tensor sums: parameters, gradients (summed from the real `.grad` tensors right after
  an optimizer step, before they are freed) and optimizer state;
- the breakdown at the peak (activations, temporaries, peak) from torch's `MemTracker` on one
  sampled optimizer step (a whole accumulation window plus the optimizer step), taken once the
  optimizer state exists; on CUDA without a sample: the measured peak minus the rest;
- device counters: on CUDA peak/current allocated and reserved since the previous checkpoint,
  fragmentation, allocation retries, OOMs and `memory_summary()`; on CPU the peak RSS since the
  previous checkpoint (Linux VmHWM, reset through /proc/self/clear_refs).

What a config *will* need is predicted elsewhere (finetune/memory/planner.py, on the window harness of
finetune/memory/peak.py); this module only measures a real run. `PeakTracker` here is shared by both.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.utils.hooks import RemovableHandle

from finetune.core.errors import UserError
from finetune.core.fileio import read_jsonl

logger = logging.getLogger("finetune")

MIB = 1 << 20
REPORT_KEYS = (
    "parameters_bytes",
    "gradients_bytes",
    "optimizer_state_bytes",
    "activations_bytes",
    "temporaries_bytes",
    "peak_bytes",
)


# ----------------------------------------------------------------------------------------------
# Exact sums over tensors.


def _nbytes(t: torch.Tensor) -> int:
    t = getattr(t, "_local_tensor", t)  # FSDP2's DTensor: this rank's shard is what it holds
    return t.numel() * t.element_size()


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (shared parameters counted once)."""
    return sum(_nbytes(p) for p in model.parameters())


def buffer_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's buffers."""
    return sum(_nbytes(b) for b in model.buffers())


def gradient_bytes(model_or_params: Any) -> int:
    """Bytes of the `.grad` tensors that exist now."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    return sum(_nbytes(p.grad) for p in params if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (AdamW moments, step counters, ...)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    return sum(_nbytes(v) for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor))


# ----------------------------------------------------------------------------------------------
# Process / device counters.


def _vm_hwm_bytes() -> int | None:
    try:
        m = re.search(r"VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def _reset_vm_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# glibc's mallopt parameter and values (malloc.h): below the threshold a block comes from the heap, above it it is
# a mapping of its own, unmapped when freed; glibc raises the threshold by itself up to 32 MiB on 64-bit
M_MMAP_THRESHOLD = -3
LEAN_MMAP_THRESHOLD = 128 * 1024  # glibc's starting value
DYNAMIC_MMAP_CEILING = 32 * 1024 * 1024


@functools.cache
def _glibc() -> Any:
    """glibc through ctypes, or None under another C library (macOS, musl, Windows)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        return libc
    except (OSError, AttributeError, TypeError):
        return None


@contextlib.contextmanager
def lean_heap(active: bool) -> Iterator[None]:
    """Around the epoch's heaviest training window on a CPU: the heap's free pages handed back
    (`malloc_trim(0)`) and the mmap threshold pinned at 128 KiB, then set to 32 MiB after it.

    After the first windows glibc serves activations from its heap (its threshold has risen to the
    largest block freed), and the heaviest window's temporaries of many sizes, freed and reallocated
    while its saved activations stay live, leave free chunks resident above the tensors in use.
    Pinned, each large block is its own mapping and returns to the system when freed, at the price of
    page faults in that one window (docs/MEMORY.md). Nothing happens when not `active` or
    outside glibc.
    """
    libc = _glibc() if active else None
    if libc is None:
        yield
        return
    libc.malloc_trim(0)
    libc.mallopt(M_MMAP_THRESHOLD, LEAN_MMAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, DYNAMIC_MMAP_CEILING)


def current_rss_bytes() -> int:
    """Resident set size of this process now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


class PeakTracker(MemTracker):
    """torch's MemTracker for one window's peak: gradient hooks on trainable parameters only, and
    the global peak only.

    MemTracker calls `param.register_hook` on every parameter it meets, which raises on a frozen
    one (LoRA's base, frozen embeddings; under FSDP2 also the unsharded copies made anew for every
    forward, recognised here by `requires_grad` too). Its peak update also walks every module's statistics
    after every op and deep-copies a snapshot whenever one rises (O(ops x modules): a 30-layer
    decoder's sampled window ran tens of times slower than an untracked one); the report and the
    planner read the global peak snapshot alone, kept here as MemTracker keeps it.

    MemTracker's ModTracker registers a multi-grad hook on every tracked module's inputs and outputs and drops
    the handle. Each hook's closure holds the grad_fns of its tensors, and those grad_fns hold the hook (in
    C++): a cycle Python's collector cannot see through, so the window's autograd graph outlives the run and,
    through its AccumulateGrad nodes, every parameter with it (one copy of the weights per sampled run in a
    process that trains again: a sweep, a notebook). The handles are kept here and removed on exit, when the
    window's backward has run.
    """

    def __enter__(self) -> PeakTracker:
        self._multi_grad_handles: list[RemovableHandle] = []
        register = self._register_multi_grad_hook = mod_tracker.register_multi_grad_hook

        def register_and_keep(*args: Any, **kwargs: Any) -> RemovableHandle:
            handle = register(*args, **kwargs)
            self._multi_grad_handles.append(handle)
            return handle

        mod_tracker.register_multi_grad_hook = register_and_keep
        try:
            return super().__enter__()
        except BaseException:
            self._release_multi_grad_hooks()
            raise

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            self._release_multi_grad_hooks()

    def _release_multi_grad_hooks(self) -> None:
        mod_tracker.register_multi_grad_hook = self._register_multi_grad_hook
        for handle in self._multi_grad_handles:
            handle.remove()
        self._multi_grad_handles.clear()

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)  # a flat dict of ints: a copy is a deep copy

    def _track_module_params_and_buffers(
        self, module: torch.nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        mem = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if not param.requires_grad or self._param_to_grad_hook_handles.get(param, None) is not None:
                    continue

                def on_grad(grad: torch.Tensor) -> None:  # a tensor hook must return None
                    self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(on_grad),
                    param.register_post_accumulate_grad_hook(lambda p: on_grad(p.grad)),
                )
        return mem


def _memtracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """A PeakTracker over the model and optimizer."""
    mt = PeakTracker()
    mt.track_external(model, getattr(optimizer, "optimizer", optimizer))
    return mt


RANK_KEYS = (
    "peak_bytes",
    "parameters_bytes",
    "gradients_bytes",
    "optimizer_state_bytes",
    "activations_bytes",
    "temporaries_bytes",
)


def every_rank(rep: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Each rank's measured peak and split, in rank order (None with one process).

    A collective: every rank reports at the same step. Under FSDP the ranks hold different shards
    (an uneven split), and the planner's per-rank prediction is checked against each of them.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {k: rep.get(k) for k in RANK_KEYS})
    return ranks


class MemoryMonitor:
    """Collects the measurements of one training process between checkpoints.

    The loop calls `interval_peak()` at each log line, `end_sample()` / `begin_sample()` around
    optimizer-step boundaries and `report()` when it writes a checkpoint.
    """

    def __init__(
        self,
        device: torch.device,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config_summary: dict[str, Any],
        record_history: bool = False,
        breakdown: bool = True,
    ) -> None:
        self.device = device
        self.breakdown = breakdown  # memory.breakdown: sample windows with MemTracker at all
        self.cuda = device.type == "cuda"
        self.model = model
        self.optimizer = optimizer
        self.config_summary = config_summary
        self.record_history = record_history and self.cuda
        if record_history and not self.cuda:
            logger.warning("warning: memory.record_history records the CUDA allocator and does nothing on this device")
        self.gradients: int | None = None
        self.sample: dict[str, Any] | None = None
        self._tracker: Any = None
        self._reset_hook: Any = None
        self._sample_step: int | None = None
        self._shapes: list[list[int]] = []
        # the step of the window with the most padded tokens: sampled too, and the higher peak is kept
        self.heaviest_step: int | None = None
        self._since_ckpt = {"peak_allocated": 0, "peak_reserved": 0, "peak_rss": 0}
        self._rss_resettable = _reset_vm_hwm()
        inner = getattr(optimizer, "optimizer", optimizer)
        # exact gradient bytes: read once, right after the first optimizer step, before zero_grad frees them
        self._grad_hook = inner.register_step_post_hook(self._count_gradients)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            if self.record_history:
                torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _count_gradients(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.gradients = gradient_bytes(params)
        self._grad_hook.remove()

    # -- peaks ---------------------------------------------------------------------------------

    def interval_peak(self) -> int:
        """Peak bytes since the previous call (CUDA allocated, else RSS); resets the counter."""
        if self.cuda:
            alloc = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            self._since_ckpt["peak_allocated"] = max(self._since_ckpt["peak_allocated"], alloc)
            self._since_ckpt["peak_reserved"] = max(self._since_ckpt["peak_reserved"], reserved)
            torch.cuda.reset_peak_memory_stats(self.device)
            return int(alloc)
        rss = _vm_hwm_bytes() or current_rss_bytes()
        self._since_ckpt["peak_rss"] = max(self._since_ckpt["peak_rss"], rss)
        self._rss_resettable = _reset_vm_hwm()
        return int(rss)

    # -- the sampled step ----------------------------------------------------------------------

    def begin_sample(self, step: int) -> None:
        """Start MemTracker on the window that produces step `step + 1`: the first one after the first
        optimizer step (before it AdamW's state does not exist yet and the peak would be too low: 1,206
        against 1,379 MiB on the default model, docs/MEMORY.md), and again on `heaviest_step`'s window,
        whose longer rows may peak higher.
        """
        again = bool(
            self.sample and "peak" in self.sample and step + 1 == self.heaviest_step and self.sample["step"] != step + 1
        )
        if (self.sample is not None and not again) or self._tracker is not None or step < 1:
            return
        if not self.breakdown:
            self.sample = {"error": "not sampled: memory.breakdown is false"}
            return
        if any(getattr(m, "_compiled_call_impl", None) is not None for m in self.model.modules()):
            # a dispatch mode around a compiled model changes dynamo's guards (recompiles)
            self.sample = {"error": "not sampled: the model is compiled (model.compile)"}
            return
        try:
            tracker = _memtracker(self.model, self.optimizer)
            top = self.model

            def reset_before_forward(module: torch.nn.Module, args: Any) -> None:
                # MemTracker refuses a second forward of a module (one per micro-batch of the
                # window) unless its per-module stats are reset first; registered before the
                # tracker's own global hook, so it runs first
                if module is top:
                    tracker.reset_mod_stats()

            self._reset_hook = torch.nn.modules.module.register_module_forward_pre_hook(reset_before_forward)
            tracker.__enter__()
            self._tracker = tracker
            self._sample_step = step + 1
            self._shapes = []
        except Exception as exc:  # the report says why there is no breakdown; training goes on
            logger.warning(
                f"warning: MemTracker could not start ({type(exc).__name__}: {exc}); memory breakdown from measured "
                "peaks"
            )
            self._tracker = None
            self.sample = {"error": f"{type(exc).__name__}: {exc}"}

    def note_batch(self, shape: Any) -> None:
        """Record a micro-batch's shape (rows, tokens) while a window is sampled: the report says what it measured."""
        if self._tracker is not None:
            self._shapes.append([int(n) for n in shape])

    def end_sample(self) -> None:
        """Stop MemTracker after the sampled optimizer step and keep its peak breakdown."""
        if self._tracker is None:
            return
        mt, self._tracker = self._tracker, None
        mt.__exit__(None, None, None)
        self._reset_hook.remove()
        snap = mt.get_tracker_snapshot("peak")
        dev = next((d for d in snap if torch.device(d).type == self.device.type), None)
        peak = snap.get(dev, {}) if dev is not None else {}
        # keys are _MemRefType members ("Parameter", "Activation", ...) and the string "Total"
        new = {
            "step": self._sample_step,
            "peak": {getattr(k, "value", str(k)): int(v) for k, v in peak.items()},
            "batches": self._shapes,
        }
        old = self.sample if self.sample and "peak" in self.sample else None
        if old is not None and old["peak"].get("Total", 0) > new["peak"].get("Total", 0):
            new, old = old, new
        self.sample = new | ({"other": {"step": old["step"], "peak_bytes": old["peak"].get("Total")}} if old else {})

    # -- the report ----------------------------------------------------------------------------

    def report(self, step: int) -> dict[str, Any]:
        """memory.json for a checkpoint at `step`; starts a new since-checkpoint window."""
        self.interval_peak()
        params = parameter_bytes(self.model)
        grads = self.gradients
        grad_source = "the .grad tensors after the first optimizer step of this process"
        if grads is None:
            grads = sum(_nbytes(p) for p in self.model.parameters() if p.requires_grad)
            grad_source = "trainable parameter sizes (no optimizer step in this process yet)"
        optim = optimizer_state_bytes(self.optimizer)
        rep: dict[str, Any] = {
            "step": step,
            "device": str(self.device),
            "parameters_bytes": params,
            "buffers_bytes": buffer_bytes(self.model),
            "gradients_bytes": grads,
            "gradients_source": grad_source,
            "optimizer_state_bytes": optim,
            "activations_bytes": None,
            "temporaries_bytes": None,
            "peak_bytes": None,
            "breakdown_method": "none: no optimizer step was sampled in this process",
            "memtracker_peak": None,
            "sampled_batches": None,
            "other_sample": None,
            "config": self.config_summary,
            "cpu": {
                "peak_rss_bytes": self._since_ckpt["peak_rss"] or None,
                "peak_rss_scope": "since the previous checkpoint" if self._rss_resettable else "process lifetime",
                "current_rss_bytes": current_rss_bytes(),
            },
            "cuda": None,
        }
        sample = self.sample or {}
        if "peak" in sample:
            peak = sample["peak"]
            rep.update(
                activations_bytes=peak.get("Activation", 0),
                temporaries_bytes=peak.get("Temp", 0),
                peak_bytes=peak.get("Total", sum(peak.values())),
                breakdown_method=f"MemTracker on optimizer step {sample['step']} (a whole accumulation window and the "
                "optimizer step)",
                memtracker_peak=peak,
                sampled_batches=sample.get("batches"),
                other_sample=sample.get("other"),
            )
        if self.cuda:
            stats = torch.cuda.memory_stats(self.device)
            alloc, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
            rep["cuda"] = {
                "peak_allocated_bytes": self._since_ckpt["peak_allocated"],
                "peak_reserved_bytes": self._since_ckpt["peak_reserved"],
                "peak_scope": "since the previous checkpoint",
                "allocated_bytes": alloc,
                "reserved_bytes": reserved,
                "fragmentation_bytes": reserved - alloc,
                "alloc_retries": int(stats.get("num_alloc_retries", 0)),
                "ooms": int(stats.get("num_ooms", 0)),
                "memory_summary": torch.cuda.memory_summary(self.device, abbreviated=True),
            }
            if "peak" not in sample:
                rest = params + grads + optim
                peak_alloc = self._since_ckpt["peak_allocated"]
                rep.update(
                    activations_bytes=max(0, peak_alloc - rest),
                    temporaries_bytes=0,
                    peak_bytes=peak_alloc,
                    breakdown_method="measured CUDA peak allocated minus parameters, gradients and optimizer state "
                    "(activations include temporaries)",
                )
        if "error" in sample:
            why = "" if sample["error"].startswith("not sampled") else "MemTracker failed: "
            rep["breakdown_method"] += f"; {why}{sample['error']}"
        self._since_ckpt = {"peak_allocated": 0, "peak_reserved": 0, "peak_rss": 0}
        rep["ranks"] = every_rank(rep)
        return rep

    def write(self, rep: dict[str, Any], directory: Path, metrics_file: Path | None = None) -> None:
        """memory.json, memory.md and, if recorded, the CUDA allocator snapshot.

        memory.png (the peak per logging interval, from the `peak_memory_bytes` of metrics.jsonl)
        is drawn once at the end of the run into the run directory: matplotlib costs about a
        second per figure, too much for every checkpoint.
        """
        (directory / "memory.json").write_text(json.dumps(rep, indent=2))
        (directory / "memory.md").write_text(format_markdown(rep))
        if self.record_history:
            torch.cuda.memory._dump_snapshot(str(directory / "memory_snapshot.pickle"))

    def close(self) -> None:
        """Stop a running sample and the allocator history."""
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._reset_hook.remove()
            self._tracker = None
        if self.record_history:
            torch.cuda.memory._record_memory_history(enabled=None)


# ----------------------------------------------------------------------------------------------
# Rendering.


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v / MIB:,.1f}"


AT_PEAK = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


def at_peak(rep: dict[str, Any]) -> dict[str, int] | None:
    """The peak split into `AT_PEAK`'s categories, summing to `peak_bytes`; None without a breakdown.

    Gradients here are those alive at the peak (a backward's peak comes before most of them exist),
    not `gradients_bytes`, the size of all of them. Buffers count as parameters and MemTracker's
    "Other" as temporaries, as in the planner's categories.
    """
    peak = rep.get("memtracker_peak")
    if peak:
        return {
            "parameters": peak.get("Parameter", 0) + peak.get("Buffer", 0),
            "gradients": peak.get("Gradient", 0),
            "optimizer_state": peak.get("Optstate", 0),
            "activations": peak.get("Activation", 0),
            "temporaries": peak.get("Temp", 0) + peak.get("Other", 0),
        }
    if rep.get("peak_bytes") is None:
        return None
    # CUDA without a MemTracker sample: activations are what the measured peak leaves over
    return {k: rep.get(f"{k}_bytes") or 0 for k in AT_PEAK}


def format_markdown(rep: dict[str, Any]) -> str:
    """memory.md: the report as a table, with its method and configuration."""
    split = at_peak(rep) or {}
    lines = [
        f"# Memory at step {rep['step']} ({rep['device']})",
        "",
        "| what | MiB | bytes | MiB at the peak |",
        "|---|---:|---:|---:|",
    ]
    for key in (
        "parameters_bytes",
        "buffers_bytes",
        "gradients_bytes",
        "optimizer_state_bytes",
        "activations_bytes",
        "temporaries_bytes",
        "peak_bytes",
    ):
        name = key.removesuffix("_bytes")
        there = rep.get(key) if name == "peak" else split.get(name)
        lines.append(
            f"| {name} | {_mib(rep.get(key))} | {rep.get(key) if rep.get(key) is not None else '-'} | "
            f"{_mib(there) if name != 'buffers' else '(in parameters)'} |"
        )
    lines += [
        "",
        f"Breakdown at the peak: {rep['breakdown_method']}. The last column sums to the peak; its "
        "gradients are those alive at that moment.",
        f"Gradients in the MiB and bytes columns: {rep['gradients_source']}.",
        "",
    ]
    if rep.get("sampled_batches"):
        shapes = ", ".join(" x ".join(map(str, b)) for b in rep["sampled_batches"])
        other = rep.get("other_sample")
        lines += [
            f"The sampled window's micro-batches (rows x tokens): {shapes}. Batches are padded per batch, so "
            "a window of longer rows peaks higher: `finetune plan` gives the worst case at data.max_length."
            + (
                f" The other window sampled, step {other['step']}, peaked at {_mib(other['peak_bytes'])} MiB."
                if other
                else ""
            ),
            "",
        ]
    cpu = rep.get("cpu") or {}
    if cpu.get("peak_rss_bytes"):
        lines.append(
            f"CPU peak RSS ({cpu['peak_rss_scope']}): {_mib(cpu['peak_rss_bytes'])} MiB; now "
            f"{_mib(cpu['current_rss_bytes'])} MiB."
        )
    cuda = rep.get("cuda")
    if cuda:
        lines += [
            f"CUDA peak allocated {_mib(cuda['peak_allocated_bytes'])} MiB, peak reserved "
            f"{_mib(cuda['peak_reserved_bytes'])} MiB ({cuda['peak_scope']}).",
            f"Now: allocated {_mib(cuda['allocated_bytes'])} MiB, reserved {_mib(cuda['reserved_bytes'])} MiB, "
            f"fragmentation (reserved - allocated) {_mib(cuda['fragmentation_bytes'])} MiB; "
            f"allocation retries {cuda['alloc_retries']}, OOMs {cuda['ooms']}.",
            "",
            "```",
            cuda["memory_summary"].rstrip(),
            "```",
        ]
    lines += ["", "Configuration: " + ", ".join(f"{k}={v}" for k, v in rep["config"].items()), ""]
    return "\n".join(lines)


def plot_memory(
    metrics_file: Path, out: Path, upto_step: int | None = None, report: dict[str, Any] | None = None
) -> None:
    """memory.png: peak memory per logging interval (metrics.jsonl's `peak_memory_bytes`) and, with a
    memory report, where the peak went: parameters, gradients, optimizer state, activations and
    temporaries as a stacked bar, beside the planner's prediction when the run planned its micro-batch."""
    rows: dict[int, float] = {}
    for row in read_jsonl(metrics_file):
        if "peak_memory_bytes" in row and (upto_step is None or row["step"] <= upto_step):
            rows[row["step"]] = row["peak_memory_bytes"] / MIB
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(rows)
    fig, (ax, bar) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    ax.plot(steps, [rows[s] for s in steps], marker=".")
    ax.set_xlabel("optimizer step")
    cuda = str((report or {}).get("device", "")).startswith("cuda")
    ax.set_ylabel(f"peak {'CUDA allocated' if cuda else 'process RSS'} MiB, log interval")
    ax.set_title("peak memory per logging interval")
    ax.grid(alpha=0.3)
    _breakdown_bar(bar, report)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def _breakdown_bar(ax: Any, report: dict[str, Any] | None) -> None:
    """A stacked bar of the peak's categories (MiB) from a checkpoint's memory report."""
    sources = {}
    if report is not None and (split := at_peak(report)) is not None:
        sampled = re.search(r"step \d+", report.get("breakdown_method", "")) if report.get("memtracker_peak") else None
        where = f"MemTracker, {sampled.group(0)}" if sampled else "CUDA peak"
        sources[f"measured ({where})"] = [split[k] for k in AT_PEAK]
    planned = ((report or {}).get("config") or {}).get("planned_bytes")  # train.micro_batch_size: auto
    if planned and sources:
        sources["planned"] = [planned.get(k, 0) for k in AT_PEAK]
    if not sources:
        ax.text(
            0.5,
            0.5,
            "no breakdown: no optimizer window\nwas sampled (a run of one step?)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_axis_off()
        return
    bottoms = [0.0] * len(sources)
    for j, key in enumerate(AT_PEAK):
        values = [v[j] / MIB for v in sources.values()]
        ax.bar(list(sources), values, bottom=bottoms, label=key.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("MiB at the peak")
    ax.set_title("where the peak went")
    ax.legend(fontsize=7)


def latest_report(run_dir: Path) -> dict[str, Any] | None:
    """memory.json of the newest checkpoint that has one, else the run's final summary (<run>/memory.json)."""
    paths = sorted((Path(run_dir) / "checkpoints").glob("step_*/memory.json"), reverse=True)
    for path in [*paths, Path(run_dir) / "memory.json"]:
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return None


def run_peak_bytes(metrics_file: Path) -> int | None:
    """The highest `peak_memory_bytes` of metrics.jsonl's training rows: the run's peak (CUDA allocated, else RSS)."""
    peaks = []
    if metrics_file.is_file():
        for row in read_jsonl(metrics_file):
            if row.get("peak_memory_bytes") is not None:
                peaks.append(int(row["peak_memory_bytes"]))
    return max(peaks) if peaks else None


def report_table(run_dir: Path) -> str:
    """`finetune report RUN_DIR`: one row per checkpoint with its memory report, then the run's final summary.

    Raises:
        UserError: `run_dir` is not a run directory.
    """
    root = Path(run_dir) / "checkpoints"
    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir} is not a run directory")
    reports = []
    files = sorted(root.glob("step_*/memory.json")) if root.is_dir() else []
    for f in [*files, Path(run_dir) / "memory.json"]:
        if f.is_file():
            try:
                reports.append(json.loads(f.read_text()) | ({"step": "final"} if f.parent == Path(run_dir) else {}))
            except json.JSONDecodeError:
                continue
    if not reports:
        return f"{run_dir}: no memory report (a run writes memory.json when it finishes, a checkpoint its own)"
    head = ["step", "peak", "params", "grads", "optim", "activ", "temps", "all grads", "device peak", "breakdown"]
    rows = []
    for r in reports:
        cuda, cpu = r.get("cuda"), r.get("cpu") or {}
        device_peak = (
            f"{_mib(cuda['peak_allocated_bytes'])} alloc / {_mib(cuda['peak_reserved_bytes'])} resv"
            if cuda
            else f"{_mib(cpu.get('peak_rss_bytes'))} RSS"
        )
        method = r["breakdown_method"].split(" (")[0]
        split = at_peak(r) or {}
        rows.append(
            [
                str(r["step"]),
                _mib(r.get("peak_bytes")),
                *(_mib(split.get(k)) for k in AT_PEAK),
                _mib(r.get("gradients_bytes")),
                device_peak,
                method,
            ]
        )
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i < len(head) - 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    cfg = reports[-1].get("config", {})
    lines = [
        f"memory per checkpoint and at the end of {run_dir} (MiB; {', '.join(f'{k}={v}' for k, v in cfg.items())})",
        fmt(head),
        fmt(["-" * w for w in widths]),
    ]
    lines += [fmt(r) for r in rows]
    lines.append(
        "params to temps split the peak (they sum to it; grads are those alive then); all grads: every "
        ".grad tensor at the optimizer step"
    )
    return "\n".join(lines)
