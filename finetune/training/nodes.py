"""Past one machine: what every node must share, and what a lost node costs.

Several machines (`accelerate launch --num_machines M --machine_rank R ...`) train one run; the main
process writes the run directory, every rank reads it (checkpoints on resume). So all nodes must see the
same directory: `check_shared_storage` proves it before any step. When a node is lost, the survivors end
with the one line of `node_loss_line` (ranks.py notices the loss).
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from finetune.core.errors import UserError
from finetune.training import checkpoint as ckpt
from finetune.training.runtime import local_processes

MARKER = ".shared-storage-check"


def node_rank() -> int:
    """This process's machine in the launch (torchrun's GROUP_RANK, `--machine_rank`); 0 on one machine."""
    value = os.environ.get("GROUP_RANK", "0")
    return int(value) if value.isdigit() else 0


def check_shared_storage(accelerator: Accelerator, run_dir: Path) -> None:
    """Every rank reads, at its own `run_dir`, the marker the main process has just written there.

    Called after the main process created the run directory and before any step: a node whose path is on
    its own disk would write its share of each checkpoint where no other rank reads it, and resume from
    a directory the main process never wrote.

    Raises:
        UserError: this rank does not find the main process's marker (names the node and the path).
    """
    if accelerator.num_processes == 1:
        return
    marker = run_dir / MARKER
    token = [secrets.token_hex(16) if accelerator.is_main_process else None]
    if accelerator.is_main_process:
        marker.write_text(token[0])
    broadcast_object_list(token, from_process=0)
    try:
        seen = marker.read_text().strip()
    except OSError:
        seen = None
    if seen != token[0]:
        what = "does not exist here" if seen is None else "holds another launch's marker"
        raise UserError(
            f"node {node_rank()} ({socket.gethostname()}, rank {accelerator.process_index}) does not see the run "
            f"directory the main process wrote: {marker} {what}; run.output_dir must be on storage every node "
            "shares (NFS, Lustre, a mounted bucket) at the same path (docs/SCALING.md)"
        )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker.unlink(missing_ok=True)


def last_intact_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose manifest lists every file at its size (no hashing: this runs on the way out)."""
    for path in reversed(ckpt.list_checkpoints(run_dir)):
        if ckpt.verify_checkpoint(path, deep=False) is None:
            return path
    return None


def node_loss_line(run_dir: Path, resume_command: str) -> Callable[[list[int], str], str]:
    """`describe(lost ranks, how)`: the one line a survivor prints when nodes are lost."""

    def describe(lost: list[int], how: str) -> str:
        per_node = local_processes()  # torchrun numbers ranks node by node
        names = ", ".join(f"node {r // per_node} (rank {r})" for r in lost)
        last = last_intact_checkpoint(run_dir)
        where = f"the last intact checkpoint is {last}" if last else "no checkpoint was written yet"
        return (
            f"{names} lost ({how}); {where}; resume on the nodes left with the same train.batch_size "
            f"(exact), on every node: {resume_command}"
        )

    return describe
