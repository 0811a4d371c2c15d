"""A distilling run's teacher (`distill.teacher`): a run's final/ checked against the student's data, and its fp32
logits for every text the student trains on, computed once and cached.

The cache is `<run.output_dir>/teacher/`: one `.npy` file per chunk of `CHUNK_TEXTS` texts, written under a
temporary name and renamed (a file that exists is whole), and `teacher.json`, which names what the chunks were
computed from: the teacher's path and the sha256 of its weight files, the number of texts, the chunk size and the
sha256 of the texts themselves. A chunk on disk under a matching teacher.json is read instead of computed, so a run
stopped while its teacher computed, or resumed after a signal, computes only what is missing; any other teacher.json
empties the cache first. The main process computes and writes; the others read what it wrote
(`accelerator.main_process_first`), or compute without writing where they do not see it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from finetune.config.schema import Config
from finetune.config.tasks import SINGLE
from finetune.core.errors import UserError
from finetune.core.fileio import TEACHER_DIR, file_sha256, write_atomic
from finetune.deploy.final import check_final, load_final, weight_files
from finetune.deploy.predict import model_logits

logger = logging.getLogger("finetune")

CHUNK_TEXTS = 1024  # texts per cached chunk: what a stop may cost to compute again
MANIFEST = "teacher.json"


def check_teacher(teacher: Path, label_names: list[str], problem_type: str) -> None:
    """Refuse a teacher the student cannot learn from: not a complete final/, or other labels (config.json's
    id2label in id order) or another problem type than the student's data.

    Raises:
        UserError: one line naming the difference.
    """
    try:
        check_final(teacher)
    except UserError as exc:
        raise UserError(f"distill.teacher: {exc}") from None
    config = json.loads((teacher / "config.json").read_text(encoding="utf-8"))
    id2label = config.get("id2label") or {}
    names = [id2label.get(str(i)) for i in range(len(id2label))]
    kind = config.get("problem_type") or SINGLE  # transformers' reading of a config without one
    if kind != problem_type:
        raise UserError(
            f"distill.teacher: {teacher} is a {kind} model and the data is {problem_type}; distill from a teacher "
            "trained on the same task"
        )
    if names != label_names:
        raise UserError(
            f"distill.teacher: {teacher}'s labels {names} (config.json id2label, in id order) are not the data's "
            f"{label_names}; distill from a teacher trained on the same labels"
        )


def texts_sha256(texts: list[str], pairs: list[str] | None) -> str:
    """sha256 of the texts (and their pairs) in order: what the teacher's outputs were computed for."""
    return hashlib.sha256(json.dumps([texts, pairs], ensure_ascii=False).encode()).hexdigest()


def manifest(teacher: Path, texts: list[str], pairs: list[str] | None, chunk_size: int) -> dict[str, Any]:
    """teacher.json: what a cache's chunks were computed from."""
    return {
        "teacher": str(teacher.resolve()),
        "weights_sha256": {w.name: file_sha256(w) for w in weight_files(teacher)},
        "rows": len(texts),
        "chunk_size": chunk_size,
        "data_sha256": texts_sha256(texts, pairs),
    }


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # missing or torn
        return None


def _read_chunk(path: Path, rows: int) -> np.ndarray | None:
    """A cached chunk of `rows` logits rows; None where there is none (or it is not whole)."""
    try:
        chunk = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return chunk if chunk.ndim == 2 and len(chunk) == rows else None


class _OnDevice:
    """The teacher on the run's device, taking `model_logits`' host batches and answering on the host."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device, self.config = model.to(device), device, model.config

    def __call__(self, **batch: torch.Tensor) -> SimpleNamespace:
        out = self.model(**{k: v.to(self.device) for k, v in batch.items()})
        return SimpleNamespace(logits=out.logits.float().cpu())


def teacher_logits(
    teacher: Path,
    texts: list[str],
    pairs: list[str] | None,
    cache: Path,
    device: torch.device | None = None,
    write: bool = True,
    chunk_size: int = CHUNK_TEXTS,
) -> np.ndarray:
    """The teacher's fp32 logits for `texts` (with `pairs`), one row per text, through `cache` (the module's
    docstring); `write`: this process writes the cache (the main process), else it only reads it."""
    want = manifest(teacher, texts, pairs, chunk_size)
    valid = _read_manifest(cache / MANIFEST) == want
    if write and not valid:  # another teacher, other texts or another chunk size: its chunks are not these
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        write_atomic(cache / MANIFEST, json.dumps(want, indent=2))
        valid = True
    chunks, loaded, computed = [], None, 0
    count = math.ceil(len(texts) / chunk_size)
    for i in range(count):
        start, end = i * chunk_size, min(len(texts), (i + 1) * chunk_size)
        path = cache / f"chunk-{i:05d}.npy"
        chunk = _read_chunk(path, end - start) if valid else None
        if chunk is None:
            if loaded is None:
                tokenizer, model = load_final(teacher)
                loaded = (tokenizer, _OnDevice(model, device or torch.device("cpu")))
            chunk = np.asarray(
                model_logits(*loaded, texts[start:end], pairs[start:end] if pairs is not None else None),
                dtype=np.float32,
            )
            if write:
                write_atomic(path, lambda f, c=chunk: np.save(f, c, allow_pickle=False))
            computed += 1
            logger.info(f"teacher: chunk {i + 1}/{count} ({end} of {len(texts)} texts)")
        chunks.append(chunk)
    if computed < count:
        logger.info(f"teacher: {count - computed} of {count} chunks read from {cache}")
    return np.concatenate(chunks) if chunks else np.zeros((0, 0), dtype=np.float32)


class TeacherOutputs:
    """`data.build.SoftTargets` for a distilling run: the teacher checked against the data, then its logits of the
    student's training texts through the run directory's cache, the main process first."""

    def __init__(self, teacher: Path, cache: Path, accelerator: Any) -> None:
        self.teacher, self.cache, self.accelerator = teacher, cache, accelerator

    def __call__(
        self, texts: list[str], pairs: list[str] | None, label_names: list[str], problem_type: str
    ) -> np.ndarray:
        """The teacher's logits, one row per text.

        Raises:
            UserError: the teacher is not a complete final/, or not one of these labels and problem type.
        """
        check_teacher(self.teacher, label_names, problem_type)
        acc = self.accelerator
        cuda = [acc.device] if acc.device.type == "cuda" else []
        # the student's first weights are drawn after this: loading the teacher must not move the RNG, or a run that
        # reads a cached teacher would start from other weights than one that computes it
        with torch.random.fork_rng(devices=cuda), acc.main_process_first():  # the main process fills the cache
            logits = teacher_logits(self.teacher, texts, pairs, self.cache, acc.device, acc.is_main_process)
        if acc.device.type == "cuda":
            torch.cuda.empty_cache()  # the teacher's blocks, before the student's memory is measured
        return logits


def teacher_outputs(cfg: Config, accelerator: Any) -> TeacherOutputs | None:
    """A distilling run's teacher (`distill.teacher`, its cache in the run directory); None without one."""
    if cfg.distill.teacher is None:
        return None
    return TeacherOutputs(Path(cfg.distill.teacher).expanduser(), Path(cfg.run.output_dir) / TEACHER_DIR, accelerator)
