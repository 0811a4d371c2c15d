"""Fine-tune a text classifier: `accelerate launch finetune/train.py --config CONFIG [key=value ...]`.

Setup lives in small `build_*` functions; `train()` is the one loop, read top to bottom.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python finetune/train.py` / `accelerate launch finetune/train.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import transformers
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from finetune import checkpoint as ckpt
from finetune import memory as mem
from finetune.config import Config, dump_config, load_config
from finetune.data import (
    build_data_report,
    build_eval_loader,
    build_train_loader,
    file_sha256,
    format_data_report,
    load_raw_splits,
    tokenize_split,
)
from finetune.errors import UserError
from finetune.metrics import classification_metrics, plot_curves
from finetune.model import attention_cost, build_model, build_tokenizer, check_packing, count_parameters, exportable, packed_logits
from finetune.planner import OutOfMemoryGuard, resolve_micro_batch
from finetune.precision import (
    Bf16AdamW,
    PrecisionMonitor,
    accelerate_mixed_precision,
    apply_precision_policy,
    audit_json,
    check_audit,
    check_supported,
    compile_model,
    dtype_audit,
    format_audit,
    fp32_cross_entropy,
    release_cached_memory,
)

logger = logging.getLogger("finetune")


# ----------------------------------------------------------------------------------------------
# Setup.


def build_accelerator(cfg: Config) -> Accelerator:
    """Accelerator with mixed precision, gradient accumulation and global (split) batches."""
    accelerator = Accelerator(
        mixed_precision=accelerate_mixed_precision(cfg.precision.mode),
        gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
        # batches are global (micro-batch x processes) and split across ranks: the scheduler
        # then steps once per optimizer step and every rank sees its slice of the same batch
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        log_with=list(cfg.log.trackers) or None,
        project_dir=cfg.run.output_dir,
    )
    check_supported(cfg.precision.mode, accelerator.device)
    if accelerator.gradient_accumulation_steps != cfg.train.gradient_accumulation_steps:
        # ACCELERATE_GRADIENT_ACCUMULATION_STEPS (set by `accelerate launch` from a DeepSpeed
        # config) overrides the argument; the sampler's windows and the loss scale use the config's
        raise UserError(
            f"the Accelerate launch config sets gradient accumulation to {accelerator.gradient_accumulation_steps} but "
            f"train.gradient_accumulation_steps is {cfg.train.gradient_accumulation_steps}; set it in one place "
            "(remove gradient_accumulation_steps from the Accelerate/DeepSpeed config)"
        )
    return accelerator


def check_output_dir(cfg: Config) -> Path:
    """Refuse a non-empty output directory unless resuming or `run.overwrite=true` (writes nothing)."""
    out = Path(cfg.run.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"run.output_dir {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and cfg.checkpoint.resume is None and not cfg.run.overwrite:
        raise UserError(f"run.output_dir {out} is not empty; set run.overwrite=true or checkpoint.resume=auto")
    if out.is_dir() and any(out.iterdir()) and cfg.run.overwrite and not (out / "config.yaml").is_file():
        # overwrite deletes the whole directory: only ever a run's own (`run.output_dir=.` or a parent of runs would go too)
        raise UserError(f"run.output_dir {out} is not empty and holds no finetune run (no config.yaml); run.overwrite=true only replaces a run directory")
    return out


@dataclass
class Data:
    """Tokenized splits and what was learned about them."""

    train: Any
    validation: Any
    test: Any
    label_names: list[str]
    report: dict[str, Any]
    files: dict[str, Path]


def build_data(cfg: Config, tokenizer: Any) -> Data:
    """Read and tokenize all splits; build the data report."""
    raw = load_raw_splits(cfg)
    label_ids = {raw_value: raw.label_names.index(name) for raw_value, name in raw.raw_to_name.items() if name in raw.label_names}
    tok = {
        name: tokenize_split(ds, tokenizer, cfg.data.max_length, label_ids)
        for name, ds in (("train", raw.train), ("validation", raw.validation), ("test", raw.test))
        if ds is not None
    }
    report = build_data_report(raw, tok)
    return Data(tok["train"], tok.get("validation"), tok.get("test"), raw.label_names, report, raw.files)


def build_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW (or SGD) with no weight decay on biases and norm weights (every parameter with ndim < 2).

    Plain SGD makes the update proportional to the gradient, which is what tests of exact
    accumulation compare; AdamW's update is nearly invariant to the gradient's scale.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.learning_rate, momentum=t.momentum)
    if t.optimizer == "adafactor":
        # factored second moment, no first moment (beta1=None): state ~ rows + columns per matrix;
        # a fixed learning rate (no relative step / parameter scaling) so the scheduler drives it
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=t.learning_rate, scale_parameter=False, relative_step=False, warmup_init=False)
    if t.optimizer == "adamw8bit":
        return build_adamw8bit(cfg, groups)
    if cfg.precision.mode == "bf16-true":  # bf16 weights: an update that keeps small steps (precision.bf16_update)
        return Bf16AdamW(groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon, update=cfg.precision.bf16_update)
    return torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon, fused=_fused_adamw_ok(cfg))


def _fused_adamw_ok(cfg: Config) -> bool:
    """Use torch's fused AdamW kernel: the same update, ~8x cheaper than the default per-parameter
    loop on CPU (MiniLM: 13 vs 105 ms a step, one thread); Trainer's default too. Not with fp16
    (the GradScaler hands a fused step its skip flag, which hides skipped steps from Accelerate)
    nor under FSDP/DeepSpeed, which wrap or shard the parameters themselves."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    state = PartialState()
    return (
        cfg.precision.mode in ("fp32", "bf16")
        and state.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        and state.device.type in _get_fused_kernels_supported_devices()
    )


