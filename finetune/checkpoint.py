"""Checkpoints: Accelerate's save_state plus progress and config, found again for resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from finetune.errors import UserError

PROGRESS = "progress.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """`checkpoints/step_<N>` with N zero-padded so names sort by step."""
    return run_dir / "checkpoints" / f"step_{step:08d}"


def save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, progress: dict[str, Any], files: dict[str, str]) -> Path:
    """Write a checkpoint for optimizer step `step`: state, progress.json and extra text files."""
    target = checkpoint_dir(run_dir, step)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(target), safe_serialization=True)
    if accelerator.is_main_process:
        (target / PROGRESS).write_text(json.dumps(progress, indent=2))
        for name, text in files.items():
            (target / name).write_text(text)
    accelerator.wait_for_everyone()
    return target


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / PROGRESS).is_file())


def find_resume_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint `checkpoint.resume` points at: auto -> newest in the run, or a path."""
    if resume is None:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / PROGRESS).is_file():
        raise UserError(f"checkpoint.resume: {path} is not a checkpoint directory (no {PROGRESS})")
    return path


def load_checkpoint(accelerator: Accelerator, path: Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, scaler and RNG states; return progress.json."""
    accelerator.load_state(str(path))
    return json.loads((path / PROGRESS).read_text())


def remove_tree(path: Path) -> None:
    """Remove a directory tree if it exists."""
    if path.exists():
        shutil.rmtree(path)
