"""Fine-tune a text classifier: `accelerate launch finetune/train.py --config CONFIG [key=value ...]`.

Setup lives in assemble.py (small functions returning plain objects); `train()` is the one loop, read
top to bottom; one accumulation window, one optimizer step, a log row, an evaluation, a checkpoint and
the final phase are the named helpers below it. The run's progress is `TrainingProgress`, which is
also a checkpoint's progress.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python finetune/train.py` / `accelerate launch finetune/train.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from finetune.assemble import (
    batch_layout,
    build_eval_loaders,
    build_policy_model,
    describe_setup,
    disk_need,
    find_resume,
    fresh_progress,
    memory_summary,
    precision_monitor,
    prepare_run_dir,
    start_head,
    step_bar,
    train_targets,
)
from finetune.config.files import dump_config, flat_config, load_config
from finetune.config.schema import Config
from finetune.config.tasks import SINGLE
from finetune.core import faults
from finetune.core.errors import UserError
from finetune.core.fileio import METRICS_FILE
from finetune.data.build import Data, build_data, build_eval_loader, build_train_loader, format_data_report
from finetune.data.packing import attention_cost, packed_logits
from finetune.data.window import OutOfMemoryGuard, adapt_to_launch, window_loss
from finetune.deploy.card import write_model_card
from finetune.deploy.final import export_final, prediction_config
from finetune.deploy.teacher import teacher_outputs
from finetune.evaluation.calibrate import calibrate, fold_temperature, plot_reliability, report_on_test
from finetune.evaluation.metrics import (
    Outputs,
    bootstrap_ci,
    collect_outputs,
    eval_row,
    final_summary,
    headline,
    plot_curves,
    prediction_rows,
    record_row,
    score,
)
from finetune.memory import monitor as mem
from finetune.model.load import build_tokenizer, check_max_length, choose_pad_token
from finetune.model.precision import (
    PrecisionMonitor,
    audit_json,
    dtype_audit,
    format_audit,
    fp32_distill_loss,
    fp32_pair_losses,
    fp32_per_sample_loss,
    release_cached_memory,
)
from finetune.model.probe import head_input, probe_head
from finetune.training import checkpoint as ckpt
from finetune.training.budget import TimeBudget
from finetune.training.checkpoint import TrainingProgress
from finetune.training.nodes import node_loss_line
from finetune.training.optim import (
    build_optimizer,
    build_scheduler,
    clipping_folds_into_step,
    describe_groups,
    fold_clipping_into_step,
    planned_steps,
)
from finetune.training.ranks import end_if_peer_lost, end_job, on_peer_lost, several_processes
from finetune.training.runtime import (
    Preempted,
    PreemptionGuard,
    apply_num_threads,
    build_accelerator,
    configure_kernels,
    optimizer_step_out_of_memory,
    progress_log,
    resume_hint,
    setup_logging,
    tracker_init_kwargs,
)
from finetune.training.trackers import start_trackers

logger = logging.getLogger("finetune")


# ----------------------------------------------------------------------------------------------
# What the loop carries.


@dataclass
class LogSums:
    """Sums since the last log line, kept on the device so the step has no host sync: weighted loss,
    loss weight, real tokens, total tokens, rows (weight-0 fill rows excluded); `started` is when the
    interval began (evaluation time excluded)."""

    values: torch.Tensor
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def zeros(cls, device: torch.device) -> LogSums:
        return cls(torch.zeros(5, device=device))

    def reduce(self, accelerator: Accelerator) -> list[float]:
        """The sums of all processes (a collective: every process calls it)."""
        return accelerator.reduce(self.values.clone(), "sum").tolist()

    def reset(self) -> None:
        self.values.zero_()
        self.started = time.perf_counter()


@dataclass(kw_only=True)
class Run:
    """What the loop's helpers share (no behaviour of its own): the objects setup builds, the run's progress
    (`TrainingProgress`, which a checkpoint writes as progress.json) and the log interval's sums."""

    cfg: Config
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    data: Data
    train_loader: Any
    sampler: Any
    eval_loader: Any
    test_loader: Any
    run_dir: Path
    guard: PreemptionGuard
    total_steps: int
    num_epochs: int
    attn_cost: float
    norm_names: list[str]
    precision: PrecisionMonitor
    fold_clip: bool  # gradient clipping folded into the optimizer step
    progress: TrainingProgress
    sums: LogSums
    memory: mem.MemoryMonitor
    bar: Any
    budget: TimeBudget  # train.max_minutes, its clock started with the loop
    report: Callable[[int, dict[str, Any]], None] | None  # train()'s `report`
    oom: OutOfMemoryGuard = field(default_factory=OutOfMemoryGuard)
    outputs: dict[str, Outputs] = field(default_factory=dict)  # each split's latest evaluation, per text
    lean_step: int | None = None  # the epoch's heaviest window's step, run under memory.lean_heap

    @property
    def metrics_file(self) -> Path:
        return self.run_dir / METRICS_FILE


