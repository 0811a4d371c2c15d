"""One rank's failure ends every rank, and a lost node is noticed: the watcher beside every training process.

With several processes (one job over one or more machines), each rank runs a daemon thread (`watch_other_ranks`)
that polls the process group's key-value store: the first failure reported there (`end_job`) ends every rank
with its exit code, and every rank beats there so that the main process notices a rank gone silent and the
others notice the main node's loss through its store. The line a lost node costs is nodes.py's (`on_peer_lost`).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("finetune")


# ----------------------------------------------------------------------------------------------
# One rank's failure ends every rank.

FAILURE_KEY = "finetune/failure"  # "<rank>\t<exit code>" of the first rank that failed
FAILURE_SEEN = "finetune/failure_seen"  # how many other ranks have seen it
FAILURE_POLL_S = 0.2
_watcher: threading.Thread | None = None
_stop_watching = threading.Event()


def _rank_store() -> Any | None:
    """The process group's key-value store (Accelerate's launch creates it), or None with one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    # torch has no public accessor; the group's own store reaches every rank without a port of our own
    return dist.distributed_c10d._get_default_store()


def watch_other_ranks() -> None:
    """With several processes: a daemon thread that ends this process with the failed rank's exit code as
    soon as another rank reports a failure (`end_job`), and that notices a lost node (`_watch_peers`).

    A rank that stops (a full disk, out of memory) leaves the others in a collective: NCCL waits until its
    timeout (10 minutes) or the launcher's kill, gloo raises a traceback of its own. The store is polled
    outside the collectives, which release the GIL while they wait. The thread holds the store while the
    process group lives and lets go when `end_training` destroys it or at exit: a store kept alive into
    the interpreter's shutdown aborted the process ("terminate called without an active exception").
    """
    global _watcher
    if _rank_store() is None or (_watcher is not None and _watcher.is_alive()):
        return
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()

    def watch() -> None:
        held = _rank_store()  # the same client after the group is destroyed: this rank's "done" mark
        peers = _PeerBeats(world, time.monotonic())
        try:
            while not _stop_watching.wait(FAILURE_POLL_S):
                store = _rank_store()
                if store is None:  # the process group is gone: the run is over
                    return
                try:
                    failed = store.get(FAILURE_KEY).decode() if store.check([FAILURE_KEY]) else None
                    if failed is not None and int(failed.split("\t")[0]) != rank:  # not this rank's own: end_job's
                        store.add(FAILURE_SEEN, 1)
                        _flush_and_exit(int(failed.split("\t")[1]))
                    _watch_peers(store, rank, peers)
                except Exception:  # noqa: BLE001 - the store is gone: its host (the main node) or the launcher
                    # a main node that ended normally goes too: lost only if this rank still runs after a grace
                    if rank != 0 and not _stop_watching.wait(STORE_GRACE_S) and _rank_store() is not None:
                        _end_for_lost([0], "its store stopped answering", None)
                    return
                del store
        except Exception:  # noqa: BLE001 - the launcher is ending the job
            return
        finally:
            try:  # ended normally (the group destroyed, or the interpreter exiting): not a lost rank
                held.set(f"{DONE_KEY}{rank}", "1")
            except Exception:  # noqa: BLE001 - the store went first
                pass
            del held

    _stop_watching.clear()
    _watcher = threading.Thread(target=watch, name="finetune-failure-watch", daemon=True)
    _watcher.start()


# ----------------------------------------------------------------------------------------------
# A lost node: every rank beats in the store; a rank whose beat stops while the job runs is lost.
#
# A collective with a dead peer fails at once when the peer's machine closes the connection (a killed
# process), but waits for the process group's timeout when nothing answers at all (a machine that lost
# power or its network). Beats come from this thread, which runs while the main thread computes,
# evaluates or writes a checkpoint, so a slow evaluation does not look like a lost node; the collective
# timeout (`COLLECTIVE_TIMEOUT_S`) stays long, for a rank that is alive but stuck.

BEAT_KEY = "finetune/beat/"  # + rank: a counter each rank adds to every BEAT_S
DONE_KEY = "finetune/done/"  # + rank: set when its process group ended normally
BEAT_S = 1.0
PEER_TIMEOUT_S = 30.0  # no beat for this long: the rank is lost (the main process checks every rank)
STORE_GRACE_S = 3.0  # a rank other than 0 whose store stops answering: still running after this, the main node is lost
LOST_SAMPLE_S = 2.5  # after a failed collective: ranks whose beat did not move in this time are the lost ones
COLLECTIVE_TIMEOUT_S = 1800  # gloo's default; NCCL's is 10 minutes (the launcher's kill came first)
_peer_lost_line: Callable[[list[int], str], str] | None = None
_ending = threading.Lock()


