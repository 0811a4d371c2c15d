"""Checkpoints: atomic, verified, rotated; exact resume; preemption by signals.

A checkpoint is `<run>/checkpoints/step_<N>/` holding Accelerate's `save_state` files (model as
safetensors, optimizer, scheduler, scaler, one `random_states_<rank>.pkl` per process),
`progress.json` (where the loop stands), the resolved `config.yaml`, `eval.json`, the memory
report and `manifest.json` (size and sha256 of every other file). It is written into a
temporary directory beside the target (`.tmp-step_<N>`), fsynced, and renamed into place by the
main process after a barrier; the manifest is written last, so a directory without a matching
manifest is incomplete and is never loaded.

Exit codes after a preemption checkpoint: 143 (SIGTERM) and 130 (SIGINT), see docs/RESUME.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import torch
from accelerate import Accelerator

from finetune.errors import UserError

logger = logging.getLogger("finetune")

PROGRESS = "progress.json"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"  # a checkpoint being written (never named step_*)
TRASH_PREFIX = ".trash-"  # a checkpoint being deleted (renamed first, so deletion is atomic too)
EXIT_CODES = {"SIGTERM": 143, "SIGINT": 130}  # 128 + signal number, as a shell reports a killed job
FAULT_ENV = "FINETUNE_FAULT"

# Config keys whose change does not change the trained weights: resuming across them is allowed.
# Everything else (model, data, batch sizes, seed, optimizer, schedule, precision, any new key)
# must match the checkpoint's config.
HARMLESS_KEYS = {
    "run.output_dir",
    "run.overwrite",
    "train.eval_every_steps",
    "train.log_every_steps",
    "checkpoint.every_steps",
    "checkpoint.resume",
    "checkpoint.keep_last",
    "checkpoint.export",
    "memory.record_history",
    "log.trackers",
    "data.data_dir",  # where the files are; their content is compared by sha256 instead
    "data.num_workers",  # workers only read and collate; loaders have their own generators
    "precision.empty_cache",
}
# Metrics where lower is better; any other metric (accuracy, macro_f1, ...) is maximised.
LOWER_IS_BETTER = {"loss"}


# ----------------------------------------------------------------------------------------------
# Fault injection (tests and scripts/chaos_resume.py): FINETUNE_FAULT="kind:N[,kind:N]".
#   sigterm_at_step:N    send SIGTERM to this process right after optimizer step N
#   sigterm_at_batch:N   send SIGTERM to this process after micro-batch N (global count)
#   sigint_at_step:N, sigint_at_batch:N   the same with SIGINT (Ctrl-C)
#   crash_in_save:N      raise after the state files of step N are written, before the manifest
#   wait_at_step:N       after step N write <run>/fault_waiting (our pid) and wait for a signal


def fault(kind: str, value: int) -> bool:
    """True when FINETUNE_FAULT asks for fault `kind` at `value`."""
    spec = os.environ.get(FAULT_ENV, "")
    for item in spec.split(","):
        name, _, n = item.strip().partition(":")
        if name == kind and n.strip().isdigit() and int(n) == value:
            return True
    return False


def inject_faults(where: str, n: int, run_dir: Path, guard: "PreemptionGuard") -> None:
    """Called by the loop after micro-batch `n` (where="batch") or optimizer step `n` (where="step")."""
    if FAULT_ENV not in os.environ:
        return
    if fault(f"sigterm_at_{where}", n):
        os.kill(os.getpid(), signal.SIGTERM)
    if fault(f"sigint_at_{where}", n):
        os.kill(os.getpid(), signal.SIGINT)
    if where == "step" and fault("wait_at_step", n):
        wait_for_signal(run_dir, guard)


class InjectedCrash(RuntimeError):
    """Raised by the `crash_in_save` fault: the process 'dies' half way through a save."""


# ----------------------------------------------------------------------------------------------
# Preemption.


class Preempted(Exception):
    """Raised by the loop after the preemption checkpoint is on disk; entry points turn it into an exit code."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by {signal_name} at step {step}; checkpoint {checkpoint}")
        self.signal_name = signal_name
        self.step = step
        self.checkpoint = checkpoint
        self.exit_code = EXIT_CODES.get(signal_name, 143)