# ----------------------------------------------------------------------------------------------
# The run.


def train(
    cfg: Config, guard: PreemptionGuard | None = None, report: Callable[[int, dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run one fine-tuning job end to end; return the evaluation of what final/ holds.

    With `guard` installed (as `main` does) SIGTERM/SIGINT end the run at the next optimizer step
    with a checkpoint and `Preempted`. `report(step, metrics)` is called after each periodic
    evaluation (`finetune sweep` prunes through it: whatever it raises ends the run there).

    Raises:
        UserError: bad config, data, model or output directory (before anything is written), a full
            disk, or out of memory where no recovery is possible.
        Preempted: a signal stopped the run after its checkpoint was written.
    """
    guard = guard or PreemptionGuard()  # not installed: signals keep their handlers
    run_dir = ckpt.check_output_dir(cfg)
    configure_kernels(cfg.precision.deterministic, cfg.precision.cudnn_attention)  # before CUDA initialises
    threads = apply_num_threads(cfg.run.num_threads)  # before the model is built
    accelerator = build_accelerator(cfg)
    setup_logging(accelerator, None)
    faults.announce()
    set_seed(cfg.run.seed)

    # Everything that can fail on user input happens before the output directory is touched.
    tokenizer = build_tokenizer(cfg)
    check_max_length(cfg, tokenizer)  # before long texts are tokenized
    data = build_data(cfg, tokenizer, teacher_outputs(cfg, accelerator))  # distill.teacher: its logits per row
    pad_note = choose_pad_token(tokenizer, [data.train, data.validation, data.test])  # pad never inside a text
    notes = [pad_note] if pad_note else []  # logged once the run directory's train.log exists
    model, audit, norm_names = build_policy_model(cfg, data.label_names, tokenizer, train_targets(data), notes)
    P = accelerator.num_processes
    micro, G, planned = batch_layout(cfg, accelerator, tokenizer, data)
    attn_cost = attention_cost(model)  # packing: how much a longer row costs in attention
    train_loader, sampler = build_train_loader(data.train, tokenizer, cfg, micro, G, P, attn_cost)
    eval_loader, test_loader = build_eval_loaders(cfg, data, tokenizer, micro * 2 * P)
    total_steps, num_epochs = planned_steps(cfg, sampler.num_windows())
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    resume_from = find_resume(cfg, accelerator, run_dir, data)
    notes += start_head(cfg, model, data, tokenizer, resume_from)  # head_init=probe: a linear probe

    prepare_run_dir(cfg, accelerator, run_dir, data, audit, resume_from)
    setup_logging(accelerator, run_dir)
    logger.info(format_data_report(data.report))
    logger.info(format_audit(audit))
    for note in (*notes, describe_groups(optimizer)):
        if note:
            logger.info(note)
    logger.info(describe_setup(cfg, model, data, (micro, G, P), (total_steps, num_epochs), threads))
    start_trackers(accelerator, flat_config(cfg), tracker_init_kwargs(cfg.log.trackers, run_dir))
    ckpt.warn_if_disk_small(run_dir, disk_need(cfg, model))

    loaders = [x for x in (eval_loader, test_loader) if x is not None]
    model, optimizer, train_loader, scheduler, *loaders = accelerator.prepare(
        model, optimizer, train_loader, scheduler, *loaders
    )
    eval_loader = loaders.pop(0) if eval_loader is not None else None
    test_loader = loaders.pop(0) if test_loader is not None else None
    progress, sums = fresh_progress(cfg, data, micro, G, P), LogSums.zeros(accelerator.device)
    if resume_from is not None:
        progress = resume(accelerator, resume_from, progress, sums, run_dir)
        if (progress.micro_batch_size, progress.gradient_accumulation_steps) != (micro, G):  # an out-of-memory retry
            train_loader, sampler = prepared_train_loader(accelerator, cfg, data, tokenizer, progress, attn_cost)
    was_finished = progress.finished  # a finished run resumed: its final evaluation and checkpoint exist
    summary = memory_summary(cfg, progress) | {"planned_bytes": planned}  # the plan, when micro-batch was auto
    memory = mem.MemoryMonitor(
        accelerator.device, model, optimizer, summary, cfg.memory.record_history, cfg.memory.breakdown
    )
    memory.heaviest_step = heaviest_step(sampler, progress, total_steps)
    run = Run(
        cfg=cfg,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        tokenizer=tokenizer,
        data=data,
        train_loader=train_loader,
        sampler=sampler,
        eval_loader=eval_loader,
        test_loader=test_loader,
        run_dir=run_dir,
        guard=guard,
        total_steps=total_steps,
        num_epochs=num_epochs,
        attn_cost=attn_cost,
        norm_names=norm_names,
        precision=precision_monitor(cfg, accelerator, run_dir),
        progress=progress,
        sums=sums,
        fold_clip=cfg.train.max_grad_norm is not None and clipping_folds_into_step(optimizer, accelerator),
        memory=memory,
        bar=step_bar(total_steps, progress.step, accelerator.is_main_process),
        budget=TimeBudget(cfg.train.max_minutes, progress.seconds_trained, progress.step),
        report=report,
    )
    if progress.step < total_steps and not progress.finished:
        memory.begin_sample(progress.step)  # a resumed run samples its first window (optimizer state exists)

    model.train()
    try:
        while progress.step < total_steps and progress.epoch < num_epochs and not progress.finished:
            loader = epoch_loader(run)
            batches = iter(loader)
            while progress.step < total_steps and not progress.finished:
                with mem.lean_heap(progress.step + 1 == run.lean_step):
                    outcome = run_window(run, batches)
                if outcome == "epoch_end":
                    progress.epoch, progress.batches_in_epoch = progress.epoch + 1, 0
                    release_cached_memory(cfg.precision.empty_cache, accelerator.device)
                    break
                if outcome == "out_of_memory":  # the same epoch, from the failed window, at half the micro-batch
                    recover_from_oom(run, loader)
                    break
                after_step(run)
        return finish(run, was_finished)
    finally:  # a run ended by an error or a signal leaves no MemTracker behind, and its error on a line of its own
        run.memory.close()
        run.bar.close()


# ----------------------------------------------------------------------------------------------
# Resume and the loader after a retry.


def prepared_train_loader(
    acc: Accelerator, cfg: Config, data: Data, tokenizer: Any, progress: TrainingProgress, attn_cost: float
) -> tuple[Any, Any]:
    """A prepared training loader and its sampler at the progress's micro-batch (its windows hold the same samples);
    Accelerate's accumulation follows the progress's."""
    micro, G = progress.micro_batch_size, progress.gradient_accumulation_steps
    loader, sampler = build_train_loader(data.train, tokenizer, cfg, micro, G, acc.num_processes, attn_cost)
    acc.gradient_accumulation_steps = G
    return acc.prepare(loader), sampler


def resume(acc: Accelerator, path: Path, fresh: TrainingProgress, sums: LogSums, run_dir: Path) -> TrainingProgress:
    """Restore model, optimizer, scheduler and RNG states from `path` and the saved partial log interval into
    `sums`; return its progress (its micro-batch may be one an out-of-memory retry lowered: the caller rebuilds the
    loader then).

    Raises:
        UserError: the effective batch of this launch differs from the checkpoint's.
    """
    progress = ckpt.load_checkpoint(acc, path)
    adapt_to_launch(progress, fresh.micro_batch_size, fresh.gradient_accumulation_steps, acc.num_processes, path)
    progress.data_sha256 = fresh.data_sha256
    if (progress.micro_batch_size, progress.gradient_accumulation_steps) != (
        fresh.micro_batch_size,
        fresh.gradient_accumulation_steps,
    ):  # an out-of-memory retry lowered the micro-batch: keep it (batches_in_epoch counts in it)
        logger.info(
            f"resuming with micro-batch {progress.micro_batch_size} x accumulation "
            f"{progress.gradient_accumulation_steps} (chosen after an out-of-memory error)"
        )
    if acc.is_main_process:  # the saved partial log interval (all processes' sums) continues here once
        saved = torch.tensor(progress.log_sums, device=acc.device)  # 4 values before the row count existed
        sums.values[: len(saved)] = saved
        ckpt.trim_metrics(run_dir / METRICS_FILE, progress.step)  # the steps after the checkpoint are logged again
    logger.info(
        f"resumed from {path} at step {progress.step} (epoch {progress.epoch}, {progress.batches_in_epoch} batches in)"
    )
    return progress


# ----------------------------------------------------------------------------------------------
# The loop's parts.


def epoch_loader(run: Run) -> Any:
    """The epoch's loader, past the micro-batches already consumed (a resumed or retried epoch); on a CPU the
    step of its heaviest window, whose heap `memory.lean_heap` keeps lean (memory.lean_heaviest_window)."""
    progress = run.progress
    b = progress.batches_in_epoch
    loader = run.accelerator.skip_first_batches(run.train_loader, b) if b else run.train_loader
    # Accelerate's loader sets the sampler's epoch to its own count of iter() calls; a resumed
    # run has a fresh count, so set both explicitly (same data order as an uninterrupted run)
    loader.set_epoch(progress.epoch)
    run.sampler.set_epoch(progress.epoch)
    lean = run.cfg.memory.lean_heaviest_window and run.accelerator.device.type == "cpu"
    run.lean_step = heaviest_step(run.sampler, progress, run.total_steps) if lean else None
    return loader


def heaviest_step(sampler: Any, progress: TrainingProgress, total_steps: int) -> int:
    """The step of this epoch's window with the most padded tokens, which the memory report samples too."""
    first = progress.epoch * sampler.num_windows()  # the steps of the epochs before
    sampler.set_epoch(progress.epoch)
    return first + sampler.heaviest_window(limit=max(1, total_steps - first)) + 1


def run_window(run: Run, batches: Any) -> str:
    """Forward and backward over one accumulation window's micro-batches, then the optimizer step.

    Returns "step" (a step was taken), "epoch_end" (no batch left) or "out_of_memory" (the window
    failed before its step; its gradients are to be dropped).

    Raises:
        UserError: out of memory with several processes (no rank may redo a window alone).
    """
    acc, cfg, progress = run.accelerator, run.cfg, run.progress
    G, P = progress.gradient_accumulation_steps, acc.num_processes
    # weighted loss, weight, real tokens, total tokens, rows: added to `sums` when the window completes
    window = torch.zeros(5, device=acc.device)
    for batch in batches:
        progress.batches_in_epoch += 1
        faults.signal_point(
            "batch", progress.epoch * len(run.train_loader) + progress.batches_in_epoch, run.run_dir, run.guard
        )
        labels, weight, window_samples = batch.pop("labels"), batch.pop("sample_weight"), batch.pop("window_samples")
        soft = batch.pop("teacher_logits", None), batch.pop("gold", None)  # distillation's teacher outputs
        batch.pop("doc", None)  # which text a window belongs to: evaluation's concern
        run.memory.note_batch(batch["input_ids"].shape)
        pairs = progress.step < cfg.train.contrastive_steps  # the contrastive opening: features, not logits
        with acc.accumulate(run.model), run.oom, head_input(acc.unwrap_model(run.model), pairs) as tap:
            faults.oom_point("oom_at_step", progress.step + 1, (progress.batches_in_epoch - 1) % G, G)
            logits = packed_logits(run.model, batch) if cfg.data.packing else run.model(**batch).logits
            losses = fp32_pair_losses(tap.value, labels) if pairs else sample_losses(cfg, logits, labels, *soft)
            per_sample = faults.nonfinite_point(losses * weight, progress.step + 1)
            acc.backward(window_loss(per_sample, window_samples, G, P))  # exact accumulation, tail window included
        if run.oom.hit:
            if P > 1:  # the other processes are in this step's collectives: no rank may redo it alone
                raise UserError(
                    f"out of memory on one of {P} processes ({run.oom.message}); the micro-batch "
                    "backoff runs on one process only (DDP and FSDP ranks share every step); lower "
                    "train.micro_batch_size (same train.batch_size) and resume with checkpoint.resume=auto"
                )
            return "out_of_memory"
        lengths = batch["sequence_lengths"] if cfg.data.packing else batch["attention_mask"].sum(-1)
        live = (weight > 0).float()  # weight-0 fill rows are waste
        window += torch.stack(
            [
                per_sample.detach().sum(),
                weight.sum(),
                (lengths * live).sum(),
                live.new_full((), float(batch["input_ids"].numel())),
                live.sum(),
            ]
        )
        if acc.sync_gradients:
            optimizer_step(run, window)
            return "step"
    return "epoch_end"


def sample_losses(
    cfg: Config, logits: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None, gold: torch.Tensor | None
) -> torch.Tensor:
    """The fp32 loss of each sample: against the labels, or with `distill.teacher` also against the teacher's
    logits (`teacher`; `gold` 0.0 marks an unlabeled row)."""
    if teacher is not None and gold is not None:
        d = cfg.distill
        return fp32_distill_loss(logits, labels, teacher, gold, cfg.model.problem_type, d.temperature, d.alpha, d.loss)
    gamma = cfg.train.focal_gamma if cfg.train.loss == "focal" else None
    return fp32_per_sample_loss(logits, labels, cfg.model.problem_type, gamma, cfg.train.label_smoothing)


def optimizer_step(run: Run, window: torch.Tensor) -> None:
    """Clip, check for non-finite values, step, schedule and zero; count the step.

    Raises:
        UserError: out of memory inside the step (weights possibly half updated: no in-place retry).
        NonFiniteError: NaN/inf with `train.nonfinite=stop`.
    """
    acc, max_norm, step = run.accelerator, run.cfg.train.max_grad_norm, run.progress.step + 1
    grad_norm = None
    if run.fold_clip:
        grad_norm = fold_clipping_into_step(
            run.optimizer, [p for p in run.model.parameters() if p.requires_grad], max_norm
        )
    elif max_norm is not None or run.precision.checks_grads:
        grad_norm = acc.clip_grad_norm_(run.model.parameters(), max_norm or float("inf"))
    # NaN/inf loss or grad norm: recorded on the device (stop) or the step skipped (train.nonfinite=skip)
    if run.precision.step_ok(grad_norm, window[0], step):
        try:
            faults.oom_point("oom_in_step", step)
            run.optimizer.step()
        except torch.OutOfMemoryError as exc:
            done = ckpt.list_checkpoints(run.run_dir)
            raise optimizer_step_out_of_memory(step, exc, done[-1] if done else None) from None
        if run.fold_clip:  # as GradScaler does: the scale belongs to this step only
            getattr(run.optimizer, "optimizer", run.optimizer).grad_scale = None
        run.scheduler.step()
        run.precision.after_step(acc.optimizer_step_was_skipped)  # fp16: the scaler skipped it
        if not acc.optimizer_step_was_skipped:
            run.sums.values[:2] += window[:2]  # the loss average counts applied steps only
    run.sums.values[2:] += window[2:]
    run.optimizer.zero_grad(set_to_none=True)
    run.progress.step = step


def recover_from_oom(run: Run, loader: Any) -> None:
    """Drop the failed window's gradients; halve the micro-batch, double the accumulation and
    rebuild the loader so the same window is redone (the weights were not touched).

    Raises:
        UserError: the micro-batch is 1 already.
    """
    progress = run.progress
    run.model.zero_grad(set_to_none=True)
    run.oom.redo_window(progress, run.accelerator, loader)
    run.memory.config_summary.update(
        micro_batch_size=progress.micro_batch_size,  # memory.json: what runs
        gradient_accumulation_steps=progress.gradient_accumulation_steps,
    )
    run.train_loader, run.sampler = prepared_train_loader(
        run.accelerator, run.cfg, run.data, run.tokenizer, progress, run.attn_cost
    )


def after_step(run: Run) -> None:
    """What follows an optimizer step: log row, evaluation, early stopping, time budget, checkpoint, preemption.

    Raises:
        Preempted: a signal asked to stop (after this step's checkpoint is on disk).
    """
    cfg, progress = run.cfg, run.progress
    step = progress.step
    run.memory.end_sample()
    faults.signal_point("step", step, run.run_dir, run.guard)
    if step == cfg.train.contrastive_steps:  # the contrastive opening ends: the head refitted to the new features
        loader = build_eval_loader(run.data.train, run.tokenizer, 2 * run.progress.micro_batch_size)
        logger.info(
            f"step {step}: contrastive steps done; " + probe_head(run.accelerator.unwrap_model(run.model), loader)
        )
    if step % cfg.train.log_every_steps == 0 or step == run.total_steps:
        log_row(run)
    run.bar.update(1)  # after the row: a progress line shows this step's loss
    ev = cfg.train.eval_every_steps
    if run.eval_loader is not None and ev and step % ev == 0 and step < run.total_steps:
        evaluate_now(run)
    patience = cfg.train.early_stopping_patience
    if patience and progress.best.get("bad_evals", 0) >= patience:  # decided before a save records the step
        logger.info(
            f"early stopping at step {step}: {cfg.checkpoint.best_metric} did not improve in {patience} evaluations"
        )
        progress.finished = True
    progress.seconds_trained = run.budget.used(step)
    # the main process's clock decides, carried by the stop agreement every step makes anyway
    out_of_time = run.budget.spent(progress.seconds_trained) and run.accelerator.is_main_process
    stop_signal, out_of_time = run.guard.agree(run.accelerator, out_of_time)
    if out_of_time and not progress.finished:
        logger.info(run.budget.line(step, progress.seconds_trained))
        progress.finished = True
    saved = None
    if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < run.total_steps:
        saved = save(run)
    if stop_signal is not None:  # preemption: checkpoint this step, then exit 143 (SIGTERM) / 130 (SIGINT)
        run.bar.close()
        path = saved or save(run)  # not a second save of the same step inside the grace period
        run.accelerator.end_training()  # flush the trackers (TensorBoard) before exiting
        raise Preempted(stop_signal, step, path)
    # MemTracker windows (step 2 and the heaviest) feed the checkpoints' and the final memory report; not after
    # the last step: evaluation and export run untracked
    if step < run.total_steps and not progress.finished:
        run.memory.begin_sample(step)


def log_row(run: Run) -> None:
    """One training row of metrics.jsonl (and the trackers); the interval's sums start again."""
    progress, sums = run.progress, run.sums
    run.precision.raise_if_nonfinite()  # the interval's host sync reads the non-finite record too
    loss, weight, real, total, samples = sums.reduce(run.accelerator)
    row = {
        "step": progress.step,
        "epoch": progress.epoch,
        "loss": loss / max(weight, 1e-12),
        "lr": run.scheduler.get_last_lr()[0],
        "samples_per_s": samples / max(time.perf_counter() - sums.started, 1e-9),
        "padding_fraction": 1.0 - real / max(total, 1.0),  # weight-0 fill rows count as padding
        "peak_memory_bytes": run.memory.interval_peak(),
    }
    progress.samples_seen += int(samples)
    row.update(run.precision.fields())  # compile_graphs, loss_scale, skipped steps
    record_row(run.accelerator, run.metrics_file, row)
    progress_log.info(
        f"step {progress.step}/{run.total_steps} epoch {progress.epoch + 1}/{run.num_epochs}: loss {row['loss']:.4f}, "
        f"lr {row['lr']:.2e}, {row['samples_per_s']:.1f} samples/s, peak {row['peak_memory_bytes'] / 2**20:,.0f} MiB"
    )
    run.bar.set_postfix(
        {"loss": f"{row['loss']:.4f}", "lr": f"{row['lr']:.2e}", "samples/s": f"{row['samples_per_s']:.1f}"},
        refresh=False,
    )
    sums.reset()


def evaluate_now(run: Run) -> None:
    """A periodic evaluation: metrics row, best-metric bookkeeping; its time is not throughput."""
    started, progress = time.perf_counter(), run.progress
    run.precision.raise_if_nonfinite()
    release_cached_memory(run.cfg.precision.empty_cache, run.accelerator.device)
    progress.eval = evaluate_split(run, "validation")
    progress.eval["step"] = progress.step
    ckpt.update_best(progress.best, run.cfg.checkpoint.best_metric, progress.eval, progress.step)
    record_row(run.accelerator, run.metrics_file, eval_row(progress.step, progress.eval) | run.precision.fields())
    if run.accelerator.is_main_process:  # tqdm.write prints even from a disabled bar: once per rank
        line = f"step {progress.step}: eval {headline(progress.eval)}"
        run.bar.write(line)
        progress_log.info(f"{line}, loss {progress.eval['loss']:.4f}")
    run.sums.started += time.perf_counter() - started
    if run.report is not None:
        run.report(progress.step, progress.eval)


def evaluate_split(run: Run, split: str, thresholds: list[float] | None = None) -> dict[str, Any]:
    """The metrics of the run's model on `split` ("validation" or "test"); its outputs are kept in
    `run.outputs` for the intervals and predictions.jsonl of final/'s weights."""
    loader = run.eval_loader if split == "validation" else run.test_loader
    run.outputs[split] = collect_outputs(run.model, loader, run.accelerator, run.cfg.data.chunk_aggregate)
    return score(run.outputs[split], run.cfg.model.problem_type, run.data.label_names, thresholds)


def describe_final(run: Run, final: dict[str, Any], thresholds: list[float] | None) -> None:
    """Add bootstrap intervals to final/'s metrics (validation, and test inside them) and write
    predictions.jsonl, one row per validation and test text, for the same weights."""
    cfg, rows = run.cfg, []
    for split, metrics in (("validation", final if run.eval_loader is not None else None), ("test", final.get("test"))):
        if metrics is None:
            continue
        if split not in run.outputs:  # a finished run resumed: its last evaluation was in the earlier process
            evaluate_split(run, split, thresholds=thresholds)
        out = run.outputs[split]
        metrics.update(
            bootstrap_ci(
                cfg.model.problem_type,
                out.labels.numpy(),
                out.logits.numpy(),
                len(run.data.label_names),
                thresholds,
                cfg.train.bootstrap_resamples,
                cfg.run.seed,
            )
        )
        rows += prediction_rows(
            split,
            out,
            run.data.texts[split],
            run.data.pairs.get(split),
            cfg.model.problem_type,
            run.data.label_names,
            thresholds,
        )
    if run.accelerator.is_main_process and rows:
        tmp = run.run_dir / "predictions.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(run.run_dir / "predictions.jsonl")


def save(run: Run) -> Path:
    """The checkpoint of this step, with its memory report (every process calls it).

    Raises:
        UserError: the disk is full (the previous checkpoint is intact).
    """
    acc, cfg, progress = run.accelerator, run.cfg, run.progress
    run.precision.raise_if_nonfinite()  # no checkpoint of weights after a non-finite step
    snapshot = dataclasses.replace(progress, log_sums=run.sums.reduce(acc))
    if snapshot.batches_in_epoch >= len(run.train_loader):  # a finished epoch: saved as the start of the next
        snapshot.epoch, snapshot.batches_in_epoch = snapshot.epoch + 1, 0
    report = run.memory.report(progress.step)
    audit = dtype_audit(
        acc.unwrap_model(run.model), cfg.precision.mode, cfg.precision.fp32_norms, norm_names=run.norm_names
    )
    files = {
        "config.yaml": dump_config(cfg),
        "eval.json": json.dumps(progress.eval, indent=2),
        "dtype_audit.json": audit_json(audit),
    }
    return ckpt.save_checkpoint(
        acc,
        run.run_dir,
        snapshot,
        files,
        write_extra=lambda d: run.memory.write(report, d, run.metrics_file),
        keep_last=cfg.checkpoint.keep_last,
        best_metric=best_rule(cfg, progress),
    )


def best_rule(cfg: Config, progress: TrainingProgress) -> ckpt.BestRule:
    """How rotation and final/ pick the best checkpoint: checkpoint.best_metric and best_within_se, against the
    run's best value so far (`progress.best`, which survives its checkpoint's rotation)."""
    c = cfg.checkpoint
    return ckpt.BestRule(c.best_metric, c.best_within_se, progress.best.get("value"))


def final_memory_report(run: Run, step: int) -> dict[str, Any]:
    """The run's final memory summary, <run>/memory.json and memory.md, written with or without checkpoints;
    `run_peak_bytes` is the peak of the whole run (every log interval's and the last window's)."""
    report = run.memory.report(step)
    report["scope"] = "the final summary of the run (a checkpoint's memory.json covers the steps before it)"
    last = (report.get("cuda") or {}).get("peak_allocated_bytes") or (report.get("cpu") or {}).get("peak_rss_bytes")
    peaks = [p for p in (mem.run_peak_bytes(run.metrics_file), last) if p]
    report["run_peak_bytes"] = max(peaks) if peaks else None
    if run.accelerator.is_main_process:
        run.memory.write(report, run.run_dir)
    return report


def calibrate_final(run: Run, final: dict[str, Any]) -> None:
    """Single-label with validation (`train.calibrate`): a temperature fitted on the validation logits of
    final/'s weights, folded into the output layer before the test evaluation and the export, so eval.json,
    predictions.jsonl and final/ all give the calibrated probabilities; eval.json's `calibration` holds the
    temperature and the ECE / Brier score / NLL on validation before and after, in-sample and cross-fitted.
    Too few validation rows, or a temperature that does not lower the cross-fitted NLL: no temperature."""
    cfg = run.cfg
    if not cfg.train.calibrate or run.eval_loader is None or cfg.model.problem_type != SINGLE:
        return
    if "validation" not in run.outputs:  # a finished run resumed: its last evaluation was in the earlier process
        evaluate_split(run, "validation")
    out = run.outputs["validation"]
    report = final["calibration"] = calibrate(out.logits.numpy(), out.labels.numpy(), seed=cfg.run.seed)
    if "skipped" in report or not report["kept"]:
        logger.info(f"calibration: no temperature: {report.get('skipped') or report['reason']}")
        return
    temperature, crossed = report["temperature"], report["cross_fitted"]
    fold_temperature(run.accelerator.unwrap_model(run.model), temperature)
    out.logits = out.logits / temperature  # what final/ now computes
    final["loss"] = report["nll_after"]
    logger.info(
        f"calibration: temperature {temperature:.4f} on validation; ECE {report['ece_before']:.4f} -> "
        f"{report['ece_after']:.4f}, Brier {report['brier_before']:.4f} -> {report['brier_after']:.4f}; "
        f"cross-fitted ECE {crossed['ece_before']:.4f} -> {crossed['ece_after']:.4f}, NLL "
        f"{crossed['nll_before']:.4f} -> {crossed['nll_after']:.4f}"
    )


def calibration_on_test(run: Run, final: dict[str, Any]) -> None:
    """After the test evaluation: the test split's measures under validation's temperature (eval.json's
    `calibration.test`, from final/'s test logits) and reliability.png, on test where there is one."""
    report = final.get("calibration")
    if report is None or "skipped" in report:
        return
    temperature, split = report["temperature"], "test" if run.test_loader is not None else "validation"
    out = run.outputs[split]  # final/'s logits: divided by the temperature already
    if split == "test":
        report["test"] = report_on_test(out.logits.numpy(), out.labels.numpy(), temperature)
        logger.info(
            f"calibration on test: ECE {report['test']['ece_before']:.4f} -> {report['test']['ece_after']:.4f}, "
            f"Brier {report['test']['brier_before']:.4f} -> {report['test']['brier_after']:.4f}, "
            f"NLL {report['test']['nll_before']:.4f} -> {report['test']['nll_after']:.4f}"
        )
    if run.cfg.log.plots and run.accelerator.is_main_process:
        before = out.logits.double().numpy() * temperature
        plot_reliability(before, out.labels.numpy(), temperature, run.run_dir / "reliability.png", split)


def finish(run: Run, was_finished: bool) -> dict[str, Any]:
    """Final evaluation and checkpoint, then final/ and an eval.json that describes final/'s weights."""
    acc, cfg, progress = run.accelerator, run.cfg, run.progress
    run.bar.close()
    run.precision.raise_if_nonfinite()
    release_cached_memory(cfg.precision.empty_cache, acc.device)
    if run.eval_loader is not None and progress.eval.get("step") != progress.step:  # not twice for one step
        progress.eval = evaluate_split(run, "validation")
        progress.eval["step"] = progress.step
        ckpt.update_best(progress.best, cfg.checkpoint.best_metric, progress.eval, progress.step)
        if not was_finished:
            record_row(acc, run.metrics_file, eval_row(progress.step, progress.eval) | run.precision.fields())
    progress.finished = True
    if cfg.checkpoint.every_steps and not was_finished:
        run.sums.reset()  # a finished run logs no more rows: its checkpoint carries no partial interval
        save(run)
    memory_report = final_memory_report(run, progress.step)
    run.memory.close()
    final = {**progress.eval, "step": progress.step, "exported": "last"}
    best = (
        ckpt.load_best_weights(acc, run.model, run.run_dir, best_rule(cfg, progress))
        if cfg.checkpoint.export == "best"
        else None
    )
    if best is not None:
        best_step = ckpt.read_progress(best).step
        final = {**evaluate_split(run, "validation"), "step": best_step, "exported": "best"}
    calibrate_final(run, final)
    thresholds = final.get("thresholds")  # multi-label: tuned on validation, applied to test and in final/
    if thresholds is None and cfg.model.problem_type == "multi_label_classification":
        thresholds = [0.5] * len(run.data.label_names)  # no validation to tune on: never tune on test
    if run.test_loader is not None:
        final["test"] = evaluate_split(run, "test", thresholds=thresholds)
        acc.log(
            {k.replace("eval_", "test_"): v for k, v in eval_row(0, final["test"]).items() if k != "step"},
            step=progress.step,
        )
    calibration_on_test(run, final)
    export_final(
        acc,
        run.model,
        run.tokenizer,
        run.run_dir / "final",
        cfg.data.max_length,
        prediction_config(cfg, run.data.label_names, thresholds),
    )
    describe_final(run, final, thresholds)
    if acc.is_main_process:
        (run.run_dir / "eval.json").write_text(json.dumps(final, indent=2))
        data, train_report = run.data, run.data.report["splits"]["train"]
        excluded, unlabeled = train_report.get("excluded_rows", 0), train_report.get("unlabeled_rows", 0)
        write_model_card(
            run.run_dir / "final",
            cfg,
            final,
            data.label_names,
            data.files,
            data.sha256,
            memory_report,
            excluded,
            unlabeled,
        )
        if run.metrics_file.exists() and cfg.log.plots:
            plot_curves(run.metrics_file, run.run_dir / "curves.png")
            mem.plot_memory(run.metrics_file, run.run_dir / "memory.png", report=mem.latest_report(run.run_dir))
        logger.info(final_summary(final, run.run_dir / "final"))
    acc.end_training()
    return final


# ----------------------------------------------------------------------------------------------
# Entry points.


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """`--config CONFIG [dotted.key=value ...]`."""
    parser = argparse.ArgumentParser(
        prog="finetune train", description="Fine-tune a text classifier from a YAML config."
    )
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.learning_rate=3e-5")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, prog: str | None = None, fixed: tuple[str, ...] = ()) -> int:
    """Parse, validate and train; a user error prints one line and returns 2. `fixed`: overrides after the given
    ones that `prog` already spells (`finetune distill --teacher PATH` sets distill.teacher).

    A run stopped by SIGTERM / SIGINT saves a checkpoint, prints how to resume and returns 143 / 130
    (docs/RESUME.md).
    """
    try:
        args = parse_args(argv)
        cfg = load_config(args.config, [*args.overrides, *fixed])
        launch = "accelerate launch <the same options> finetune/train.py"
        relaunch = resume_hint(launch, args.config, [*args.overrides, *fixed])
        on_peer_lost(node_loss_line(Path(cfg.run.output_dir), relaunch))  # several nodes: a lost one's line
        with PreemptionGuard() as guard:
            train(cfg, guard)
    except UserError as exc:  # with several processes: every rank ends with the first failure's line and code
        return end_job(f"error: {exc}", 2)
    except Preempted as exc:
        if prog is None:
            launched = "ACCELERATE_MIXED_PRECISION" in os.environ
            prog = "accelerate launch finetune/train.py" if launched else "python finetune/train.py"
        if os.environ.get("RANK", "0") == "0":  # one line, not one per process
            print(
                f"{exc.signal_name}: stopped at step {exc.step}, checkpoint {exc.checkpoint}; resume with: "
                f"{resume_hint(prog, args.config, args.overrides)}",
                file=sys.stderr,
                flush=True,
            )
        return exc.exit_code
    except Exception as exc:
        if not several_processes():
            raise
        end_if_peer_lost(exc)  # a collective failed because a node is gone: its one line, exit 2
        traceback.print_exc()  # a crash on one rank: its traceback, and the other ranks end too instead of waiting
        return end_job("", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