@dataclass
class _PeerBeats:
    """The main process's view of every rank's beat counter and when it last moved."""

    world: int
    started: float
    last_beat: float = 0.0
    counts: dict[int, int] = field(default_factory=dict)
    moved: dict[int, float] = field(default_factory=dict)


def on_peer_lost(describe: Callable[[list[int], str], str]) -> None:
    """Set how a lost node is told: `describe(lost ranks, how it was noticed)` returns the one line."""
    global _peer_lost_line
    _peer_lost_line = describe


def _watch_peers(store: Any, rank: int, peers: _PeerBeats) -> None:
    now = time.monotonic()
    if now - peers.last_beat < BEAT_S:
        return
    peers.last_beat = now
    store.add(f"{BEAT_KEY}{rank}", 1)
    if rank != 0:  # the main process watches every rank; the others notice its loss through its store
        return
    for r in range(1, peers.world):
        count = store.add(f"{BEAT_KEY}{r}", 0)
        if count != peers.counts.get(r):
            peers.counts[r], peers.moved[r] = count, now
        silent = now - peers.moved.get(r, peers.started)
        if silent > PEER_TIMEOUT_S and not store.check([f"{DONE_KEY}{r}"]):
            _end_for_lost([r], f"no heartbeat for {silent:.0f} s", store)


def lost_ranks(store: Any, rank: int, world: int, wait_s: float = LOST_SAMPLE_S) -> list[int]:
    """The ranks whose beat does not move within `wait_s` (a live rank beats every BEAT_S)."""
    before = [store.add(f"{BEAT_KEY}{r}", 0) for r in range(world)]
    time.sleep(wait_s)
    after = [store.add(f"{BEAT_KEY}{r}", 0) for r in range(world)]
    return [r for r in range(world) if r != rank and after[r] == before[r]]


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because a peer went away (gloo's or NCCL's error)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out")
    )


def end_if_peer_lost(exc: BaseException) -> None:
    """After `exc` ended the main thread of one of several ranks: if a collective failed because a rank is
    gone, end the job with the one line that names it (exit 2); otherwise return."""
    store = _rank_store()
    if store is None or not is_collective_failure(exc):
        return
    import torch.distributed as dist

    try:
        lost = lost_ranks(store, dist.get_rank(), dist.get_world_size())
    except Exception:  # noqa: BLE001 - the store is gone with its host, the main node
        lost = [0]
        store = None
    if lost:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0][:160]  # gloo's "[source:line] " prefix
        _end_for_lost(lost, f"a collective failed: {first}", store)


def _end_for_lost(lost: list[int], how: str, store: Any | None) -> None:
    """Print the lost node's line once per job and end this process with exit code 2."""
    if not _ending.acquire(blocking=False):  # another thread of this process is ending it
        time.sleep(60)
        _flush_and_exit(2)
    describe = _peer_lost_line or (lambda ranks, why: f"rank(s) {ranks} lost ({why})")
    line = f"error: {describe(lost, how)}"
    if store is None:
        print(line, file=sys.stderr, flush=True)
        _flush_and_exit(2)
    end_job(line, 2, wait_s=5.0, lost=len(lost))


def _stop_watcher() -> None:
    _stop_watching.set()
    if _watcher is not None:
        _watcher.join(timeout=2.0)


atexit.register(_stop_watcher)


def several_processes() -> bool:
    """Whether this process is one rank of several (a launched job with its process group)."""
    return _rank_store() is not None


def end_job(line: str, code: int, wait_s: float = 10.0, lost: int = 0) -> int:
    """Print `line` (the one-line error) on stderr and return `code`; with several processes, end every rank.

    The job's first failure is reported to the other ranks (their `watch_other_ranks` ends them with its
    code); only the first failing rank prints its line. It waits, up to `wait_s`, until the others have
    seen it (leaving earlier breaks their collectives: gloo prints a traceback of its own), ignores the
    launcher's SIGTERM meanwhile, and ends at once with the first failure's code (the interpreter's
    clean-up took seconds with a process group whose peers are gone). `lost` ranks are gone: none is waited for.
    """
    store = _rank_store()
    if store is None:
        if line:
            print(line, file=sys.stderr, flush=True)
        return code
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mine = f"{rank}\t{code}"
    try:
        first = store.compare_set(FAILURE_KEY, "", mine).decode()
        if first == mine:
            if line:
                print(line, file=sys.stderr, flush=True)
            deadline = time.monotonic() + wait_s
            while store.add(FAILURE_SEEN, 0) < world - 1 - lost and time.monotonic() < deadline:
                time.sleep(0.05)
        else:  # another rank failed first: its line and its code are the job's
            store.add(FAILURE_SEEN, 1)
            code = int(first.split("\t")[1])
    except Exception:  # noqa: BLE001 - no store left (the launcher is ending the job): say it here
        if line:
            print(line, file=sys.stderr, flush=True)
    _flush_and_exit(code)
    return code  # not reached


def _flush_and_exit(code: int) -> None:
    for handler in logger.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
