"""What `train()` builds before its loop: the model under its precision policy, the batch layout, the
evaluation loaders, the checkpoint to resume from, the run directory's description files, and the
objects and lines that describe the run. Nothing here runs a training step.

Kept out of train.py so that train.py holds the loop and its parts; every function here is called
once, in order, from `train()`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from finetune.config.files import dump_config
from finetune.config.schema import Config
from finetune.core.fileio import METRICS_FILE
from finetune.data.build import Data, build_eval_loader
from finetune.data.packing import check_packing
from finetune.memory import monitor as mem
from finetune.memory.planner import resolve_micro_batch
from finetune.model.load import build_model, check_quantized_autocast, count_parameters
from finetune.model.precision import (
    PrecisionMonitor,
    apply_precision_policy,
    audit_json,
    check_audit,
    compile_model,
    dtype_audit,
)
from finetune.model.probe import probe_head
from finetune.training import checkpoint as ckpt
from finetune.training.checkpoint import TrainingProgress
from finetune.training.nodes import check_shared_storage
from finetune.training.runtime import progress_bar, provenance

logger = logging.getLogger("finetune")


def train_targets(data: Data) -> torch.Tensor | None:
    """The training labels as one tensor (multi-hot rows or scores), for the head's starting point."""
    if data.problem_type == "single_label_classification" or "labels" not in data.train.column_names:
        return None
    labels = data.train["labels"][:]
    if "gold" in data.train.column_names:  # distillation: an unlabeled row's label is a placeholder
        labels = [y for y, gold in zip(labels, data.train["gold"][:], strict=True) if gold]
    return torch.tensor(labels, dtype=torch.float64)


def start_head(cfg: Config, model: torch.nn.Module, data: Data, tokenizer: Any, resume_from: Path | None) -> list[str]:
    """`model.head_init=probe` on a fresh run: the output layer fitted to the training rows' features
    (model/probe.py); a resumed run's head comes from its checkpoint. Returns the log lines."""
    if cfg.model.head_init != "probe" or resume_from is not None:
        return []
    micro = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 32
    loader = build_eval_loader(data.train, tokenizer, micro, cfg.data.num_workers)
    return [probe_head(model, loader)]


def build_policy_model(
    cfg: Config,
    label_names: list[str],
    tokenizer: Any,
    targets: torch.Tensor | None = None,
    notes: list[str] | None = None,
) -> tuple[torch.nn.Module, dict, list[str]]:
    """The model with the precision policy applied (bf16-true cast, fp32 norms), audited, then
    compiled in place (this order); returns it with its dtype audit and the fp32 norm modules.

    Raises:
        UserError: the model cannot be built, packs badly, or contradicts the precision policy.
    """
    check_quantized_autocast(cfg)
    model = build_model(cfg, label_names, tokenizer, targets=targets, notes=notes)
    if cfg.data.packing:
        check_packing(model)
    prec = cfg.precision
    norm_names = apply_precision_policy(model, prec.mode, prec.fp32_norms, prec.norm_class_names)
    audit = dtype_audit(model, prec.mode, prec.fp32_norms, norm_names=norm_names)
    check_audit(audit, prec.allow_dtype_mismatch)
    if cfg.model.compile:
        compile_model(model, cfg.model.compile_backend, cfg.model.compile_mode, cfg.model.compile_dynamic)
    return model, audit, norm_names


def build_eval_loaders(cfg: Config, data: Data, tokenizer: Any, batch_size: int) -> tuple[Any, Any]:
    """Validation and test loaders (None where the split is absent); batches are global, as in training."""

    def build(ds: Any) -> Any:
        return build_eval_loader(ds, tokenizer, batch_size, cfg.data.num_workers) if ds is not None else None

    return build(data.validation), build(data.test)


def find_resume(cfg: Config, accelerator: Accelerator, run_dir: Path, data: Data) -> Path | None:
    """The checkpoint to resume from (None: start fresh).

    Temporaries of an interrupted save are settled first: a complete `.trash-step_<N>` whose
    replacement never landed is renamed back, so resume finds the newest checkpoint.

    Raises:
        UserError: the checkpoint is incomplete, belongs to another config or other data, or was
            saved in a layout this launch cannot load (with FSDP or without).
    """
    if cfg.checkpoint.resume is not None and run_dir.is_dir() and accelerator.is_main_process:
        ckpt.cleanup_stale(run_dir)
    accelerator.wait_for_everyone()
    found = ckpt.find_resume_checkpoint(cfg.checkpoint.resume, run_dir, cfg.model_dump(mode="json"), data.sha256)
    if found is not None:
        ckpt.check_state_layout(found, accelerator)  # FSDP's files or a whole model: what load_state reads
    return found


