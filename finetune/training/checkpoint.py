"""Checkpoints: atomic, verified, rotated; exact resume; the run directory and its final/ export.

A checkpoint is `<run>/checkpoints/step_<N>/` holding Accelerate's `save_state` files (model as
safetensors, optimizer, scheduler, scaler, one `random_states_<rank>.pkl` per process),
`progress.json` (where the loop stands), the resolved `config.yaml`, `eval.json`, the memory
report and `manifest.json` (size and sha256 of every other file). It is written into a
temporary directory beside the target (`.tmp-step_<N>`), fsynced, and renamed into place by the
main process after a barrier; the manifest is written last, so a directory without a matching
manifest is incomplete and is never loaded.

`TrainingProgress` is where the loop stands; it is progress.json, written and read here only.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors import SafetensorError
from safetensors.torch import load_file

from finetune.config.files import keys_that_may_change_on_resume, parse_yaml12, validate_config
from finetune.config.schema import Config
from finetune.config.tasks import lower_is_better
from finetune.core import faults
from finetune.core.errors import UserError
from finetune.core.fileio import TEACHER_DIR, file_sha256, read_jsonl

logger = logging.getLogger("finetune")

PROGRESS = "progress.json"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"  # a checkpoint being written (never named step_*)
TRASH_PREFIX = ".trash-"  # a checkpoint being deleted (renamed first, so deletion is atomic too)


# ----------------------------------------------------------------------------------------------
# Where the loop stands: progress.json.


@dataclass
class TrainingProgress:
    """The run's progress: what the loop advances and what a checkpoint's progress.json holds.

    A finished epoch is saved as the start of the next (`batches_in_epoch` 0). `log_sums` are the
    summed (weighted loss, loss weight, real tokens, total tokens, rows) of the log interval in progress, so a
    resumed run prints the same log lines. Besides the loop's counting, the batch layout (micro-batch,
    accumulation, processes, `batches_in_epoch`) changes in `finetune.data.window` only: an out-of-memory
    retry (`OutOfMemoryGuard.redo_window`) and a resume under another launch (`adapt_to_launch`).
    """

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # global micro-batches of `epoch` consumed
    samples_seen: int = 0  # up to the last log line
    data_seed: int = 0
    micro_batch_size: int = 0  # per process (an out-of-memory retry may have lowered it)
    gradient_accumulation_steps: int = 1
    num_processes: int | None = None  # None: a checkpoint written before the count was recorded
    best_metric: str = "accuracy"
    best: dict[str, Any] = field(default_factory=dict)  # value, step, bad_evals (evaluations without improvement)
    finished: bool = False  # early stopping or the end: nothing left to train
    eval: dict[str, Any] = field(default_factory=dict)  # the last evaluation
    log_sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    data_sha256: dict[str, str] = field(default_factory=dict)
    seconds_trained: float = 0.0  # the training loop's wall time so far, over every resume (train.max_minutes)

    def to_json(self) -> str:
        """progress.json text."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def read(cls, checkpoint: Path) -> TrainingProgress:
        """A checkpoint's progress.json (keys an older version did not write get their defaults)."""
        raw = json.loads((checkpoint / PROGRESS).read_text())
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw})


# ----------------------------------------------------------------------------------------------
# Writing.


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """`checkpoints/step_<N>` with N zero-padded so names sort by step."""
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _fsync_tree(path: Path) -> None:
    """fsync every file and then the directory itself (the names are data too)."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a directory atomically from a reader's view: rename to a trash name, then remove."""
    if not path.exists():
        return
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    path.rename(trash)
    shutil.rmtree(trash)