def clipping_folds_into_step(optimizer: torch.optim.Optimizer, accelerator: Accelerator) -> bool:
    """Whether `fold_clipping_into_step` applies: torch's fused AdamW, no fp16 grad scaler (which
    owns `grad_scale`), gradients whole on each process (no FSDP/DeepSpeed sharding)."""
    from accelerate.utils import DistributedType

    inner = getattr(optimizer, "optimizer", optimizer)
    return (
        isinstance(inner, torch.optim.AdamW) and bool(inner.defaults.get("fused")) and accelerator.scaler is None
        and accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
    )


def fold_clipping_into_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
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
    """bitsandbytes' 8-bit AdamW (block-quantized moments): CUDA only, bitsandbytes optional."""
    t = cfg.train
    if not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        raise UserError("train.optimizer=adamw8bit needs a CUDA GPU (bitsandbytes' 8-bit kernels); on CPU use adamw or adafactor")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError("train.optimizer=adamw8bit needs bitsandbytes: pip install bitsandbytes") from None
    return bnb.optim.AdamW8bit(groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon)


def rebuild_train_loader(accelerator: Accelerator, data: "Data", tokenizer: Any, cfg: Config, micro: int, G: int, attn_cost: float) -> tuple[Any, Any]:
    """A prepared training loader at another micro-batch size; its windows hold the same samples."""
    loader, sampler = build_train_loader(data.train, tokenizer, cfg, micro, G, accelerator.num_processes, attn_cost)
    accelerator.gradient_accumulation_steps = G
    return accelerator.prepare(loader), sampler