def _set_parent_death_signal() -> None:
    """Linux: have the kernel send us SIGTERM when our parent (the launcher) dies.

    `accelerate launch` forwards no signals: a SIGTERM sent to the launcher alone kills it and
    the training process would run on unaware. Only done under a launcher (its environment
    variables are set), because a plain `nohup finetune train &` must survive its shell.
    """
    if not sys.platform.startswith("linux"):
        return
    launched = any(k in os.environ for k in ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"))
    if not launched:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class PreemptionGuard:
    """SIGTERM/SIGINT set a flag; the loop checks it at optimizer-step boundaries.

    Used as a context manager so the previous handlers come back afterwards (tests run
    `main()` in-process under pytest, whose SIGINT handler must survive).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            if os.environ.get("RANK", "0") == "0":
                print(f"\n{name} received: saving a checkpoint at the end of this optimizer step", file=sys.stderr, flush=True)
        elif signum == signal.SIGINT:  # a second Ctrl-C means: stop now
            raise KeyboardInterrupt

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            _set_parent_death_signal()
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def requested(self, accelerator: Accelerator) -> str | None:
        """The signal to stop for, agreed by all processes (any rank signalled -> all stop at this step)."""
        if accelerator.num_processes == 1:
            return self.signal_name
        code = {None: 0, "SIGINT": 1, "SIGTERM": 2}.get(self.signal_name, 2)
        agreed = int(accelerator.reduce(torch.tensor(code, device=accelerator.device), "max").item())
        return {0: None, 1: "SIGINT", 2: "SIGTERM"}[agreed]


def resume_hint(prog: str, config: str, overrides: list[str]) -> str:
    """The one command that resumes a run (the overrides kept, checkpoint.resume set to auto)."""
    kept = [o for o in overrides if not o.startswith("checkpoint.resume=") and not o.startswith("run.overwrite=")]
    return " ".join([prog, "--config", config, *kept, "checkpoint.resume=auto"])


def wait_for_signal(run_dir: Path, guard: PreemptionGuard, timeout_s: float = 120.0) -> None:
    """The `wait_at_step` fault: announce our pid in `<run>/fault_waiting`, wait for a signal."""
    marker = run_dir / "fault_waiting"
    marker.write_text(str(os.getpid()))
    deadline = time.monotonic() + timeout_s
    while guard.signal_name is None and time.monotonic() < deadline:
        time.sleep(0.05)
    marker.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# Determinism.


def configure_determinism(enabled: bool) -> None:
    """`precision.deterministic`: deterministic kernels, needed for bitwise exact resume on CUDA.

    Sets CUBLAS_WORKSPACE_CONFIG (must happen before cuBLAS initialises) and
    `torch.use_deterministic_algorithms(True)`; ops without a deterministic kernel then raise.
    CPU fp32 training is deterministic without it.
    """
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


# ----------------------------------------------------------------------------------------------
# Writing.


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """`checkpoints/step_<N>` with N zero-padded so names sort by step."""
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
    step: int,
    progress: dict[str, Any],
    files: dict[str, str],
    write_extra: Callable[[Path], None] | None = None,
    keep_last: int | None = None,
    best_metric: str = "accuracy",
) -> Path:
    """Write the checkpoint of optimizer step `step` atomically and return its path.

    Every process writes its share through `save_state` into the same temporary directory; the
    main process then adds progress.json, the text `files`, whatever `write_extra(tmp)` writes,
    and the manifest, fsyncs and renames. A checkpoint of the same step already there (the
    periodic one of the step where the run ends, or a broken leftover) is replaced: renamed to
    `.trash-step_<N>` first, which `cleanup_stale` renames back if a crash comes in between.
    With `keep_last`, older checkpoints are then rotated (`rotate`).
    """
    target = checkpoint_dir(run_dir, step)
    tmp = target.with_name(f"{TMP_PREFIX}{target.name}")
    if accelerator.is_main_process:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()  # every rank's random_states_<rank>.pkl is on disk
    if accelerator.is_main_process:
        if fault("crash_in_save", step):
            raise InjectedCrash(f"injected crash while saving step {step}")
        (tmp / PROGRESS).write_text(json.dumps(progress, indent=2))
        for name, text in files.items():
            (tmp / name).write_text(text)
        if write_extra is not None:
            write_extra(tmp)
        manifest = {
            "step": step,
            "files": {
                str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            },
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync_tree(tmp)
        trash = target.with_name(f"{TRASH_PREFIX}{target.name}")
        if target.exists():
            if trash.exists():
                shutil.rmtree(trash)
            target.rename(trash)
        tmp.rename(target)
        _fsync_dir(target.parent)
        if trash.exists():
            shutil.rmtree(trash)
        if keep_last is not None:
            rotate(run_dir, keep_last, best_metric)
    accelerator.wait_for_everyone()
    return target


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
            if _sha256(path / name) != meta["sha256"]:
                return f"{name} does not match its sha256 in the manifest (corrupt)"
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """All `step_*` directories of a run (complete or not), oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir())


def read_progress(path: Path) -> dict[str, Any]:
    """progress.json of a checkpoint."""
    return json.loads((path / PROGRESS).read_text())


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
                original = p.with_name(p.name[len(TRASH_PREFIX):])
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
    harmless = HARMLESS_KEYS
    if a.get("train.early_stopping_patience") is not None or b.get("train.early_stopping_patience") is not None:
        harmless = harmless - {"train.eval_every_steps"}  # evaluations decide the step where training stops
    return [k for k in keys if k not in harmless and a.get(k) != b.get(k)]