def save_checkpoint(
    accelerator: Accelerator,
    run_dir: Path,
    progress: TrainingProgress,
    files: dict[str, str],
    write_extra: Callable[[Path], None] | None = None,
    keep_last: int | None = None,
    best_metric: BestRule | str = "accuracy",
) -> Path:
    """Write the checkpoint of optimizer step `progress.step` atomically and return its path.

    Every process writes its share through `save_state` into the same temporary directory; the
    main process then adds progress.json, the text `files`, whatever `write_extra(tmp)` writes,
    and the manifest, fsyncs and renames. A checkpoint of the same step already there (the
    periodic one of the step where the run ends, or a broken leftover) is replaced: renamed to
    `.trash-step_<N>` first, which `cleanup_stale` renames back if a crash comes in between.
    With `keep_last`, older checkpoints are then rotated (`rotate`).

    Raises:
        UserError: the disk filled up during the save (the temporary is removed; the previous
            checkpoint is intact).
    """
    step = progress.step
    target = checkpoint_dir(run_dir, step)
    tmp = target.with_name(f"{TMP_PREFIX}{target.name}")
    if accelerator.is_main_process:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    try:
        faults.save_point(step, "state")
        accelerator.save_state(str(tmp), safe_serialization=True)
        accelerator.wait_for_everyone()  # every rank's random_states_<rank>.pkl is on disk
        if accelerator.is_main_process:
            faults.save_point(step, "manifest")
            _write_files(tmp, step, {PROGRESS: progress.to_json(), **files}, write_extra)
    except (OSError, RuntimeError, SafetensorError) as exc:
        if not is_disk_full(exc):
            raise
        # several processes: the temporary stays for the next start's cleanup_stale; removed now, it would
        # break the other ranks' writes into it with errors of their own before they hear of this one
        raise disk_full_error(run_dir, tmp, exc, remove=accelerator.num_processes == 1) from None
    if accelerator.is_main_process:
        _publish(tmp, target)
        if keep_last is not None:
            rotate(run_dir, keep_last, best_metric)
    accelerator.wait_for_everyone()
    return target