def planned_steps(cfg: Config, windows_per_epoch: int) -> tuple[int, int]:
    """(total optimizer steps, epochs to iterate): whichever of epochs and max_steps ends first."""
    total = math.ceil(cfg.train.epochs * windows_per_epoch)
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    return total, math.ceil(total / windows_per_epoch)


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """Warmup then linear/cosine/constant decay, counted in optimizer steps."""
    warmup = cfg.train.warmup_steps if cfg.train.warmup_steps is not None else round(cfg.train.warmup_ratio * total_steps)
    name = "constant_with_warmup" if cfg.train.lr_scheduler == "constant" else cfg.train.lr_scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def provenance(files: dict[str, Path], data_sha256: dict[str, str]) -> dict[str, Any]:
    """Library versions, git commit and data-file hashes (computed once, also used for resume checks)."""
    import accelerate
    import datasets
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "git_commit": commit,
        "data_files": {split: {"path": str(p), "sha256": data_sha256[split]} for split, p in files.items()},
        "command": sys.argv,
    }


def setup_logging(accelerator: Accelerator, run_dir: Path | None) -> None:
    """Log to stderr on the main process (and to train.log in the run directory)."""
    for handler in logger.handlers:
        handler.close()  # the previous run's train.log (in-process runs: tests, notebooks) is not left open
    logger.handlers.clear()
    logger.setLevel(logging.INFO if accelerator.is_main_process else logging.WARNING)
    logger.propagate = False
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(stream)
    if run_dir is not None and accelerator.is_main_process:
        fh = logging.FileHandler(run_dir / "train.log")
        fh.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(fh)


# ----------------------------------------------------------------------------------------------
# Evaluation.


def record_row(accelerator: Accelerator, metrics_file: Path, row: dict[str, Any]) -> None:
    """One metrics.jsonl line (written by the main process only) and the same values to the trackers."""
    if accelerator.is_main_process:
        with metrics_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
    accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])


def final_summary(step: int, final: dict[str, Any], final_dir: Path) -> str:
    """The run's last log line."""
    summary = f"done: {step} steps"
    if "accuracy" in final:
        summary += f"; validation accuracy {final['accuracy']:.4f}, macro-F1 {final['macro_f1']:.4f}"
    if "test" in final:
        summary += f"; test accuracy {final['test']['accuracy']:.4f}"
    return summary + f"; model in {final_dir}"


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Any, accelerator: Accelerator, label_names: list[str]) -> dict[str, Any]:
    """Metrics over a prepared loader; `gather_for_metrics` drops the duplicates of padded batches."""
    model.eval()
    preds, refs, losses = [], [], []
    for batch in loader:
        labels = batch.pop("labels")
        logits = model(**batch).logits
        # the loss goes through gather_for_metrics too: the refilled tail of the last batch
        # (even_batches) must not count twice
        p, r, l = accelerator.gather_for_metrics((logits.argmax(-1), labels, fp32_cross_entropy(logits, labels)))
        preds.append(p.cpu())
        refs.append(r.cpu())
        losses.append(l.cpu())
    model.train()
    y_pred, y_true = torch.cat(preds).tolist(), torch.cat(refs).tolist()
    metrics = classification_metrics(y_true, y_pred, label_names)
    metrics["loss"] = float(torch.cat(losses).sum()) / max(1, len(y_true))
    return metrics


# ----------------------------------------------------------------------------------------------
# The run.