def _resolved_config(path: Path) -> dict[str, Any]:
    """A saved config.yaml, validated so that keys added later get their defaults."""
    from finetune.config import parse_yaml12, validate_config

    raw = parse_yaml12(path.read_text(), source=str(path)) or {}
    try:
        return validate_config(raw, source=str(path)).model_dump(mode="json")
    except UserError:  # keys that no longer exist: compare as saved (they will show as differences)
        return raw


def check_compatible(path: Path, current: dict[str, Any], data_sha256: dict[str, str]) -> None:
    """Refuse to resume `path` under a config (or data) that would change the result."""
    saved = _resolved_config(path / "config.yaml")
    diffs = config_differences(saved, current)
    if diffs:
        a, b = _flatten(saved), _flatten(current)
        shown = "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in diffs[:5])
        raise UserError(
            f"cannot resume from {path}: the config changed in a way that changes the result ({shown}); "
            "restore those values, or start a new run (checkpoint.resume=null with another run.output_dir)"
        )
    saved_data = read_progress(path).get("data_sha256", {})
    for split, digest in data_sha256.items():
        if split in saved_data and saved_data[split] != digest:
            raise UserError(f"cannot resume from {path}: the {split} data file changed (sha256 differs from the checkpoint's)")


def _empty(run_dir: Path) -> bool:
    """No run directory, or nothing in it but an empty checkpoints/ folder."""
    if not run_dir.is_dir():
        return True
    return all(p.name == "checkpoints" and p.is_dir() and not any(p.iterdir()) for p in run_dir.iterdir())


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
                        f"checkpoint.resume=auto: run.output_dir {run_dir} is not empty and holds no run of this config; "
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


def load_checkpoint(accelerator: Accelerator, path: Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, scaler and RNG states; return progress.json."""
    accelerator.load_state(str(path))
    return read_progress(path)


# ----------------------------------------------------------------------------------------------
# Best metric, rotation and metrics history.


def is_better(metric: str, new: float, old: float | None) -> bool:
    """Whether `new` improves on `old` for `metric` (loss: lower; everything else: higher)."""
    if old is None or (isinstance(old, float) and math.isnan(old)):
        return not math.isnan(new)
    return new < old if metric in LOWER_IS_BETTER else new > old


def update_best(best: dict[str, Any], metric: str, metrics: dict[str, Any], step: int) -> bool:
    """Fold an evaluation into `best` ({value, step, bad_evals}); True when it improved."""
    if metric not in metrics:
        raise UserError(f"checkpoint.best_metric={metric!r} is not an evaluation metric; choose one of {sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))}")
    value = float(metrics[metric])
    if is_better(metric, value, best.get("value")):
        best.update(value=value, step=step, bad_evals=0)
        return True
    best["bad_evals"] = best.get("bad_evals", 0) + 1
    return False


def _own_metric(path: Path, metric: str) -> float | None:
    """The checkpoint's `metric`, when its evaluation ran at the checkpoint's own step."""
    try:
        progress = read_progress(path)
    except (OSError, json.JSONDecodeError):
        return None
    ev = progress.get("eval") or {}
    if ev.get("step") != progress.get("step") or metric not in ev:
        return None
    return float(ev[metric])


def best_checkpoint(run_dir: Path, metric: str) -> Path | None:
    """The complete checkpoint with the best own evaluation of `metric` (earliest on ties)."""
    best: tuple[float, Path] | None = None
    for path in list_checkpoints(run_dir):
        if verify_checkpoint(path, deep=False) is not None:
            continue
        value = _own_metric(path, metric)
        if value is not None and (best is None or is_better(metric, value, best[0])):
            best = (value, path)
    return best[1] if best else None


def rotate(run_dir: Path, keep_last: int, metric: str) -> list[Path]:
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


def load_best_weights(accelerator: Accelerator, model: torch.nn.Module, run_dir: Path, metric: str) -> Path | None:
    """`checkpoint.export=best`: put the best checkpoint's weights into `model` before the export."""
    best = best_checkpoint(run_dir, metric)
    if best is None:
        logger.warning(f"warning: no checkpoint has its own evaluation of {metric}: final/ holds the last weights")
        return None
    from safetensors.torch import load_model

    load_model(accelerator.unwrap_model(model), str(best / "model.safetensors"), device=str(accelerator.device))
    logger.info(f"final/ holds the best checkpoint by {metric}: {best.name} ({_own_metric(best, metric)})")
    return best


def trim_metrics(metrics_file: Path, step: int) -> None:
    """Drop metrics rows after `step` (a resumed run logs those steps again)."""
    if not metrics_file.is_file():
        return
    rows = [line for line in metrics_file.read_text().splitlines() if line.strip()]
    kept = []
    for line in rows:
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line torn by a kill
    tmp = metrics_file.with_suffix(".tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    tmp.replace(metrics_file)


def remove_tree(path: Path) -> None:
    """Remove a directory tree if it exists."""
    if path.exists():
        shutil.rmtree(path)