def _write_files(tmp: Path, step: int, files: dict[str, str], write_extra: Callable[[Path], None] | None) -> None:
    """The text files, the extra files, then the manifest (last: it marks the checkpoint complete)."""
    for name, text in files.items():
        (tmp / name).write_text(text)
    if write_extra is not None:
        write_extra(tmp)
    listed = {
        str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": listed}, indent=2))
    _fsync_tree(tmp)


def _publish(tmp: Path, target: Path) -> None:
    """Rename a complete temporary into place (a same-step checkpoint goes to trash first)."""
    trash = target.with_name(f"{TRASH_PREFIX}{target.name}")
    if target.exists():
        if trash.exists():
            shutil.rmtree(trash)
        target.rename(trash)
    tmp.rename(target)
    _fsync_dir(target.parent)
    if trash.exists():
        shutil.rmtree(trash)


def is_disk_full(exc: BaseException) -> bool:
    """Whether a write failed for want of space (OSError, safetensors' and torch.save's errors)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    signs = ("No space left on device", "StorageFull", "Disk quota exceeded", "file write failed")
    return any(s in text for s in signs)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def disk_full_error(run_dir: Path, tmp: Path, exc: BaseException, remove: bool = True) -> UserError:
    """One line for a save that filled the disk; removes the temporary first (with `remove`)."""
    written = _tree_bytes(tmp)
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)
    done = [p for p in list_checkpoints(run_dir) if verify_checkpoint(p, deep=False) is None]
    need = max(_tree_bytes(done[-1]) if done else 0, written)
    free = shutil.disk_usage(run_dir).free
    intact = f"the previous checkpoint {done[-1]} is intact" if done else "no earlier checkpoint exists"
    return UserError(
        f"the disk is full: saving a checkpoint into {tmp.parent} needs about {need / 2**20:,.0f} MiB, "
        f"{free / 2**20:,.0f} MiB are free ({type(exc).__name__}); {intact}; free some space and resume with "
        "checkpoint.resume=auto"
    )


def estimate_disk_need(checkpoint_bytes: int, final_bytes: int, keep_last: int, checkpoints: bool) -> int:
    """Bytes the run will hold at most: `keep_last` checkpoints, the best one, one being written, final/."""
    return (keep_last + 2) * checkpoint_bytes * checkpoints + final_bytes


def warn_if_disk_small(run_dir: Path, need: int) -> None:
    """A warning at start when the run's disk cannot hold what the run will write."""
    free = shutil.disk_usage(run_dir).free
    if free < need:
        logger.warning(
            f"warning: {run_dir} has {free / 2**20:,.0f} MiB free but the run may write about {need / 2**20:,.0f} MiB "
            "(checkpoint.keep_last + the best + one being saved, and final/): free space or lower checkpoint.keep_last"
        )


# ----------------------------------------------------------------------------------------------
# Finding and validating.


def verify_checkpoint(path: Path, deep: bool = True) -> str | None:
    """None when `path` is a complete checkpoint, else the reason it is not.

    Checks the manifest is present, every listed file exists with its size, nothing listed is
    missing, and (deep) every sha256 matches.
    """
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return "no manifest (incomplete write)"
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "unreadable manifest"
    if PROGRESS not in files:
        return f"manifest lists no {PROGRESS}"
    for name, meta in files.items():
        p = path / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{name} has {p.stat().st_size} bytes, the manifest says {meta['size']} (truncated?)"
    if deep:
        for name, meta in files.items():
            if file_sha256(path / name) != meta["sha256"]:
                return f"{name} does not match its sha256 in the manifest (corrupt)"
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """All `step_*` directories of a run (complete or not), oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir())


def read_progress(path: Path) -> TrainingProgress:
    """progress.json of a checkpoint."""
    return TrainingProgress.read(path)


def cleanup_stale(run_dir: Path) -> list[Path]:
    """Remove temporaries left by a crash during a save or a rotation; return what was removed.

    A complete `.trash-step_<N>` without its `step_<N>` (a crash between the two renames of a
    replacement) is renamed back instead.
    """
    root = run_dir / "checkpoints"
    removed = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name.startswith(TRASH_PREFIX):
                original = p.with_name(p.name[len(TRASH_PREFIX) :])
                if not original.exists() and verify_checkpoint(p, deep=False) is None:
                    p.rename(original)
                    continue
            if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def newest_valid_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint; skipped ones are reported with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        reason = verify_checkpoint(path)
        if reason is None:
            return path
        logger.warning(f"warning: skipping checkpoint {path}: {reason}")
    return None


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v) and key.count(".") == 0:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Result-changing keys (dotted) whose values differ between two resolved configs."""
    a, b = _flatten(saved), _flatten(current)
    keys = sorted(set(a) | set(b))
    # the keys the schema declares may change (config.MAY_CHANGE_ON_RESUME); every other key must match
    harmless = keys_that_may_change_on_resume()
    if a.get("train.early_stopping_patience") is not None or b.get("train.early_stopping_patience") is not None:
        harmless = harmless - {"train.eval_every_steps"}  # evaluations decide the step where training stops
    return [k for k in keys if k not in harmless and a.get(k) != b.get(k)]


def _resolved_config(path: Path) -> dict[str, Any]:
    """A saved config.yaml, validated so that keys added later get their defaults."""
    raw = parse_yaml12(path.read_text(), source=str(path)) or {}
    try:
        return validate_config(raw, source=str(path)).model_dump(mode="json")
    except UserError:  # keys that no longer exist: compare as saved (they will show as differences)
        return raw


def check_compatible(path: Path, current: dict[str, Any], data_sha256: dict[str, str]) -> None:
    """Refuse to resume `path` under a config (or data) that would change the result.

    Raises:
        UserError: the config or a data file changed in a way that changes the result.
    """
    saved = _resolved_config(path / "config.yaml")
    diffs = config_differences(saved, current)
    if diffs:
        a, b = _flatten(saved), _flatten(current)
        shown = "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in diffs[:5])
        raise UserError(
            f"cannot resume from {path}: the config changed in a way that changes the result ({shown}); "
            "restore those values, or start a new run (checkpoint.resume=null with another run.output_dir)"
        )
    saved_data = read_progress(path).data_sha256
    for split, digest in data_sha256.items():
        if split in saved_data and saved_data[split] != digest:
            raise UserError(
                f"cannot resume from {path}: the {split} data file changed (sha256 differs from the checkpoint's)"
            )


def _empty(run_dir: Path) -> bool:
    """No run directory, or nothing in it but an empty checkpoints/ folder (and a teacher cache)."""
    if not run_dir.is_dir():
        return True
    return all(p.name == "checkpoints" and p.is_dir() and not any(p.iterdir()) for p in run_files(run_dir))


def run_files(run_dir: Path) -> list[Path]:
    """What a run directory holds besides a distilling run's teacher cache (`TEACHER_DIR`), which a run stopped
    while its teacher computed leaves alone; the cache checks itself against its teacher and texts."""
    return [p for p in run_dir.iterdir() if p.name != TEACHER_DIR]


def clear_run_dir(run_dir: Path, keep_teacher: bool) -> None:
    """`run.overwrite`: empty the run directory; with `keep_teacher` all but the teacher cache, which a distilling
    run has computed (or checked) before it clears its directory."""
    if not run_dir.is_dir():
        return
    for p in run_files(run_dir) if keep_teacher else list(run_dir.iterdir()):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _holds_this_run(run_dir: Path, current: dict[str, Any]) -> bool:
    """The directory's config.yaml is this config, up to harmless keys."""
    saved = run_dir / "config.yaml"
    return saved.is_file() and not config_differences(_resolved_config(saved), current)


def find_resume_checkpoint(
    resume: str | None, run_dir: Path, current: dict[str, Any] | None = None, data_sha256: dict[str, str] | None = None
) -> Path | None:
    """The checkpoint to resume from, or None to start fresh.

    `auto`: the newest complete checkpoint of `run_dir` (incomplete or corrupt ones are skipped
    with a warning); a non-empty `run_dir` that holds no run of this config is refused.
    A path: that checkpoint, which must be complete; the run continues in `run_dir`, which must be
    empty, the checkpoint's own run, or a run of this config. Either way the config must be compatible.

    Raises:
        UserError: the checkpoint is incomplete, or the run directory holds another run.
    """
    if resume is None:
        return None
    current = current or {}
    if resume == "auto":
        found = newest_valid_checkpoint(run_dir)
        if found is None:
            if not _empty(run_dir):
                if not _holds_this_run(run_dir, current):
                    raise UserError(
                        f"checkpoint.resume=auto: run.output_dir {run_dir} is not empty and holds no run of this "
                        "config; "
                        "choose another run.output_dir (or set run.overwrite=true with checkpoint.resume=null)"
                    )
                logger.warning(f"warning: {run_dir} holds no complete checkpoint of this run yet: starting from step 0")
            return None
    else:
        found = Path(resume)
        if not found.is_dir():
            raise UserError(f"checkpoint.resume: {found} is not a directory")
        reason = verify_checkpoint(found)
        if reason is not None:
            raise UserError(f"checkpoint.resume: {found} is not a complete checkpoint: {reason}")
        own_run = found.resolve().parent.parent == run_dir.resolve()
        if not own_run and not _empty(run_dir) and not _holds_this_run(run_dir, current):
            raise UserError(
                f"checkpoint.resume={found}: run.output_dir {run_dir} is not empty and holds no run of this config; "
                "continue into an empty run.output_dir"
            )
    check_compatible(found, current, data_sha256 or {})
    return found


def state_layout(path: Path) -> str:
    """How a checkpoint holds the model: as Accelerate's `save_state` wrote it under FSDP or not."""
    if (path / "pytorch_model_fsdp_0").is_dir():
        return "FSDP sharded state dict"
    if (path / "pytorch_model_fsdp.bin").is_file():
        return "FSDP full state dict"
    return "whole model (one process or DDP)"


def launch_layout(accelerator: Accelerator) -> str:
    """The layout this launch's `save_state` writes and `load_state` reads (see `state_layout`)."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return "whole model (one process or DDP)"
    sharded = "SHARDED" in str(accelerator.state.fsdp_plugin.state_dict_type)
    return "FSDP sharded state dict" if sharded else "FSDP full state dict"


def check_state_layout(path: Path, accelerator: Accelerator) -> None:
    """Refuse to resume a checkpoint that this launch's `load_state` cannot read.

    Raises:
        UserError: the checkpoint was written with FSDP and this launch has none, or the reverse, or
            with the other FSDP state dict type (Accelerate would fail on a missing file).
    """
    saved, now = state_layout(path), launch_layout(accelerator)
    if saved != now:
        raise UserError(
            f"checkpoint.resume: {path} holds the {saved}, but this launch reads the {now}; resume it with the "
            "Accelerate config that wrote it (distributed_type, fsdp_state_dict_type)"
        )


def load_checkpoint(accelerator: Accelerator, path: Path) -> TrainingProgress:
    """Restore model, optimizer, scheduler, scaler and RNG states; return progress.json."""
    accelerator.load_state(str(path))
    return read_progress(path)


# ----------------------------------------------------------------------------------------------
# Best metric, rotation and metrics history.


def is_better(metric: str, new: float, old: float | None) -> bool:
    """Whether `new` improves on `old` for `metric` (lower for loss and mse, `tasks.METRICS`; else higher)."""
    if old is None or (isinstance(old, float) and math.isnan(old)):
        return not math.isnan(new)
    return new < old if lower_is_better(metric) else new > old


def update_best(best: dict[str, Any], metric: str, metrics: dict[str, Any], step: int) -> bool:
    """Fold an evaluation into `best` ({value, step, bad_evals}); True when it improved.

    Raises:
        UserError: `metric` is not among the evaluation's metrics.
    """
    if metric not in metrics:
        raise UserError(
            f"checkpoint.best_metric={metric!r} is not an evaluation metric; choose one of "
            f"{sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))}"
        )
    value = float(metrics[metric])
    if is_better(metric, value, best.get("value")):
        best.update(value=value, step=step, bad_evals=0)
        return True
    best["bad_evals"] = best.get("bad_evals", 0) + 1
    return False


def _own_metric(path: Path, metric: str) -> float | None:
    """The checkpoint's `metric`, when its evaluation ran at the checkpoint's own step."""
    own = _own_eval(path, metric)
    return own[0] if own else None


def _own_eval(path: Path, metric: str) -> tuple[float, int] | None:
    """(`metric`, rows evaluated) of the checkpoint's own-step evaluation; None without one."""
    try:
        progress = read_progress(path)
    except (OSError, json.JSONDecodeError, TypeError):
        return None
    if progress.eval.get("step") != progress.step or metric not in progress.eval:
        return None
    return float(progress.eval[metric]), int(progress.eval.get("num_samples") or 0)


def standard_error(value: float, samples: int) -> float:
    """The binomial standard error of a proportion `value` measured on `samples` rows (0 without rows)."""
    return math.sqrt(max(0.0, value * (1 - value)) / samples) if samples > 0 else 0.0


@dataclass(frozen=True)
class BestRule:
    """How the best checkpoint is chosen: by `metric`; with `within_se` > 0, the latest checkpoint within that
    many standard errors of the best value seen (`reference`: the run's best, which rotation may have deleted)."""

    metric: str
    within_se: float = 0.0
    reference: float | None = None


def best_checkpoint(run_dir: Path, rule: BestRule | str) -> Path | None:
    """The complete checkpoint with the best own evaluation by `rule` (a metric name: the best, earliest on
    ties; checkpoint.best_within_se: the latest within that many standard errors of the best)."""
    rule = BestRule(rule) if isinstance(rule, str) else rule
    scored = [(path, own) for path in list_checkpoints(run_dir) if (own := _checked_eval(path, rule.metric))]
    if not scored:
        return None
    best = scored[0]
    for path, own in scored[1:]:
        if is_better(rule.metric, own[0], best[1][0]):
            best = (path, own)
    if not rule.within_se:
        return best[0]
    top = best[1][0]
    if rule.reference is not None and is_better(rule.metric, rule.reference, top):
        top = rule.reference
    # the metric is a proportion (config): higher is better; the same validation rows give every evaluation
    near = [path for path, (value, rows) in scored if value >= top - rule.within_se * standard_error(top, rows)]
    return near[-1] if near else best[0]


def _checked_eval(path: Path, metric: str) -> tuple[float, int] | None:
    return None if verify_checkpoint(path, deep=False) is not None else _own_eval(path, metric)


def rotate(run_dir: Path, keep_last: int, metric: BestRule | str) -> list[Path]:
    """Delete checkpoints except the newest `keep_last` complete ones and the best; return deleted.

    Incomplete directories older than the newest complete checkpoint go too; newer incomplete
    ones stay for inspection (resume skips them with a warning; a new save of that step replaces them).
    """
    all_ckpts = list_checkpoints(run_dir)
    complete = [p for p in all_ckpts if verify_checkpoint(p, deep=False) is None]
    if not complete:
        return []
    keep = set(complete[-keep_last:])
    best = best_checkpoint(run_dir, metric)
    if best is not None:
        keep.add(best)
    deleted = [p for p in all_ckpts if p not in keep and p.name < complete[-1].name]
    for p in deleted:
        _remove(p)
    return deleted


WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's wrappers name parameters so


def load_best_weights(
    accelerator: Accelerator, model: torch.nn.Module, run_dir: Path, rule: BestRule | str
) -> Path | None:
    """`checkpoint.export=best`: put the best checkpoint's weights (by `rule`) into `model` before the export.

    Loads into the unwrapped model on every process, whatever wrapper prefix the checkpoint's keys
    carry (a DDP run saves `module.`-prefixed keys), or under FSDP through Accelerate's FSDP loader
    (each rank takes its shard); returns the checkpoint, None when no
    checkpoint has its own evaluation (final/ then holds the last weights).
    """
    rule = BestRule(rule) if isinstance(rule, str) else rule
    best, metric = best_checkpoint(run_dir, rule), rule.metric
    if best is None:
        logger.warning(f"warning: no checkpoint has its own evaluation of {metric}: final/ holds the last weights")
        return None
    near = f", the latest within {rule.within_se:g} standard errors of the best" if rule.within_se else ""
    line = f"final/ holds the best checkpoint by {metric}{near}: {best.name} ({_own_metric(best, metric)})"
    if accelerator.distributed_type == DistributedType.FSDP:  # sharded parameters: Accelerate's own loader
        from accelerate.utils import load_fsdp_model

        load_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, str(best))
        logger.info(line)
        return best
    # safetensors names devices as torch does except CPU: a multi-process CPU (gloo) run's device is
    # "cpu:0", which it refuses; CPU tensors load as "cpu"
    device = accelerator.device
    state = load_file(str(best / "model.safetensors"), device="cpu" if device.type == "cpu" else str(device))
    for prefix in WRAPPER_PREFIXES:
        state = {k.removeprefix(prefix): v for k, v in state.items()}
    accelerator.unwrap_model(model).load_state_dict(state, strict=True)
    logger.info(line)
    return best


