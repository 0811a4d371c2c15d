"""Memory planner: predict the peak memory of a training step before the first real one.

`plan(cfg)` builds the configured model (precision mode, gradient checkpointing, frozen
embeddings, LoRA) and optimizer exactly as training does, swaps every parameter and buffer for a
`FakeTensor` (shape, dtype and device, no storage), and runs two optimizer windows on fake
worst-case batches (`data.max_length` tokens) under torch's `MemTracker`. Only the second window
is measured: the first one creates the optimizer state (on the default model the first step
peaks at 1,206 MiB without AdamW state, the second at 1,379). Nothing is allocated, so a
ladder of micro-batch sizes takes seconds on a CPU.

The same `peak.measure_window` runs on real tensors too: `measure_real` / `measure_cuda` in
scripts/benchlib.py, which scripts/bench_memory.py and the tests use to compare prediction and measurement.

Workarounds for what the primitives do not do out of the box (see docs/MEMORY.md):
- MemTracker registers a gradient hook on every parameter and fails on frozen ones (LoRA, frozen
  embeddings): `memory.PeakTracker` hooks only trainable parameters.
- peft cannot build adapters under FakeTensorMode: the real model (adapters included) is built
  first, then its tensors are replaced by fake ones in place (`to_fake`).
- This CPU-only torch build disables `torch.autocast("cuda")`: CUDA mixed precision is planned
  with CPU autocast semantics (an approximation, stated in the output).
- CPU attention kernels keep the L x L probabilities (and dropout masks) for the backward; CUDA's
  flash / memory-efficient kernels do not: a CUDA plan routes `scaled_dot_product_attention`
  through the memory-efficient op (it has fake-tensor support on a CPU-only build) and adds the
  cuBLAS workspaces that `max_memory_allocated` counts (`cuda_attention_for_planning`).
- bitsandbytes' 8-bit AdamW cannot run on fake tensors: a stand-in with the same state layout
  (two uint8 moments plus one fp32 absmax per 256-element block; fp32 moments for tensors under
  4,096 elements, bitsandbytes' `min_8bit_size`) is measured instead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from finetune.config.files import apply_overrides, validate_config
from finetune.config.schema import Config
from finetune.core.errors import UserError
from finetune.data.reading import load_raw_splits
from finetune.data.window import effective_batch, micro_batch_ladder, resolve_batch
from finetune.memory.peak import (
    CATEGORIES,
    CPU_AUTOCAST_NOTE,
    CUDA_ALLOCATOR_FRACTION,
    CUDA_CONTEXT_BYTES,
    Adam8bitStandIn,
    GiB,
    Measurement,
    MiB,
    cublas_workspace_bytes,
    margin_bytes,
    measure_window,
    quantize_for_planning,
    to_fake,
)
from finetune.model.load import build_model, build_tokenizer, classifier_of
from finetune.model.precision import apply_precision_policy, refuse_adamw8bit_off_cuda, refuse_fp16_on_cpu
from finetune.training.optim import build_optimizer

logger = logging.getLogger("finetune")

# ----------------------------------------------------------------------------------------------
# The plan.


@dataclass
class PlanRow:
    """One micro-batch size of the ladder."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    peak_bytes: int
    peak_bytes_with_margin: int
    fits: bool | None
    categories: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Flat JSON row: the keys of `finetune plan --json`."""
        row: dict[str, Any] = {
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "peak_bytes": self.peak_bytes,
            "peak_bytes_with_margin": self.peak_bytes_with_margin,
            "fits": self.fits,
        }
        row.update({f"{k}_bytes": v for k, v in self.categories.items()})
        return row


@dataclass
class Plan:
    """The ladder for one config and device, plus what it assumed."""

    device: str
    effective_batch: int
    num_processes: int
    seq_len: int
    budget_bytes: int | None
    rows: list[PlanRow]
    notes: list[str]

    def best(self) -> PlanRow | None:
        """The largest micro-batch that fits the budget (None when nothing fits)."""
        fitting = [r for r in self.rows if r.fits]
        return max(fitting, key=lambda r: r.micro_batch_size) if fitting else None


def label_names_cheaply(cfg: Config) -> list[str]:
    """Label names without tokenizing: from data.labels / data.label_map, else by reading the data."""
    if cfg.data.labels is not None:
        return list(cfg.data.labels)
    if cfg.data.label_map is not None:
        return list(dict.fromkeys(cfg.data.label_map.values()))
    return load_raw_splits(cfg).label_names


def default_device() -> str:
    """The machine's accelerator: cuda when available, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_plannable(cfg: Config, device: str) -> list[str]:
    """Refuse what cannot run on `device`; return notes on approximations.

    Raises:
        UserError: the setting cannot run on `device` (fp16 or adamw8bit on CPU).
    """
    notes: list[str] = []
    mode = cfg.precision.mode
    if cfg.model.compile:
        notes.append("model.compile is not applied when planning: eager memory (compiled graphs usually need less)")
    refuse_fp16_on_cpu(mode, device, planning=True)
    refuse_adamw8bit_off_cuda(cfg.train.optimizer, device, planning=True)
    if device == "cuda":
        notes.append(
            f"CUDA plan{' on a CPU' if not torch.cuda.is_available() else ''}: attention as CUDA's memory-efficient "
            "kernel keeps it, "
            f"plus {cublas_workspace_bytes() // MiB} MiB of cuBLAS workspaces"
            f"{CPU_AUTOCAST_NOTE if mode in ('bf16', 'fp16') else ''}; "
            f"margin = {CUDA_CONTEXT_BYTES // MiB} MiB CUDA context + {int(CUDA_ALLOCATOR_FRACTION * 100)}% allocator "
            "rounding"
        )
        if cfg.train.optimizer == "adamw8bit":
            notes.append(
                "adamw8bit planned with a stand-in of bitsandbytes' state layout (uint8 moments + fp32 block absmax)"
            )
    return notes


