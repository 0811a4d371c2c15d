"""What the benchmark scripts share: the project root, one runner for `finetune/train.py` in a child
process (a fresh process per run: Accelerate's state fixes the precision per process), the run's
eval.json and metrics.jsonl, and real-tensor memory measurements the planner is compared against
(`measure_real` on CPU, `measure_cuda` on a GPU). Not part of the package: nothing in finetune/
imports it.

    import benchlib  # scripts put their own folder on sys.path (a script's folder is there already)
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from finetune.config.schema import Config  # noqa: E402
from finetune.core.fileio import read_jsonl  # noqa: E402
from finetune.memory.peak import Measurement, autocast_context, measure_window, train_window  # noqa: E402
from finetune.memory.planner import build_for_planning  # noqa: E402


def record_fields(area: str, what: str, metric: str, value: float, interval: Any, seeds: list[int]) -> dict[str, Any]:
    """The fields every record of docs/results/*.jsonl carries (scripts/results_page.py's REQUIRED): what was
    measured, on which hardware, when, at which commit, and the command line that reproduces it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    hardware = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()}-core CPU"
    script = Path(sys.argv[0]).resolve()
    where = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return {
        "area": area,
        "what": what,
        "metric": metric,
        "value": value,
        "interval": interval,
        "seeds": seeds,
        "hardware": hardware,
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip() or "unknown",
        "command": shlex.join([".venv/bin/python", str(where), *sys.argv[1:]]),
    }


def pair_f1(run_dir: Path, resamples: int = 1000, seed: int = 42) -> tuple[float, list[float]]:
    """A pair task's F1 (the positive, last, class's) on validation with its percentile bootstrap interval, from the
    run's predictions.jsonl: eval.json's own intervals cover accuracy and macro-F1, not a paraphrase F1."""
    from sklearn.metrics import f1_score

    rows = [r for r in read_jsonl(run_dir / "predictions.jsonl") if r["split"] == "validation"]
    positive = list(rows[0]["probabilities"])[-1]
    gold = np.array([r["gold"] == positive for r in rows])
    pred = np.array([r["prediction"] == positive for r in rows])
    draws = np.random.default_rng(seed).integers(0, len(rows), size=(resamples, len(rows)))
    scores = [f1_score(gold[i], pred[i], zero_division=0) for i in draws]
    value = float(f1_score(gold, pred, zero_division=0))
    return value, [float(np.percentile(scores, 2.5)), float(np.percentile(scores, 97.5))]


def append_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append `rows` to a JSON-lines file, one line each (a bench's results as they come, a records file)."""
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@dataclass
class TrainRun:
    """One `finetune/train.py` child: final/'s eval.json (None when the run failed), its wall time, and
    the last line of stderr when it failed."""

    eval: dict[str, Any] | None
    wall_s: float
    error: str | None
    run_dir: Path

    def metrics(self) -> list[dict[str, Any]]:
        """The run's metrics.jsonl rows."""
        path = self.run_dir / "metrics.jsonl"
        return read_jsonl(path) if path.is_file() else []


def train_run(config: str | Path, overrides: list[str], run_dir: Path, *, check: bool = True) -> TrainRun:
    """`python finetune/train.py --config CONFIG run.output_dir=RUN_DIR run.overwrite=true *overrides`
    offline, from the project root; with `check`, a failure ends the script with the child's stderr."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("FINETUNE_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    cmd = [
        sys.executable,
        str(ROOT / "finetune" / "train.py"),
        "--config",
        str(config),
        f"run.output_dir={run_dir}",
        "run.overwrite=true",
        *overrides,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        if check:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        return TrainRun(None, wall, last, run_dir)
    return TrainRun(json.loads((run_dir / "eval.json").read_text()), wall, None, run_dir)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; floats with 4 digits."""
    cell = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


# ----------------------------------------------------------------------------------------------
# Real-tensor memory measurements (what the planner's fake-tensor prediction is compared against).


def real_batch_factory(
    tokenizer: Any, texts: list[str], labels: list[int], seq_len: int
) -> Callable[[], dict[str, torch.Tensor]]:
    """Real batches of `texts` padded to `seq_len` tokens (the planner's worst case, on real data)."""

    def make() -> dict[str, torch.Tensor]:
        enc = tokenizer(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
        batch = dict(enc)
        batch["labels"] = torch.tensor(labels, dtype=torch.long)
        return batch

    return make


def measure_real(
    cfg: Config,
    micro: int,
    accumulation: int,
    tokenizer: Any,
    label_names: list[str],
    texts: list[str],
    labels: list[int],
    seq_len: int | None = None,
) -> Measurement:
    """MemTracker measurement of a real second window on CPU (real tensors, real data)."""
    seq_len = seq_len or cfg.data.max_length
    model, optimizer = build_for_planning(cfg, label_names, tokenizer)
    make = real_batch_factory(tokenizer, texts[:micro], labels[:micro], seq_len)
    return measure_window(model, optimizer, make, accumulation, cfg.precision.mode, cfg.train.max_grad_norm)


def measure_cuda(
    cfg: Config,
    micro: int,
    accumulation: int,
    tokenizer: Any,
    label_names: list[str],
    texts: list[str],
    labels: list[int],
    seq_len: int | None = None,
) -> dict[str, int]:
    """On a CUDA machine: `torch.cuda.max_memory_allocated` (and reserved) over a real second window,
    CUDA autocast. What the planner's `peak_bytes` predicts (its margin covers context and reserve)."""
    seq_len = seq_len or cfg.data.max_length
    model, optimizer = build_for_planning(cfg, label_names, tokenizer, device="cuda")
    model.to("cuda")  # parameters keep their identity: the optimizer still holds them
    make_cpu = real_batch_factory(tokenizer, texts[:micro], labels[:micro], seq_len)
    autocast = autocast_context(cfg.precision.mode, "cuda")
    steps = min(accumulation, 2)
    model.train()
    train_window(
        model,
        optimizer,
        [{k: v.cuda() for k, v in make_cpu().items()} for _ in range(steps)],
        autocast,
        cfg.train.max_grad_norm,
    )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_window(
        model,
        optimizer,
        [{k: v.cuda() for k, v in make_cpu().items()} for _ in range(steps)],
        autocast,
        cfg.train.max_grad_norm,
    )
    torch.cuda.synchronize()
    result = {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved()}
    del model, optimizer
    torch.cuda.empty_cache()
    return result