def trim_metrics(metrics_file: Path, step: int) -> None:
    """Drop metrics rows after `step` (a resumed run logs those steps again)."""
    if not metrics_file.is_file():
        return
    kept = [row for row in read_jsonl(metrics_file) if row.get("step", 0) <= step]  # a torn line goes too
    tmp = metrics_file.with_suffix(".tmp")
    # json.dumps as metrics.record_row writes them, so a kept row's line is unchanged byte for byte
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
    tmp.replace(metrics_file)


# ----------------------------------------------------------------------------------------------
# The run directory.


def check_output_dir(cfg: Config) -> Path:
    """Refuse a non-empty output directory unless resuming or `run.overwrite=true` (writes nothing).

    Raises:
        UserError: the directory is a file, or not empty without resume/overwrite, or not a run's.
    """
    out = Path(cfg.run.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"run.output_dir {out} exists and is not a directory")
    if out.is_dir() and (out / "audit.yaml").is_file() and not (out / "config.yaml").is_file():
        # `finetune audit`'s directory (its label_issues.csv is what a run without those rows reads)
        raise UserError(f"run.output_dir {out} holds a finetune audit; train into another one, e.g. {out}-clean")
    filled = out.is_dir() and bool(run_files(out))
    if filled and cfg.checkpoint.resume is None and not cfg.run.overwrite:
        raise UserError(f"run.output_dir {out} is not empty; set run.overwrite=true or checkpoint.resume=auto")
    if filled and cfg.run.overwrite and not (out / "config.yaml").is_file():
        # overwrite deletes the whole directory: only ever a run's own (`run.output_dir=.` or a parent would go too)
        raise UserError(
            f"run.output_dir {out} is not empty and holds no finetune run (no config.yaml); "
            "run.overwrite=true only replaces a run directory"
        )
    return out


def remove_tree(path: Path) -> None:
    """Remove a directory tree if it exists."""
    if path.exists():
        shutil.rmtree(path)