def build_for_planning(
    cfg: Config, label_names: list[str], tokenizer: Any, fake_mode: FakeTensorMode | None = None, device: str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer as training builds them (adamw8bit -> its memory stand-in).

    With `fake_mode`, the real model (adapters included) is converted to fake tensors before
    the optimizer is built, so the optimizer holds the fake parameters.
    """
    torch.manual_seed(cfg.run.seed)
    # fake tensors: an empty model (nothing allocated or loaded), quantized by stand-ins
    model = build_model(cfg, label_names, tokenizer, empty=fake_mode is not None)
    if fake_mode is not None and cfg.model.quantization is not None:
        quantize_for_planning(model, cfg.model.quantization)
    model = apply_precision_for_planning(cfg, model)
    if fake_mode is not None:
        to_fake(model, fake_mode)
    if cfg.train.optimizer == "adamw8bit":
        optimizer: torch.optim.Optimizer = Adam8bitStandIn(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.train.learning_rate
        )
    else:
        optimizer = build_optimizer(cfg, model)
    if device == "cuda":
        # torch's optimizers default to the multi-tensor (foreach) path on CUDA and to the per-tensor
        # loop on CPU; foreach holds temporaries for all parameters at once
        for group in optimizer.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
    return model, optimizer


def apply_precision_for_planning(cfg: Config, model: nn.Module) -> nn.Module:
    """The precision policy training applies (bf16-true cast, fp32 norms)."""
    prec = cfg.precision
    apply_precision_policy(model, prec.mode, prec.fp32_norms, prec.norm_class_names)
    return model


def fake_batch_factory(
    tokenizer: Any, micro: int, seq_len: int, num_labels: int
) -> Callable[[], dict[str, torch.Tensor]]:
    """Worst-case batches (every row `seq_len` tokens) made in whatever tensor mode is active."""
    names = getattr(tokenizer, "model_input_names", ["input_ids", "attention_mask"])

    def make() -> dict[str, torch.Tensor]:
        batch = {"input_ids": torch.ones(micro, seq_len, dtype=torch.long)}
        if "attention_mask" in names:
            batch["attention_mask"] = torch.ones(micro, seq_len, dtype=torch.long)
        if "token_type_ids" in names:
            batch["token_type_ids"] = torch.zeros(micro, seq_len, dtype=torch.long)
        batch["labels"] = torch.zeros(micro, dtype=torch.long)
        return batch

    return make


EXTRAPOLATE_ABOVE = 6


def extrapolation_note(cfg: Config) -> list[str]:
    """The note a plan of a deep model given by its dimensions carries."""
    layers = int((cfg.model.architecture or cfg.model.plan_architecture or {}).get("num_hidden_layers", 0))
    if layers <= EXTRAPOLATE_ABOVE:
        return []
    return [f"{layers} layers planned at 2 and 4 layers and extrapolated per layer (exact: docs/MEMORY.md)"]


def with_layers(cfg: Config, n: int) -> Config:
    """`cfg` with `n` layers in its `model.architecture` / `model.plan_architecture`."""
    key = "architecture" if cfg.model.architecture is not None else "plan_architecture"
    arch = dict(getattr(cfg.model, key))
    arch["num_hidden_layers"] = n
    arch.pop("layer_types", None)  # a per-layer list written out would contradict the count
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={key: arch})})


def predict_peak(
    cfg: Config,
    micro: int,
    accumulation: int,
    tokenizer: Any,
    label_names: list[str],
    seq_len: int | None = None,
    device: str = "cpu",
) -> Measurement:
    """Predicted peak of one window at micro-batch `micro` (fake tensors: nothing allocated).

    A model given by its dimensions with more than `EXTRAPOLATE_ABOVE` layers is planned at 2 and
    4 layers and extrapolated linearly, phase by phase and category by category: every layer adds
    the same weights, gradients, state and saved activations, so each phase's peak (the passes',
    the optimizer step's) is affine in the layer count, but the window's peak is the larger of the
    two, and which one can change with the depth (checked against the full plan in docs/MEMORY.md);
    a 24-layer model then plans in seconds.
    """
    arch = cfg.model.architecture or cfg.model.plan_architecture
    layers = int((arch or {}).get("num_hidden_layers", 0))
    if layers > EXTRAPOLATE_ABOVE:
        two, four = (
            predict_peak(with_layers(cfg, n), micro, accumulation, tokenizer, label_names, seq_len, device)
            for n in (2, 4)
        )
        return extrapolate(two, four, layers)
    seq_len = seq_len or cfg.data.max_length
    # building a model draws from the global RNG: keep the training run's random stream untouched
    with torch.random.fork_rng(devices=[]):
        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        model, optimizer = build_for_planning(cfg, label_names, tokenizer, fake_mode, device)
        make = fake_batch_factory(tokenizer, micro, seq_len, len(label_names))
        with fake_mode:
            return measure_window(
                model, optimizer, make, accumulation, cfg.precision.mode, cfg.train.max_grad_norm, device
            )


def extrapolate(two: Measurement, four: Measurement, layers: int) -> Measurement:
    """The peak at `layers` layers from the plans at 2 and 4: each phase's categories extended by
    their growth per layer, then the larger phase (a shallow model can peak in its optimizer step
    and a deep one in its backward)."""
    phases = {}
    for name, at2 in two.phases.items():
        at4 = four.phases[name]
        phases[name] = {k: int(round(at2[k] + (at4[k] - at2[k]) / 2 * (layers - 2))) for k in at2}
    categories = max(phases.values(), key=lambda c: sum(c.values()))
    return Measurement(sum(categories.values()), dict(categories), phases)


def fsdp_units(model: nn.Module) -> list[int]:
    """Parameter bytes of each unit FSDP2 gathers at once, as Accelerate wraps a model: every block of
    its layer list (the longest `nn.ModuleList`: BertLayer, LlamaDecoderLayer, ...), the input
    embeddings, and the root holding the rest (the head)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    blocks = list(max(lists, key=len)) if lists else []
    embeddings = getattr(classifier_of(model), "get_input_embeddings", lambda: None)()
    owned: set[int] = set()
    units = []
    for unit in [*blocks, *([embeddings] if embeddings is not None else []), model]:
        params = [p for p in unit.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        units.append(sum(p.numel() * p.element_size() for p in params))
    return units


def shard_measurement(m: Measurement, units: list[int], shards: int) -> Measurement:
    """One FSDP rank's peak from the one-process plan: parameters, gradients and optimizer state
    divided by the shard count, plus the largest unit gathered whole twice (FSDP2's all-gather output
    and the unsharded parameters it is copied into). A unit's unsharded gradient, before its
    reduce-scatter, is the gradient one process holds anyway (among its temporaries or gradients).
    Measured on 2 CPU processes (docs/MEMORY.md): full fine-tuning and LoRA within 3% on each rank."""
    c = dict(m.categories)
    for k in ("parameters", "gradients", "optimizer_state"):
        c[k] = -(-c[k] // shards)
    c["temporaries"] += 2 * max(units)
    return Measurement(sum(c.values()), c)


def plan(
    cfg: Config,
    device: str | None = None,
    budget_gb: float | None = None,
    micro_sizes: list[int] | None = None,
    num_processes: int = 1,
    tokenizer: Any = None,
    label_names: list[str] | None = None,
    shards: int = 1,
) -> Plan:
    """Predict the peak of a training window for each micro-batch size of the ladder (per FSDP rank
    with `shards` > 1: `shard_measurement`)."""
    device = device or default_device()
    notes = check_plannable(cfg, device)
    budget_gb = budget_gb if budget_gb is not None else cfg.memory.budget_gb
    budget = int(budget_gb * GiB) if budget_gb is not None else None
    E = effective_batch(cfg, num_processes)
    per_process = E // num_processes
    sizes = micro_sizes or micro_batch_ladder(per_process)
    notes += extrapolation_note(cfg)
    if tokenizer is None:
        tokenizer, note = planning_tokenizer(cfg)
        notes += [note] if note else []
    label_names = label_names or label_names_cheaply(cfg)
    units = planned_units(cfg, label_names, tokenizer, shards, notes)
    rows = []
    for micro in sizes:
        G = max(1, per_process // micro)
        m = predict_peak(cfg, micro, G, tokenizer, label_names, device=device)
        m = shard_measurement(m, units, shards) if units else m
        with_margin = m.peak_bytes + margin_bytes(m.peak_bytes, device)
        rows.append(
            PlanRow(
                micro, G, m.peak_bytes, with_margin, None if budget is None else with_margin <= budget, m.categories
            )
        )
    return Plan(device, E, num_processes, cfg.data.max_length, budget, rows, notes)


def planned_units(cfg: Config, label_names: list[str], tokenizer: Any, shards: int, notes: list[str]) -> list[int]:
    """FSDP's units of the configured model (fake tensors), with a note; none with one shard."""
    if shards <= 1:
        return []
    with torch.random.fork_rng(devices=[]):
        model, _ = build_for_planning(cfg, label_names, tokenizer, FakeTensorMode(allow_non_fake_inputs=False))
    units = fsdp_units(model)
    notes.append(
        f"FSDP, {shards} shards: parameters, gradients and optimizer state per rank, plus the largest "
        f"unit gathered whole, twice ({max(units) / MiB:,.1f} MiB of parameters)"
    )
    return units


def format_plan(p: Plan, cfg: Config) -> str:
    """The plan as a table (MiB) with its assumptions."""
    budget = (
        f"{p.budget_bytes / GiB:g} GiB" if p.budget_bytes is not None else "none (set --budget-gb or memory.budget_gb)"
    )
    lines = [
        f"memory plan: {cfg.model.name_or_path or 'architecture from config'}, precision {cfg.precision.mode}, "
        f"optimizer {cfg.train.optimizer}, gradient checkpointing "
        f"{'on' if cfg.model.gradient_checkpointing else 'off'}, "
        f"LoRA {'r=' + str(cfg.model.lora.r) if cfg.model.lora else 'off'}, frozen embeddings "
        f"{'on' if cfg.model.freeze_embeddings else 'off'}",
        f"device {p.device}; effective batch {p.effective_batch} ({p.num_processes} process(es)); worst case "
        f"{p.seq_len} tokens per row; budget {budget}",
    ]
    shown = CATEGORIES if p.device == "cuda" else tuple(k for k in CATEGORIES if k != "cublas_workspace")
    head = [
        "micro",
        "accum",
        "peak MiB",
        "+margin",
        "params",
        "grads",
        "optim",
        "activ",
        "temps",
        *(["cublas"] * (p.device == "cuda")),
        "fits",
    ]
    table = [head]
    for r in p.rows:
        c = r.categories
        table.append(
            [
                str(r.micro_batch_size),
                str(r.gradient_accumulation_steps),
                f"{r.peak_bytes / MiB:,.0f}",
                f"{r.peak_bytes_with_margin / MiB:,.0f}",
                *(f"{c[k] / MiB:,.0f}" for k in shown),
                {None: "-", True: "yes", False: "no"}[r.fits],
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in table]
    lines += [f"note: {n}" for n in p.notes]
    best = p.best()
    if p.budget_bytes is not None:
        lines.append(
            f"choice: micro-batch {best.micro_batch_size} x accumulation {best.gradient_accumulation_steps}"
            if best
            else "nothing fits: try precision.mode=bf16, model.gradient_checkpointing=true, model.lora, "
            "or a shorter data.max_length"
        )
    return "\n".join(lines)


def plan_json(p: Plan) -> str:
    """`--json`: the list of rows."""
    return json.dumps([r.to_json() for r in p.rows], indent=2)


# ----------------------------------------------------------------------------------------------
# At run time: the micro-batch to train with, and out-of-memory recovery.


def choose_micro_batch(
    cfg: Config, num_processes: int, device: str, tokenizer: Any, label_names: list[str], shards: int = 1
) -> tuple[int, int, dict[str, int]]:
    """`train.micro_batch_size: auto`: the largest micro-batch whose planned peak (with margin)
    fits `memory.budget_gb`; accumulation makes up `train.batch_size`. Returns the plan's categories too.

    Raises:
        UserError: even micro-batch 1 does not fit the budget.
    """
    assert cfg.memory.budget_gb is not None and cfg.train.batch_size is not None
    check_plannable(cfg, device)
    budget = int(cfg.memory.budget_gb * GiB)
    per_process = cfg.train.batch_size // num_processes
    units = planned_units(cfg, label_names, tokenizer, shards, [])
    smallest = None
    for micro in reversed(micro_batch_ladder(per_process)):  # the peak grows with the micro-batch
        G = per_process // micro
        m = predict_peak(cfg, micro, G, tokenizer, label_names, device=device)
        m = shard_measurement(m, units, shards) if units else m
        need = m.peak_bytes + margin_bytes(m.peak_bytes, device)
        logger.info(
            f"memory plan: micro-batch {micro} x accumulation {G}: {need / MiB:,.0f} MiB planned on {device} (budget "
            f"{budget / MiB:,.0f} MiB)"
        )
        if need <= budget:
            return micro, G, dict(m.categories)
        smallest = need
    raise UserError(
        f"memory.budget_gb={cfg.memory.budget_gb:g}: even micro-batch 1 needs {smallest / GiB:.2f} GiB on {device}; "
        "try precision.mode=bf16, model.gradient_checkpointing=true, model.lora, model.freeze_embeddings, "
        "train.optimizer=adafactor or a shorter data.max_length (`finetune plan` shows where the memory goes)"
    )


def resolve_micro_batch(
    cfg: Config, num_processes: int, device: str, tokenizer: Any, label_names: list[str], shards: int = 1
) -> tuple[int, int, dict[str, int] | None]:
    """(micro-batch, accumulation) per process: explicit, derived from `train.batch_size`, or planned
    (auto, then with the plan's bytes per category for the memory report; per FSDP rank with `shards`)."""
    micro, G, _ = resolve_batch(cfg, num_processes)
    planned = None
    if micro is None:
        micro, G, planned = choose_micro_batch(cfg, num_processes, device, tokenizer, label_names, shards)
        logger.info(
            f"train.micro_batch_size=auto: micro-batch {micro} x accumulation {G} x {num_processes} process(es) = "
            f"{cfg.train.batch_size}"
        )
    assert G is not None
    return micro, G, planned


# ----------------------------------------------------------------------------------------------
# `finetune plan --grid`: the memory settings side by side for a model, from its dimensions alone.


class PlanningTokenizer:
    """What planning reads from a tokenizer, for a model whose tokenizer cannot be loaded (offline):
    the vocabulary size (`model.architecture.vocab_size`), the input names, a pad id."""

    model_input_names = ("input_ids", "attention_mask")

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.pad_token_id = 0  # decoders pool the last non-pad token: any id plans the same memory

    def __len__(self) -> int:
        return self.vocab_size


def planning_tokenizer(cfg: Config) -> tuple[Any, str | None]:
    """The configured tokenizer, else (unreachable, and the dimensions name a vocabulary) a
    `PlanningTokenizer`; returns a note when it stands in.

    Raises:
        UserError: the tokenizer cannot be loaded and no vocab_size is written out.
    """
    try:
        return build_tokenizer(cfg), None
    except UserError as exc:
        arch = cfg.model.architecture or cfg.model.plan_architecture or {}
        if "vocab_size" not in arch:
            raise
        return PlanningTokenizer(int(arch["vocab_size"])), f"tokenizer not loaded ({exc}); planned from vocab_size"


# (name, overrides): the settings of the grid; LoRA keeps the config's adapters (else r=16 on the
# family's default targets) and the config's gradient checkpointing
GRID_SETTINGS: list[tuple[str, list[str]]] = [
    ("fp32", ["precision.mode=fp32", "model.lora=null", "model.quantization=null"]),
    ("bf16 autocast", ["precision.mode=bf16", "model.lora=null", "model.quantization=null"]),
    ("bf16-true", ["precision.mode=bf16-true", "model.lora=null", "model.quantization=null"]),
    ("LoRA, bf16-true base", ["precision.mode=bf16-true", "model.quantization=null"]),
    ("QLoRA, 4-bit base", ["precision.mode=bf16", "model.quantization=4bit"]),
]


@dataclass
class GridCell:
    """One setting at one micro-batch and length."""

    setting: str
    micro_batch_size: int
    seq_len: int
    peak_bytes: int
    peak_bytes_with_margin: int
    categories: dict[str, int] = field(default_factory=dict)


def grid_config(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with one grid setting applied (LoRA r=16 where the setting needs adapters and the
    config has none).

    Raises:
        UserError: the setting contradicts the config (e.g. a precision mode its family refuses).
    """
    raw = cfg.model_dump(mode="json")
    if cfg.model.lora is None and "model.lora=null" not in overrides:
        overrides = [*overrides, "model.lora={r: 16}"]
    return validate_config(apply_overrides(raw, overrides), "plan --grid")


def plan_grid(
    cfg: Config, device: str, micro_sizes: list[int], lengths: list[int], tokenizer: Any, label_names: list[str]
) -> list[GridCell]:
    """The predicted peak of every GRID_SETTINGS entry x micro-batch x length (accumulation 2:
    a window of any G >= 2 peaks like one of 2)."""
    cells = []
    for name, overrides in GRID_SETTINGS:
        variant = grid_config(cfg, overrides)
        for length in lengths:
            for micro in micro_sizes:
                m = predict_peak(variant, micro, 2, tokenizer, label_names, seq_len=length, device=device)
                cells.append(
                    GridCell(
                        name,
                        micro,
                        length,
                        m.peak_bytes,
                        m.peak_bytes + margin_bytes(m.peak_bytes, device),
                        dict(m.categories),
                    )
                )
    return cells


def format_grid(cells: list[GridCell], cfg: Config, device: str, notes: list[str]) -> str:
    """The grid as a table: one row per setting, one column per (length, micro-batch), MiB with margin."""
    m = cfg.model
    source = m.source if m.architecture is None else "architecture from config"
    dims = m.architecture or m.plan_architecture
    # a model without given dimensions is planned from its config.json on the meta device
    how = f"{dims.get('model_type', '?')}, planned from its dimensions" if dims else "planned from its config.json"
    cols = sorted({(c.seq_len, c.micro_batch_size) for c in cells})
    head = ["setting", *(f"L{length} x{micro}" for length, micro in cols)]
    table = [head]
    for name, _ in GRID_SETTINGS:
        by = {(c.seq_len, c.micro_batch_size): c for c in cells if c.setting == name}
        table.append([name, *(f"{by[k].peak_bytes_with_margin / MiB:,.0f}" for k in cols)])
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = [
        f"memory grid: {source} ({how}: nothing allocated), "
        f"device {device}, optimizer {cfg.train.optimizer}, gradient checkpointing "
        f"{'on' if m.gradient_checkpointing else 'off'}, LoRA {'r=' + str(m.lora.r) if m.lora else 'r=16'}",
        f"peak MiB{' with margin (CUDA context + allocator)' if device == 'cuda' else ''} of one optimizer window; "
        "columns: tokens per row x micro-batch",
    ]
    lines += [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
        for r in table
    ]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def plan_command(
    cfg: Config,
    device: str | None,
    budget_gb: float | None,
    micro: list[int] | None,
    processes: int,
    fsdp: bool,
    as_json: bool,
) -> str:
    """`finetune plan`: the ladder's plan as a table (or JSON), after the arguments are checked against the config.

    Raises:
        UserError: a non-positive budget or process count, a micro-batch that does not divide the per-process
            batch, or a batch layout that does not agree.
    """
    if budget_gb is not None and budget_gb <= 0:
        raise UserError("--budget-gb must be positive")
    if processes < 1:
        raise UserError("--num-processes must be at least 1")
    if cfg.train.micro_batch_size == "auto" or cfg.train.batch_size is not None:
        resolve_batch(cfg, processes)  # batch_size, micro-batch and accumulation must agree
    per_process = effective_batch(cfg, processes) // processes
    bad = [m for m in micro or [] if m < 1 or per_process % m]
    if bad:
        raise UserError(
            f"--micro {bad}: a micro-batch must divide the {per_process} samples per process of the effective batch"
        )
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the model is built once per ladder row
    p = plan(cfg, device, budget_gb, micro, processes, shards=processes if fsdp else 1)
    return plan_json(p) if as_json else format_plan(p, cfg)


def grid_command(
    cfg: Config, device: str | None, micro: list[int] | None, lengths: list[int] | None, as_json: bool
) -> str:
    """`finetune plan --grid`: fp32 / bf16 / bf16-true / LoRA / QLoRA at each micro-batch and length, as a table (or
    JSON).

    Raises:
        UserError: a non-positive micro-batch or length, or 8-bit Adam planned off CUDA.
    """
    bad = [x for x in [*(micro or []), *(lengths or [])] if x < 1]
    if bad:
        raise UserError(f"--micro and --lengths must be positive: {bad}")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    device = device or default_device()
    # before the tokenizer loads; the grid's settings change the precision mode, never the optimizer
    refuse_adamw8bit_off_cuda(cfg.train.optimizer, device, planning=True)
    tokenizer, note = planning_tokenizer(cfg)
    names = label_names_cheaply(cfg)
    cells = plan_grid(cfg, device, micro or [1, 4, 16], lengths or sorted({cfg.data.max_length, 512}), tokenizer, names)
    if as_json:
        return json.dumps([vars(c) for c in cells], indent=2)
    return format_grid(cells, cfg, device, extrapolation_note(cfg) + ([note] if note else []))