def prepare_run_dir(
    cfg: Config, accelerator: Accelerator, run_dir: Path, data: Data, audit: dict, resume_from: Path | None
) -> None:
    """Create (or replace) the run directory and write the run's description files.

    Raises:
        UserError: a rank does not see the directory the main process wrote (`nodes.check_shared_storage`).
    """
    if accelerator.is_main_process:
        if cfg.run.overwrite and resume_from is None:
            ckpt.clear_run_dir(run_dir, keep_teacher=cfg.distill.teacher is not None)
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.cleanup_stale(run_dir)  # temporaries of a save or rotation that a crash interrupted
        if resume_from is None:
            ckpt.trim_metrics(run_dir / METRICS_FILE, 0)  # a restart of this config logs from step 0 again
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        (run_dir / "labels.json").write_text(json.dumps(data.label_names))
        (run_dir / "provenance.json").write_text(json.dumps(provenance(data.files, data.sha256), indent=2))
        (run_dir / "data_report.json").write_text(json.dumps(data.report, indent=2))
        (run_dir / "dtype_audit.json").write_text(audit_json(audit))
    accelerator.wait_for_everyone()
    check_shared_storage(accelerator, run_dir)  # several nodes: all see what the main process wrote


def disk_need(cfg: Config, model: torch.nn.Module) -> int:
    """Bytes the run may write: checkpoints (weights + optimizer state) and final/."""
    weights = mem.parameter_bytes(model) + mem.buffer_bytes(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = {"adamw": 8, "adamw8bit": 2, "adafactor": 1, "sgd": 4 * (cfg.train.momentum > 0)}[cfg.train.optimizer]
    return ckpt.estimate_disk_need(
        weights + trained * state, weights, cfg.checkpoint.keep_last, cfg.checkpoint.every_steps is not None
    )


def memory_summary(cfg: Config, progress: TrainingProgress) -> dict[str, Any]:
    """The settings a memory report names."""
    return {
        "precision": cfg.precision.mode,
        "micro_batch_size": progress.micro_batch_size,
        "gradient_accumulation_steps": progress.gradient_accumulation_steps,
        "processes": progress.num_processes,
        "max_length": cfg.data.max_length,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "optimizer": cfg.train.optimizer,
        "lora": cfg.model.lora is not None,
    }


def batch_layout(cfg: Config, accelerator: Accelerator, tokenizer: Any, data: Data) -> tuple[int, int, Any]:
    """(micro-batch, accumulation, the plan when micro-batch was auto) per process, set on the accelerator.

    Raises:
        UserError: the batch settings disagree with the process count, or no micro-batch fits.
    """
    P = accelerator.num_processes
    shards = P if accelerator.distributed_type == "FSDP" else 1
    micro, G, planned = resolve_micro_batch(cfg, P, accelerator.device.type, tokenizer, data.label_names, shards)
    accelerator.gradient_accumulation_steps = G
    return micro, G, planned


def describe_setup(
    cfg: Config, model: torch.nn.Module, data: Data, layout: tuple[int, int, int], steps: tuple[int, int], threads: int
) -> str:
    """The run's one-line summary: parameters, labels, precision, batch layout, steps, threads."""
    (micro, G, P), (total_steps, num_epochs) = layout, steps
    trainable, total_params = count_parameters(model)
    return (
        f"model: {trainable:,} trainable / {total_params:,} parameters; {len(data.label_names)} labels; "
        f"precision {cfg.precision.mode}; {P} process(es) x micro-batch {micro} x accumulation {G} "
        f"= effective batch {micro * G * P}; {total_steps} optimizer steps over {num_epochs} epoch(s); "
        f"{threads} CPU thread(s) per process"
    )


def precision_monitor(cfg: Config, accelerator: Accelerator, run_dir: Path) -> PrecisionMonitor:
    """The run's `PrecisionMonitor`; a non-finite stop names the newest checkpoint at that moment."""
    return PrecisionMonitor(
        cfg.precision.mode,
        cfg.train.nonfinite,
        accelerator.scaler,
        cfg.model.compile,
        accelerator.num_processes,
        lambda: (ckpt.list_checkpoints(run_dir) or [None])[-1],
    )


def fresh_progress(cfg: Config, data: Data, micro: int, G: int, P: int) -> TrainingProgress:
    """A new run's progress at step 0 in this launch's layout."""
    return TrainingProgress(
        data_seed=cfg.run.seed,
        micro_batch_size=micro,
        gradient_accumulation_steps=G,
        num_processes=P,
        best_metric=cfg.checkpoint.best_metric,
        data_sha256=data.sha256,
    )


def step_bar(total_steps: int, initial: int, main_process: bool) -> Any:
    """The optimizer-step progress bar (tqdm on a terminal, timed lines in a log), on the main process only."""
    return progress_bar(
        total=total_steps, initial=initial, desc="train", unit="step", disable=not main_process, dynamic_ncols=True
    )
