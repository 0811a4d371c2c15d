"""File primitives every layer shares, with no finetune imports: the one content hasher
(`file_sha256`), the one reader of the JSON-lines files a run appends to (`read_jsonl`) and the one atomic
writer of a small file (`write_atomic`: the audit's files, the teacher cache).

They sit at the bottom of the layers because their users span them: the data files' sha256
(data/build.py), checkpoint manifests (checkpoint.py), metrics.jsonl for memory.png and the run's peak
(memory/monitor.py), curves.png (metrics.py), resume's trim (checkpoint.py), and the benchmark scripts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def file_sha256(path: Path) -> str:
    """sha256 of a file, or of a directory's files and their relative names (a saved dataset).

    The one hasher for content: data files in provenance.json and resume's data check, and every
    file in a checkpoint's manifest. A file is read in 1 MiB chunks, so a large one never sits in memory.
    """
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        if path.is_dir():
            h.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def write_atomic(path: Path, data: str | bytes | Callable[[BinaryIO], object]) -> None:
    """Write `path` whole or not at all: text (utf-8), bytes, or what `data(file)` writes, into a temporary file
    beside it that is then renamed over it (a reader never sees a torn file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)


METRICS_FILE = "metrics.jsonl"  # a run's log rows, in its run directory
# a distilling run's cache of its teacher's outputs, in its run directory: written before the run's other files and
# valid on its own (its teacher.json names what it was computed from), so a directory holding only it counts as empty
TEACHER_DIR = "teacher"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file a run appends to (metrics.jsonl), in order.

    Blank lines and a line that is not JSON are skipped: a run killed mid-write leaves its last line
    torn, and that must not stop a plot, a resume or a benchmark from reading the rows before it.

    Raises:
        OSError: the file cannot be read (callers that accept a missing file check first).
    """
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a kill, or a blank one
    return rows
