"""Test-only fault injection: off unless a test turns it on.

The one switch is the environment variable `FINETUNE_TEST_ONLY_FAULTS="kind:N[,kind:N]"`, set by
tests (in-process with `monkeypatch.setenv`, or for a subprocess) and by scripts/chaos_resume.py.
Its name says what it is for, so no user's inherited environment sets it by accident, and a run
with it set says so loudly in its log (`announce`). The training loop calls it at named points only:

    sigterm_at_step:N, sigint_at_step:N     send the signal to this process right after optimizer step N
    sigterm_at_batch:N, sigint_at_batch:N   ... after micro-batch N (counted over the whole run)
    wait_at_step:N        after step N write <run>/fault_waiting (our pid) and wait for a signal
    kill_node_at_step:N   after step N SIGKILL this process's launcher and this process (a node lost)
    crash_in_save:N       raise InjectedCrash after the state files of step N are written, before the manifest
    disk_full_in_save:N   raise OSError(ENOSPC) while the state files of step N are being written
    oom_at_step:N         raise torch.OutOfMemoryError once, in the window of step N (its second micro-batch)
    oom_in_step:N         raise torch.OutOfMemoryError once, inside optimizer step N
    oom_in_eval:N         raise torch.OutOfMemoryError once, in the first evaluation batch after step N
    nonfinite_at_step:N   make the losses of the window of step N infinite
    clock_step_seconds:N  the time budget's clock (budget.py) advances N seconds an optimizer step, not in real time

`kind:N@R` limits a fault to the process of rank R (RANK, set by the launcher): one rank of several
failing alone is what leaves the others waiting in a collective.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from pathlib import Path
from typing import Protocol

import torch

logger = logging.getLogger("finetune")

ENV = "FINETUNE_TEST_ONLY_FAULTS"
_fired: set[tuple[str, int]] = set()  # one-shot faults already raised in this process
_step = 0  # the last optimizer step the loop passed (`signal_point`): where `oom_in_eval` counts from


class InjectedCrash(RuntimeError):
    """Raised by the `crash_in_save` fault: the process 'dies' half way through a save."""


class _Signalled(Protocol):
    signal_name: str | None


def spec() -> str:
    """The active fault specification ('' when fault injection is off)."""
    return os.environ.get(ENV, "")


def announce() -> None:
    """At the start of a run: forget earlier runs' one-shot faults; log loudly when injection is on."""
    global _step
    _fired.clear()
    _step = 0
    if spec():
        logger.warning(
            f"WARNING: test-only fault injection is ON ({ENV}={spec()!r}); this run will be interrupted on purpose"
        )


def at(kind: str, value: int) -> bool:
    """True when the active specification asks for fault `kind` at `value` (on this rank, for `kind:N@R`)."""
    for item in spec().split(","):
        name, _, where = item.strip().partition(":")
        n, _, rank = where.partition("@")
        if rank.strip() and rank.strip() != os.environ.get("RANK", "0"):
            continue
        if name == kind and n.strip().isdigit() and int(n) == value:
            return True
    return False


def value(kind: str) -> int | None:
    """N of the active `kind:N` (on this rank, for `kind:N@R`); None when it is not asked for."""
    for item in spec().split(","):
        name, _, where = item.strip().partition(":")
        n, _, rank = where.partition("@")
        if name == kind and n.strip().isdigit() and (not rank.strip() or rank.strip() == os.environ.get("RANK", "0")):
            return int(n)
    return None


def _once(kind: str, value: int) -> bool:
    if not at(kind, value) or (kind, value) in _fired:
        return False
    _fired.add((kind, value))
    return True


def signal_point(where: str, n: int, run_dir: Path, guard: _Signalled) -> None:
    """After micro-batch `n` (where="batch") or optimizer step `n` (where="step")."""
    global _step
    if where == "step":
        _step = n
    if not spec():
        return
    if at(f"sigterm_at_{where}", n):
        os.kill(os.getpid(), signal.SIGTERM)
    if at(f"sigint_at_{where}", n):
        os.kill(os.getpid(), signal.SIGINT)
    if where == "step" and at("kill_node_at_step", n):  # the launcher first: it would report the worker's death
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "step" and at("wait_at_step", n):
        wait_for_signal(run_dir, guard)


def wait_for_signal(run_dir: Path, guard: _Signalled, timeout_s: float = 120.0) -> None:
    """The `wait_at_step` fault: announce our pid in `<run>/fault_waiting`, wait for a signal."""
    marker = run_dir / "fault_waiting"
    marker.write_text(str(os.getpid()))
    deadline = time.monotonic() + timeout_s
    while guard.signal_name is None and time.monotonic() < deadline:
        time.sleep(0.05)
    marker.unlink(missing_ok=True)


def save_point(step: int, stage: str) -> None:
    """Inside a checkpoint save: stage "state" (files being written) or "manifest" (before it)."""
    if stage == "state" and at("disk_full_in_save", step):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    if stage == "manifest" and at("crash_in_save", step):
        raise InjectedCrash(f"injected crash while saving step {step}")


def last_step() -> int:
    """The last optimizer step the loop passed in this run (0 before the first): evaluation's faults count from it,
    so no step number travels through evaluation's signatures for a test's sake."""
    return _step


def oom_point(kind: str, step: int, index_in_window: int = 0, accumulation: int = 1) -> None:
    """Raise an injected out-of-memory error once: `oom_at_step` in the second micro-batch of the
    window (the first when there is one), `oom_in_step` / `oom_in_eval` at their call."""
    if kind == "oom_at_step" and index_in_window != min(1, accumulation - 1):
        return
    if _once(kind, step):
        raise torch.OutOfMemoryError(f"injected out-of-memory ({kind}:{step}, {ENV})")


def nonfinite_point(per_sample: torch.Tensor, step: int) -> torch.Tensor:
    """The `nonfinite_at_step` fault: infinite losses in the window of step `step`."""
    return per_sample * float("inf") if spec() and at("nonfinite_at_step", step) else per_sample