def train(cfg: Config, guard: ckpt.PreemptionGuard | None = None) -> dict[str, Any]:
    """Run one fine-tuning job end to end; return the final evaluation metrics.

    With `guard` installed (as `main` does) SIGTERM/SIGINT end the run at the next optimizer step
    with a checkpoint and `ckpt.Preempted`.
    """
    guard = guard or ckpt.PreemptionGuard()  # not installed: signals keep their handlers
    run_dir = check_output_dir(cfg)
    ckpt.configure_determinism(cfg.precision.deterministic)  # before CUDA initialises
    accelerator = build_accelerator(cfg)
    setup_logging(accelerator, None)
    set_seed(cfg.run.seed)

    # Everything that can fail on user input happens before the output directory is touched.
    tokenizer = build_tokenizer(cfg)
    data = build_data(cfg, tokenizer)
    model = build_model(cfg, data.label_names, tokenizer)
    if cfg.data.packing:
        check_packing(model)
    # precision policy (bf16-true cast, fp32 norms), audited, then compile in place: this order
    prec = cfg.precision
    norm_names = apply_precision_policy(model, prec.mode, prec.fp32_norms, prec.norm_class_names)
    audit = dtype_audit(model, prec.mode, prec.fp32_norms, norm_names=norm_names)
    check_audit(audit, prec.allow_dtype_mismatch)
    if cfg.model.compile:
        compile_model(model, cfg.model.compile_backend, cfg.model.compile_mode, cfg.model.compile_dynamic)
    P = accelerator.num_processes
    # micro-batch x accumulation: explicit, derived from train.batch_size, or planned (auto)
    micro, G = resolve_micro_batch(cfg, P, accelerator.device.type, tokenizer, data.label_names)
    accelerator.gradient_accumulation_steps = G
    attn_cost = attention_cost(model)  # packing: how much a longer row costs in attention
    train_loader, sampler = build_train_loader(data.train, tokenizer, cfg, micro, G, P, attn_cost)
    # eval batches are global too (split_batches=True): micro * 2 rows per process
    eval_loader = build_eval_loader(data.validation, tokenizer, micro * 2 * P) if data.validation is not None else None
    test_loader = build_eval_loader(data.test, tokenizer, micro * 2 * P) if data.test is not None else None
    windows_per_epoch = sampler.num_windows()
    total_steps, num_epochs = planned_steps(cfg, windows_per_epoch)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    data_sha256 = {split: file_sha256(p) for split, p in data.files.items()}
    resume_from = ckpt.find_resume_checkpoint(cfg.checkpoint.resume, run_dir, cfg.model_dump(mode="json"), data_sha256)

    if accelerator.is_main_process:
        if cfg.run.overwrite and resume_from is None:
            ckpt.remove_tree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.cleanup_stale(run_dir)  # temporaries of a save or rotation that a crash interrupted
        if resume_from is None:
            ckpt.trim_metrics(run_dir / "metrics.jsonl", 0)  # a restart of this config logs from step 0 again
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        (run_dir / "labels.json").write_text(json.dumps(data.label_names))
        (run_dir / "provenance.json").write_text(json.dumps(provenance(data.files, data_sha256), indent=2))
        (run_dir / "data_report.json").write_text(json.dumps(data.report, indent=2))
        (run_dir / "dtype_audit.json").write_text(audit_json(audit))
    accelerator.wait_for_everyone()
    setup_logging(accelerator, run_dir)
    logger.info(format_data_report(data.report))
    logger.info(format_audit(audit))
    trainable, total_params = count_parameters(model)
    logger.info(
        f"model: {trainable:,} trainable / {total_params:,} parameters; {len(data.label_names)} labels; "
        f"precision {cfg.precision.mode}; {P} process(es) x micro-batch {micro} x accumulation {G} "
        f"= effective batch {micro * G * P}; {total_steps} optimizer steps over {num_epochs} epoch(s)"
    )
    if cfg.log.trackers:
        accelerator.init_trackers("finetune", config={"precision": cfg.precision.mode, "lr": cfg.train.learning_rate})

    prepared = accelerator.prepare(model, optimizer, train_loader, scheduler, *[l for l in (eval_loader, test_loader) if l is not None])
    model, optimizer, train_loader, scheduler = prepared[:4]
    rest = list(prepared[4:])
    monitor = PrecisionMonitor(prec.mode, cfg.train.nonfinite, accelerator.scaler, cfg.model.compile, P, run_dir)
    eval_loader = rest.pop(0) if eval_loader is not None else None
    test_loader = rest.pop(0) if test_loader is not None else None

    step, epoch, batches_done = 0, 0, 0  # optimizer steps, epoch, micro-batches consumed this epoch
    last_eval: dict[str, Any] = {}
    best: dict[str, Any] = {}  # checkpoint.best_metric: value, step, evaluations without improvement
    samples_seen, finished = 0.0, False  # samples up to the last log line; run over (early stop, end)
    if resume_from is not None:
        progress = ckpt.load_checkpoint(accelerator, resume_from)
        step, epoch, batches_done = progress["step"], progress["epoch"], progress["batches_in_epoch"]
        if (progress.get("micro_batch_size", micro), progress.get("gradient_accumulation_steps", G)) != (micro, G):
            # an out-of-memory retry shrank the micro-batch: keep it (batches_in_epoch counts in it)
            micro, G = progress["micro_batch_size"], progress["gradient_accumulation_steps"]
            train_loader, sampler = rebuild_train_loader(accelerator, data, tokenizer, cfg, micro, G, attn_cost)
            logger.info(f"resuming with micro-batch {micro} x accumulation {G} (chosen after an out-of-memory error)")
        last_eval = progress.get("eval", {})
        best, finished = progress.get("best", {}), progress.get("finished", False)
        samples_seen = progress.get("samples_seen", 0) - progress.get("log_sums", [0, 0])[1]
        if accelerator.is_main_process:
            ckpt.trim_metrics(run_dir / "metrics.jsonl", step)  # the steps after the checkpoint are logged again
        logger.info(f"resumed from {resume_from} at step {step} (epoch {epoch}, {batches_done} batches in)")

    # resuming a run that had finished: its final evaluation row and checkpoint are on disk already
    was_finished = finished
    metrics_file = run_dir / "metrics.jsonl"
    bar = tqdm(total=total_steps, initial=step, desc="train", disable=not accelerator.is_main_process, dynamic_ncols=True)
    # running sums since the last log line, kept on device: no host sync inside the step
    loss_sum = torch.zeros((), device=accelerator.device)
    samples = torch.zeros((), device=accelerator.device)
    win_loss = torch.zeros((), device=accelerator.device)  # this accumulation window's, added once it is applied
    win_samples = torch.zeros((), device=accelerator.device)
    real_tokens = torch.zeros((), device=accelerator.device)
    total_tokens = torch.zeros((), device=accelerator.device)
    t_log = time.perf_counter()
    if resume_from is not None and accelerator.is_main_process:  # the saved partial log interval (all processes' sums)
        for t, v in zip((loss_sum, samples, real_tokens, total_tokens), progress.get("log_sums", [0.0] * 4)):
            t.fill_(v)
    memmon = mem.MemoryMonitor(accelerator.device, model, optimizer, {
        "precision": cfg.precision.mode, "micro_batch_size": micro, "gradient_accumulation_steps": G, "processes": P,
        "max_length": cfg.data.max_length, "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "optimizer": cfg.train.optimizer, "lora": cfg.model.lora is not None}, cfg.memory.record_history)

    def progress_state() -> dict[str, Any]:
        # every process calls this (reduce is a collective); a finished epoch is saved as the start of the next
        log_sums = accelerator.reduce(torch.stack([loss_sum, samples, real_tokens, total_tokens]), "sum").tolist()
        e, b = (epoch + 1, 0) if batches_done >= len(train_loader) else (epoch, batches_done)
        return {"step": step, "epoch": e, "batches_in_epoch": b, "samples_seen": int(samples_seen + log_sums[1]),
                "data_seed": cfg.run.seed, "micro_batch_size": micro, "gradient_accumulation_steps": G, "best_metric": cfg.checkpoint.best_metric, "best": best, "finished": finished,
                "eval": last_eval, "log_sums": log_sums, "data_sha256": data_sha256}

    def save(at_step: int) -> Path:
        report = memmon.report(at_step)
        return ckpt.save_checkpoint(accelerator, run_dir, at_step, progress_state(), write_extra=lambda d: memmon.write(report, d, metrics_file),
                                    keep_last=cfg.checkpoint.keep_last, best_metric=cfg.checkpoint.best_metric, files={"config.yaml": dump_config(cfg), "eval.json": json.dumps(last_eval, indent=2),
                             "dtype_audit.json": audit_json(dtype_audit(accelerator.unwrap_model(model), prec.mode, prec.fp32_norms, norm_names=norm_names))})

    # the sampled window (MemTracker, ~0.3 s extra on the default model) feeds the memory report of
    # checkpoints: without checkpoints nothing would read it
    sample_memory = cfg.checkpoint.every_steps is not None
    if step < total_steps and not finished and sample_memory:
        memmon.begin_sample(step)  # a resumed run samples its first window (the optimizer state exists)
    oom = OutOfMemoryGuard()
    fold_clip = cfg.train.max_grad_norm is not None and clipping_folds_into_step(optimizer, accelerator)
    trained_params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    while step < total_steps and epoch < num_epochs and not finished:
        loader = accelerator.skip_first_batches(train_loader, batches_done) if batches_done else train_loader
        # Accelerate's loader sets the sampler's epoch to its own count of iter() calls; a resumed
        # run has a fresh count, so set both explicitly (same data order as an uninterrupted run)
        loader.set_epoch(epoch)
        sampler.set_epoch(epoch)
        for batch in loader:
            batches_done += 1
            ckpt.inject_faults("batch", epoch * len(train_loader) + batches_done, run_dir, guard)
            labels = batch.pop("labels")
            weight = batch.pop("sample_weight")
            window_samples = batch.pop("window_samples")
            with accelerator.accumulate(model), oom:
                oom.maybe_inject(step + 1, (batches_done - 1) % G, G)
                logits = packed_logits(model, batch) if cfg.data.packing else model(**batch).logits
                per_sample = monitor.inject(fp32_cross_entropy(logits, labels) * weight, step + 1)
                # Exact accumulation: sum over the window's true sample count (short tail window and
                # all processes included); x G x P cancels Accelerate's /G and DDP's mean.
                loss = per_sample.sum() * (G * P) / window_samples
                accelerator.backward(loss)
                win_loss += per_sample.detach().sum()
                win_samples += weight.sum()
                # weight-0 fill rows are waste
                lengths = batch["sequence_lengths"] if cfg.data.packing else batch["attention_mask"].sum(-1)
                real_tokens += (lengths * weight).sum()
                total_tokens += batch["input_ids"].numel()
                if accelerator.sync_gradients:
                    grad_norm = None
                    if fold_clip:
                        grad_norm = fold_clipping_into_step(optimizer, trained_params, cfg.train.max_grad_norm)
                    elif cfg.train.max_grad_norm is not None or monitor.checks_grads:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm or math.inf)
                    # the step's one host sync: NaN/inf loss or grad norm stops (NonFiniteError) or skips (train.nonfinite)
                    if monitor.step_ok(grad_norm, win_loss, step + 1):
                        optimizer.step()
                        if fold_clip:  # as GradScaler does: the scale belongs to this step only
                            getattr(optimizer, "optimizer", optimizer).grad_scale = None
                        scheduler.step()
                        monitor.after_step(accelerator.optimizer_step_was_skipped)  # fp16: the scaler skipped it
                        if not accelerator.optimizer_step_was_skipped:
                            loss_sum += win_loss
                            samples += win_samples
                    optimizer.zero_grad(set_to_none=True)
                    win_loss.zero_(), win_samples.zero_()
            if oom.hit:  # out of memory: halve the micro-batch, double the accumulation, redo this window
                logits = per_sample = loss = None
                model.zero_grad(set_to_none=True)  # drop the window's partial gradients
                win_loss.zero_(), win_samples.zero_()
                micro, G, batches_done = oom.shrink(micro, G, batches_done)
                memmon.config_summary.update(micro_batch_size=micro, gradient_accumulation_steps=G)  # memory.json says what runs
                if hasattr(loader, "end"):
                    loader.end()  # leave Accelerate's end-of-dataloader tracking to the new loader
                train_loader, sampler = rebuild_train_loader(accelerator, data, tokenizer, cfg, micro, G, attn_cost)
                accelerator.step = 0
                break
            if not accelerator.sync_gradients:
                continue

            step += 1
            bar.update(1)
            memmon.end_sample()
            ckpt.inject_faults("step", step, run_dir, guard)
            if step % cfg.train.log_every_steps == 0 or step == total_steps:
                sums = accelerator.reduce(torch.stack([loss_sum, samples, real_tokens, total_tokens]), "sum").tolist()
                elapsed = time.perf_counter() - t_log
                row = {
                    "step": step,
                    "epoch": epoch,
                    "loss": sums[0] / max(sums[1], 1.0),
                    "lr": scheduler.get_last_lr()[0],
                    "samples_per_s": sums[1] / max(elapsed, 1e-9),
                    "padding_fraction": 1.0 - sums[2] / max(sums[3], 1.0),
                }
                row["peak_memory_bytes"] = memmon.interval_peak()
                samples_seen += sums[1]
                row.update(monitor.fields())  # compile_graphs, loss_scale, skipped steps
                record_row(accelerator, metrics_file, row)
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", sps=f"{row['samples_per_s']:.1f}")
                loss_sum.zero_(), samples.zero_(), real_tokens.zero_(), total_tokens.zero_()
                t_log = time.perf_counter()
            if eval_loader is not None and cfg.train.eval_every_steps and step % cfg.train.eval_every_steps == 0 and step < total_steps:
                t_eval = time.perf_counter()
                release_cached_memory(prec.empty_cache, accelerator.device)
                last_eval = evaluate(model, eval_loader, accelerator, data.label_names)
                last_eval["step"] = step
                ckpt.update_best(best, cfg.checkpoint.best_metric, last_eval, step)
                eval_row = {"step": step, "eval_accuracy": last_eval["accuracy"], "eval_macro_f1": last_eval["macro_f1"], "eval_loss": last_eval["loss"]}
                record_row(accelerator, metrics_file, eval_row | monitor.fields())
                bar.write(f"step {step}: eval accuracy {last_eval['accuracy']:.4f}, macro-F1 {last_eval['macro_f1']:.4f}")
                t_log += time.perf_counter() - t_eval  # evaluation time is not training throughput
            saved = None
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < total_steps:
                saved = save(step)
            stop_signal = guard.requested(accelerator)
            if stop_signal is not None:  # preemption: checkpoint this step, then exit 143 (SIGTERM) / 130 (SIGINT)
                bar.close()
                path = saved or save(step)  # not a second save of the same step inside the grace period
                accelerator.end_training()  # flush the trackers (TensorBoard) before exiting
                raise ckpt.Preempted(stop_signal, step, path)
            patience = cfg.train.early_stopping_patience
            if patience and best.get("bad_evals", 0) >= patience:
                logger.info(f"early stopping at step {step}: {cfg.checkpoint.best_metric} did not improve in {patience} evaluations")
                finished = True
            if step >= total_steps or finished:
                break
            if sample_memory:
                memmon.begin_sample(step)  # not after the last step: evaluation and export run untracked
        else:
            epoch, batches_done = epoch + 1, 0
            release_cached_memory(prec.empty_cache, accelerator.device)
            continue
        if oom.hit:
            continue  # the same epoch, from the failed window, at the smaller micro-batch
        break
    bar.close()

    # Final evaluation, final checkpoint and export.
    final: dict[str, Any] = {}
    release_cached_memory(prec.empty_cache, accelerator.device)
    if eval_loader is not None:
        final = evaluate(model, eval_loader, accelerator, data.label_names)
        final["step"] = step
        last_eval = final
        ckpt.update_best(best, cfg.checkpoint.best_metric, final, step)
    if test_loader is not None:
        final["test"] = evaluate(model, test_loader, accelerator, data.label_names)
    if accelerator.is_main_process:
        row = {"step": step}
        if eval_loader is not None and not was_finished:
            row.update(eval_accuracy=final["accuracy"], eval_macro_f1=final["macro_f1"], eval_loss=final["loss"])
            row.update(monitor.fields())
            with metrics_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
        (run_dir / "eval.json").write_text(json.dumps(final, indent=2))
    if eval_loader is not None:  # trackers get the final evaluation too (the loop skips the last step's)
        accelerator.log({"eval_accuracy": final["accuracy"], "eval_macro_f1": final["macro_f1"], "eval_loss": final["loss"]}, step=step)
    if test_loader is not None:
        accelerator.log({"test_accuracy": final["test"]["accuracy"], "test_macro_f1": final["test"]["macro_f1"]}, step=step)
    finished = True
    if cfg.checkpoint.every_steps and not was_finished:
        save(step)
    memmon.close()
    if cfg.checkpoint.export == "best":
        ckpt.load_best_weights(accelerator, model, run_dir, cfg.checkpoint.best_metric)
    export_final(accelerator, model, tokenizer, run_dir / "final")
    if accelerator.is_main_process:
        if metrics_file.exists():
            plot_curves(metrics_file, run_dir / "curves.png")
            mem.plot_memory(metrics_file, run_dir / "memory.png")
        logger.info(final_summary(step, final, run_dir / "final"))
    accelerator.end_training()
    return final


def export_final(accelerator: Accelerator, model: torch.nn.Module, tokenizer: Any, out: Path) -> None:
    """`final/`: safetensors weights, config with label names, tokenizer (loads in a pipeline)."""
    accelerator.wait_for_everyone()
    # LoRA: merge the adapters into the base weights so final/ loads without peft
    model = exportable(accelerator.unwrap_model(model)) if hasattr(accelerator.unwrap_model(model), "merge_and_unload") else model
    # every rank: under FSDP / DeepSpeed ZeRO-3 gathering the full state dict is a collective
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        # written beside it, then renamed: a kill during the export never leaves a half-written final/
        tmp = out.with_name(f"{ckpt.TMP_PREFIX}{out.name}")
        ckpt.remove_tree(tmp)
        unwrapped = accelerator.unwrap_model(model)
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # no "Writing model shards 1/1" bar after the run
        try:
            unwrapped.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        tokenizer.save_pretrained(tmp)
        # bf16-true weights are saved as trained (bf16, norms fp32), but a config saying "bfloat16"
        # makes from_pretrained/pipeline cast the fp32 norms down to bf16 on load. "float32" makes
        # loaders upcast everything instead, which is lossless.
        config_file = tmp / "config.json"
        config_json = json.loads(config_file.read_text())
        if config_json.get("dtype") not in (None, "float32"):
            config_json["dtype"] = "float32"
            config_file.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        ckpt.remove_tree(out)
        tmp.rename(out)
    accelerator.wait_for_everyone()


# ----------------------------------------------------------------------------------------------
# Entry points.


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """`--config CONFIG [dotted.key=value ...]`."""
    parser = argparse.ArgumentParser(prog="finetune train", description="Fine-tune a text classifier from a YAML config.")
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.learning_rate=3e-5")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse, validate and train; a user error prints one line and returns 2.

    A run stopped by SIGTERM / SIGINT saves a checkpoint, prints how to resume and returns 143 / 130
    (docs/RESUME.md).
    """
    try:
        args = parse_args(argv)
        cfg = load_config(args.config, args.overrides)
        with ckpt.PreemptionGuard() as guard:
            train(cfg, guard)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ckpt.Preempted as exc:
        if prog is None:
            launched = "ACCELERATE_MIXED_PRECISION" in os.environ
            prog = "accelerate launch finetune/train.py" if launched else "python finetune/train.py"
        if os.environ.get("RANK", "0") == "0":  # one line, not one per process
            print(f"{exc.signal_name}: stopped at step {exc.step}, checkpoint {exc.checkpoint}; resume with: "
                  f"{ckpt.resume_hint(prog, args.config, args.overrides)}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
