"""GPU truth in one command: precision, memory plan, speed, OOM backoff, side by side with Trainer.

Every number in docs/ so far comes from a 2-core CPU. This script runs this code's CUDA paths on
one GPU (written for the lent H200, 8 minutes at most) and writes one JSON and one markdown file
whose tables docs/RESULTS.md, docs/PRECISION.md and docs/MEMORY.md take as they are:

1. precision: fp32 (two seeds: the noise), fp16 (GradScaler), bf16 autocast, bf16-true, bf16 with
   `model.compile`, each a real `finetune.train.train(cfg)` run: samples/s and tokens/s of the
   log intervals after the first, MFU, the first interval's time (compilation included), compiled
   graphs, fp16 skipped steps, the loss at the last step against fp32's, the memory report's
   allocator counters, and what the run left allocated after it returned;
   `--profile MODE`: one short run of MODE per model under torch.profiler, its top operations by
   self CPU and CUDA time and its host syncs per optimizer step (reads of tensor values patched,
   and on CUDA `torch.cuda.set_sync_debug_mode("warn")`), in profile-MODEL-MODE.md;
2. memory: `planner.predict_peak` against `torch.cuda.max_memory_allocated` (`benchlib.measure_cuda`)
   for the ladder fp32 -> bf16 -> accumulation -> checkpointing -> bf16-true -> LoRA
   (scripts/bench_memory.py's rungs), reserved and fragmentation with and without
   `expandable_segments`, each in a fresh child process (what the precision runs left allocated
   would count otherwise; the allocator setting must precede CUDA's initialisation);
3. transformers.Trainer on the same model, rows and precision (defaults, and group_by_length);
   the OOM backoff under `torch.cuda.set_per_process_memory_fraction` at a micro-batch that does
   not fit: finetune halves it and keeps the effective batch, Trainer's auto_find_batch_size
   halves its batch.

The models are random (no weights travel): MiniLM's shapes (scripts/bench_memory.py's
MINILM_ARCH) and Qwen2.5-0.5B's (configs/qwen2.5-0.5b-lora.yaml's plan_architecture), with a
word-level tokenizer built here over the model's whole vocabulary and a synthetic two-class task
(marker words decide the label, so the loss falls). `--models`, `--sections` and `--modes` choose
what runs; the chosen (section, model) pairs share all of `--budget-s` in SHARES' proportions.
MFU = tokens/s x (6 N + 12 l d T) / 790e12:
N the weights of the nn.Linear layers (embeddings excluded), l layers, d hidden size, T the mean
real tokens per row (attention counted in full, causal masks not halved); 790 TFLOP/s is the
dense bf16 rate KINDS.md measured on the H200. fp32 rows are measured against the same bf16 peak.

Here (this machine: pip reaches PyPI), once, the wheels the GPU machine lacks (pydantic, datasets
and what they need beyond its image, and transformers and peft at this venv's versions: its image has
older ones; 17 MiB):

    PYTHONPATH=. .venv/bin/python scripts/gpu_check.py --prepare .gpu_wheels   # .gpu_wheels/ is git-ignored

On the lent GPU: the device tool's `run` with carry [".gpu_wheels"], timeout_s 600, and this command
(one line there; docs/PRECISION.md "Re-measuring on a GPU" has it verbatim):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
    .gpu_wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    TOKENIZERS_PARALLELISM=false && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    && python3 scripts/gpu_check.py --out $OUT

On a CPU (the suite runs this; same code, tiny shapes, fp16 and the CUDA-only measurements
recorded as skipped, the OOM injected through finetune/core/faults.py):

    PYTHONPATH=. .venv/bin/python scripts/gpu_check.py --dry-run --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "scripts"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402
from bench_memory import LORA, MINILM_ARCH, RUNGS  # noqa: E402
from bench_vs_trainer import shared_hparams  # noqa: E402
from benchlib import measure_cuda, measure_real  # noqa: E402

from finetune.config.files import load_config  # noqa: E402
from finetune.config.schema import Config  # noqa: E402
from finetune.core import faults  # noqa: E402
from finetune.core.fileio import read_jsonl  # noqa: E402
from finetune.memory.peak import MiB  # noqa: E402
from finetune.memory.planner import predict_peak  # noqa: E402
from finetune.model.load import build_model, build_tokenizer  # noqa: E402

PEAK_BF16_FLOPS = 790e12  # KINDS.md: an 8192^3 bf16 matmul ran at 769-798 TFLOP/s on random data
LABELS = ["negative", "positive"]
# the packages finetune imports that the GPU machine's image lacks (KINDS.md), or has at other versions (transformers
# 5.17 and its own peft), at this venv's versions
WHEELS = (
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "datasets",
    "dill",
    "multiprocess",
    "transformers",
    "peft",
)
# rungs of scripts/bench_memory.py in the issue's order: fp32 -> bf16 -> accumulation -> checkpointing ->
# bf16-true -> LoRA
LADDER = (0, 1, 2, 3, 6, 4)


@dataclass(frozen=True)
class Shape:
    """One model and its workload: rows of up to `max_length` tokens, `micro` rows per step."""

    name: str
    kind: str  # encoder | decoder
    arch: dict[str, Any]
    max_length: int
    micro: int
    steps: int  # optimizer steps of a precision run
    lr: float
    modes: tuple[str, ...]  # precision rows, in the order they run (a time cap drops the tail)
    rungs: tuple[int, ...]  # memory ladder rows (indices of bench_memory.RUNGS)
    oom_micro: int  # a micro-batch that does not fit under the memory fraction (its half does)
    row_s: float  # a guess at one eager run's seconds: a row starts only with that much of its cap left (x4: compile)


# the order they run in: a time cap drops the tail, so the rows no recorded GPU run holds
# come first (fp16 and bf16-true on MiniLM; fp32, fp16 and compile on Qwen), then the compiled run (its minute
# of compiling) before the rest
ALL_MODES = ("fp16", "bf16-true", "fp32", "fp32 seed 1", "bf16 compile", "bf16")
QWEN_MODES = ("fp16", "bf16 compile", "fp32", "bf16", "bf16-true")
# share of --budget-s per (section, model), in the order they run; the pairs a run selects share the whole
# budget in these proportions, and what a pair leaves unused goes to the pairs after it
SHARES = {
    ("precision", "minilm"): 0.32,
    ("precision", "qwen2.5-0.5b"): 0.18,
    ("profile", "minilm"): 0.06,
    ("profile", "qwen2.5-0.5b"): 0.06,
    ("memory", "minilm"): 0.16,
    ("memory", "qwen2.5-0.5b"): 0.1,
    ("trainer", "minilm"): 0.08,
    ("oom", "minilm"): 0.1,
}
SECTIONS = ("precision", "profile", "memory", "trainer", "oom")


def slug(mode: str) -> str:
    """A mode as the command line writes it: 'bf16 compile' -> 'bf16-compile'."""
    return mode.replace(" ", "-")


def chosen_modes(modes: tuple[str, ...], wanted: list[str] | None) -> tuple[str, ...]:
    """The shape's modes that `--modes` names (all without it), in the shape's order."""
    return modes if wanted is None else tuple(m for m in modes if slug(m) in {slug(x) for x in wanted})


def planned_pairs(sections: list[str], models: list[str]) -> list[tuple[str, str, float]]:
    """(section, model, share) of every pair the run selects, in run order."""
    return [(sec, m, SHARES[sec, m]) for sec in SECTIONS for m in models if (sec, m) in SHARES and sec in sections]


def pair_cap(share: float, shares_left: float, time_left: float) -> float:
    """A pair's cap: its share of the time left among the shares still to run (so the selected pairs
    divide the whole budget, and time one pair does not use goes to the next)."""
    return time_left * share / shares_left if shares_left > 0 else time_left


def shapes(dry_run: bool) -> dict[str, Shape]:
    """The models the check runs: real sizes on a GPU, tiny ones for the CPU dry run."""
    minilm = {"vocab_size": 30522, **yaml.safe_load(MINILM_ARCH.split("=", 1)[1])}
    qwen = yaml.safe_load((ROOT / "configs" / "qwen2.5-0.5b-lora.yaml").read_text())["model"]["plan_architecture"]
    if dry_run:
        tiny = {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "vocab_size": 400,
            "max_position_embeddings": 64,
        }
        minilm = {**minilm, **tiny}
        qwen = {**qwen, **tiny, "num_key_value_heads": 1}
        return {
            "minilm": Shape("minilm", "encoder", minilm, 32, 8, 4, 1e-3, ALL_MODES, (0, 6, 4), 8, 0),
            "qwen2.5-0.5b": Shape("qwen2.5-0.5b", "decoder", qwen, 32, 8, 4, 1e-3, ("bf16",), (3,), 8, 0),
        }
    return {
        "minilm": Shape("minilm", "encoder", minilm, 128, 32, 300, 1e-4, ALL_MODES, LADDER, 512, 15),
        "qwen2.5-0.5b": Shape("qwen2.5-0.5b", "decoder", qwen, 128, 32, 40, 5e-5, QWEN_MODES, (2, 3, 6, 4), 64, 30),
    }


# ----------------------------------------------------------------------------------------------
# Tokenizer and data, built here (nothing is downloaded).


def word_tokenizer(vocab_size: int, kind: str, out: Path) -> Path:
    """A word-level tokenizer over `vocab_size` ids ("w0" ...): one token per word, so row lengths
    are exact; encoders get BERT's [CLS] ... [SEP] and a pad token, decoders one eos and no pad (as
    Qwen's tokenizer ships: finetune must choose one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if kind == "encoder" else ["<|endoftext|>"]
    vocab = {t: i for i, t in enumerate([*specials, *(f"w{i}" for i in range(vocab_size - len(specials)))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[1] if kind == "encoder" else specials[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if kind == "encoder":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
        named = {
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "mask_token": "[MASK]",
        }
    else:
        named = {"eos_token": specials[0]}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=["input_ids", "attention_mask"], **named)
    fast.save_pretrained(out)
    return out


def synthetic_rows(n: int, words: int, max_words: int, seed: int, fixed: bool = False) -> list[tuple[str, int]]:
    """(text, label) rows: mostly short (mean ~24 words, as SST-2's dev sentences), a few marker words of
    the label's set among random ones, so a model can learn it; `fixed`: every row `max_words` long."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = max_words if fixed else min(max_words, 3 + int(rng.expovariate(1 / 21)))
        label = rng.randrange(2)
        ids = [rng.randrange(100, words) for _ in range(length)]
        for _ in range(min(length, 1 + rng.randrange(3))):  # markers: ids 0-49 say negative, 50-99 positive
            ids[rng.randrange(length)] = 50 * label + rng.randrange(50)
        rows.append((" ".join(f"w{i}" for i in ids), label))
    return rows


def write_tsv(rows: list[tuple[str, int]], path: Path) -> Path:
    path.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows), encoding="utf-8")
    return path


@dataclass
class Workload:
    """One shape's tokenizer, data files and base config on disk."""

    shape: Shape
    work: Path
    tokenizer_dir: Path
    rows: list[tuple[str, int]]
    train_file: Path
    fixed_file: Path  # every row max_length tokens: the OOM run's worst case from its first window

    @property
    def base(self) -> Path:
        return self.work / "base.yaml"

    def write_base(self) -> None:
        """The config every run of this shape starts from (runs differ by dotted overrides)."""
        s = self.shape
        raw = {
            "run": {"output_dir": str(self.work / "run"), "seed": 0, "overwrite": True},
            "model": {"name_or_path": None, "tokenizer": str(self.tokenizer_dir), "architecture": s.arch},
            "data": {
                "data_dir": str(self.work),
                "train_file": self.train_file.name,
                "format": "tsv",
                "quoting": "none",
                "text_column": "sentence",
                "label_column": "label",
                "label_map": {"0": LABELS[0], "1": LABELS[1]},
                "max_length": s.max_length,
            },
            "train": {
                "epochs": 1,
                "micro_batch_size": s.micro,
                "gradient_accumulation_steps": 1,
                "learning_rate": s.lr,
                "warmup_ratio": 0.06,
                "max_steps": s.steps,
                "log_every_steps": max(1, s.steps // 10),
                "eval_every_steps": None,
            },
            "precision": {"mode": "fp32"},
            "log": {"plots": False},
        }
        self.base.write_text(yaml.safe_dump(raw, sort_keys=False))

    def config(self, name: str, overrides: list[str]) -> Config:
        return load_config(self.base, [f"run.output_dir={self.work / name}", *overrides])

    def mean_tokens(self, tokenizer: Any) -> float:
        """Real tokens per row of the training data as the model sees them (specials included)."""
        enc = tokenizer([t for t, _ in self.rows], truncation=True, max_length=self.shape.max_length)
        return sum(len(x) for x in enc["input_ids"]) / len(self.rows)


def workload(shape: Shape, work: Path) -> Workload:
    work.mkdir(parents=True, exist_ok=True)
    words = shape.arch["vocab_size"] - (5 if shape.kind == "encoder" else 1)
    max_words = shape.max_length - (2 if shape.kind == "encoder" else 0)
    rows = synthetic_rows(shape.steps * shape.micro, words, max_words, seed=0)
    fixed = synthetic_rows(4 * shape.oom_micro, words, max_words, seed=1, fixed=True)
    tok = word_tokenizer(shape.arch["vocab_size"], shape.kind, work / "tokenizer")
    w = Workload(shape, work, tok, rows, write_tsv(rows, work / "train.tsv"), write_tsv(fixed, work / "fixed.tsv"))
    w.write_base()
    return w


# ----------------------------------------------------------------------------------------------
# Small helpers.


class Clock:
    """Section time caps inside the whole run's: what does not fit is recorded as skipped."""

    def __init__(self, total_s: float) -> None:
        self.start = time.perf_counter()
        self.total_s = total_s
        self.section_end = math.inf

    def section(self, cap_s: float) -> None:
        self.section_end = time.perf_counter() + cap_s

    def left(self) -> float:
        return min(self.section_end, self.start + self.total_s) - time.perf_counter()

    def total_left(self) -> float:
        return self.start + self.total_s - time.perf_counter()


def finite(x: Any) -> Any:
    """`x` with every NaN and inf replaced by None: strict JSON has neither."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x if not isinstance(x, float) or math.isfinite(x) else None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def release() -> None:
    """Between runs on a GPU: the last run's blocks back to the device (a CPU has nothing to hand back)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def linear_weights(cfg: Config, tokenizer: Any) -> int:
    """Weights of the nn.Linear layers (6 N of the FLOP formula), from an empty (meta) model."""
    model = build_model(cfg, LABELS, tokenizer, empty=True)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def flops_per_token(cfg: Config, tokenizer: Any, mean_tokens: float) -> float:
    """6 N + 12 l d T: matmul weights forward and backward, plus attention scores and mixing."""
    arch = cfg.model.architecture or {}
    return 6 * linear_weights(cfg, tokenizer) + 12 * arch["num_hidden_layers"] * arch["hidden_size"] * mean_tokens


def steady_rate(
    rows: list[dict[str, Any]], per_step: int, leave_out: frozenset[int] = frozenset()
) -> tuple[float | None, float]:
    """(samples/s over the log intervals after the first, the first interval's seconds); intervals
    holding a step of `leave_out` are left out too."""
    prev, spans = 0, []
    for r in rows:
        samples = (r["step"] - prev) * per_step
        spans.append((samples, samples / max(r["samples_per_s"], 1e-12), any(prev < s <= r["step"] for s in leave_out)))
        prev = r["step"]
    steady = [(s, t) for s, t, out in spans[1:] if not out]
    rate = sum(s for s, _ in steady) / sum(t for _, t in steady) if steady else None
    return rate, spans[0][1] if spans else math.nan


# ----------------------------------------------------------------------------------------------
# 1. Precision: real training runs.


def mode_overrides(mode: str, dry_run: bool) -> list[str]:
    """precision.mode and compile for one row ('fp32 seed 1': the noise of the loss comparison)."""
    if mode == "fp32 seed 1":
        return ["precision.mode=fp32", "run.seed=1"]
    if mode == "bf16 compile":  # the CPU dry run compiles with dynamo alone: inductor takes minutes on 2 cores
        return ["precision.mode=bf16", "model.compile=true", *(["model.compile_backend=eager"] * dry_run)]
    return [f"precision.mode={mode}"]


def train_row(w: Workload, name: str, overrides: list[str]) -> dict[str, Any]:
    """One `finetune.train.train` run; its numbers from metrics.jsonl and memory.json."""
    from finetune.train import train

    cfg = w.config(name, overrides)
    torch._dynamo.reset()  # a compiled run counts its own graphs only
    release()
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    run = Path(cfg.run.output_dir)
    rows = read_jsonl(run / "metrics.jsonl")
    train_rows = [r for r in rows if "samples_per_s" in r]
    per_step = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps
    report = json.loads((run / "memory.json").read_text())
    # the steps whose window MemTracker sampled for the memory report (a compiled run samples none)
    tracked = {int(m) for m in re.findall(r"optimizer step (\d+)", report.get("breakdown_method") or "")}
    tracked |= {int((report.get("other_sample") or {}).get("step") or 0)} - {0}
    rate, first = steady_rate(train_rows, per_step)
    untracked, _ = steady_rate(train_rows, per_step, frozenset(tracked))
    shutil.rmtree(run / "final", ignore_errors=True)  # a Qwen-sized export is 2 GB of the machine's disk
    left = left_behind()
    cuda = {k: v for k, v in (report.get("cuda") or {}).items() if k != "memory_summary"}
    return {
        "wall_s": wall,
        "steps": train_rows[-1]["step"],
        "samples_per_s": rate,
        "first_interval_s": first,
        "memtracker_steps": sorted(tracked),
        "samples_per_s_untracked": untracked,
        "first_loss": train_rows[0]["loss"],
        "last_loss": train_rows[-1]["loss"],
        "compile_graphs": train_rows[-1].get("compile_graphs"),
        "recompile_limit_hits": train_rows[-1].get("compile_recompile_limit_hits", 0),
        "fp16_skipped_steps": train_rows[-1].get("fp16_skipped_steps"),
        "loss_scale": train_rows[-1].get("loss_scale"),
        "peak_memory_mib": max((r.get("peak_memory_bytes") or 0) for r in train_rows) / MiB,
        "allocator": cuda or None,
        "left_behind": left,
    }


def precision_section(
    w: Workload,
    modes: tuple[str, ...],
    clock: Clock,
    dry_run: bool,
    rows: list[dict[str, Any]],
    emit: Callable[[], None],
) -> None:
    """One row per mode of the shape; loss within noise: |loss - fp32's| <= max(2 x |fp32 - fp32 seed 1|, 0.01)."""
    cfg = w.config("flops", [])
    tok = build_tokenizer(cfg)
    mean_tokens = w.mean_tokens(tok)
    fpt = flops_per_token(cfg, tok, mean_tokens)
    first = len(rows)
    for mode in modes:
        row: dict[str, Any] = {
            "model": w.shape.name,
            "mode": mode,
            "micro": w.shape.micro,
            "max_length": w.shape.max_length,
            "mean_tokens": mean_tokens,
        }
        if clock.left() < max(3, w.shape.row_s * (4 if "compile" in mode else 1)):
            row["skipped"] = "time cap of the precision section"
        elif mode == "fp16" and not torch.cuda.is_available():
            row["skipped"] = "CPU: Accelerate ignores fp16 there and finetune refuses it"
        else:
            try:
                row.update(train_row(w, f"precision-{mode.replace(' ', '-')}", mode_overrides(mode, dry_run)))
                # speed without the memory report's MemTracker windows (a compiled run has none): the
                # modes compare alike; samples_per_s keeps them, as a user's run pays them
                sps = row["samples_per_s_untracked"]
                row["tokens_per_s"] = sps * mean_tokens if sps else None
                row["mfu"] = sps * mean_tokens * fpt / PEAK_BF16_FLOPS if sps else None
            except Exception as exc:  # one mode failing (a UserError included) must not cost the others
                row["error"] = one_line(exc)
        rows.append(row)
        emit()
    ours = rows[first:]
    ref = {r["mode"]: r.get("last_loss") for r in ours}
    if ref.get("fp32") is not None:
        noise = abs(ref["fp32"] - ref["fp32 seed 1"]) if ref.get("fp32 seed 1") is not None else None
        for r in ours:
            if r.get("last_loss") is not None:
                r["loss_delta_vs_fp32"] = r["last_loss"] - ref["fp32"]
                r["loss_noise"] = noise
                r["loss_within_noise"] = abs(r["loss_delta_vs_fp32"]) <= max(2 * (noise or 0.0), 0.01)
    for r in ours:
        r["flops_per_token"] = fpt


@contextlib.contextmanager
def counted_syncs(counts: dict[str, int]) -> Iterator[None]:
    """Host synchronisations while active: reads of tensor values on the host (`finetune.core.syncs.HostSyncCounter`
    patches `Tensor.item`, `tolist`, `cpu`, `__bool__`, `__float__`, ...; on CPU the only count) and, on CUDA,
    the warnings of `torch.cuda.set_sync_debug_mode("warn")` (every op that waits for the device)."""
    import warnings

    from finetune.core.syncs import HostSyncCounter

    cuda = torch.cuda.is_available()
    with HostSyncCounter() as reads, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
            counts["host_reads"] = reads.count
            counts["cuda_sync_warnings"] = sum("synchroniz" in str(x.message) for x in caught) if cuda else None
            counts["sites"] = reads.top(8)  # type: ignore[assignment]


def profile_run(w: Workload, mode: str, clock: Clock, dry_run: bool, out: Path) -> dict[str, Any]:
    """One short `train()` run of `mode` under torch.profiler: after 3 warm-up optimizer steps, the
    remaining steps profiled (self CPU and CUDA time per operation) and their host syncs counted; the
    tables go to profile-MODEL-MODE.md under `out`."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    from finetune.train import train

    mode = next(m for m in ALL_MODES if slug(m) == slug(mode))
    row: dict[str, Any] = {"model": w.shape.name, "mode": mode}
    if clock.left() < max(3, w.shape.row_s * (4 if "compile" in mode else 1)):
        return row | {"skipped": "time cap of the profile section"}
    if mode == "fp16" and not torch.cuda.is_available():
        return row | {"skipped": "CPU: Accelerate ignores fp16 there and finetune refuses it"}
    steps, warm = min(w.shape.steps, 20), 3
    cfg = w.config(f"profile-{slug(mode)}", [*mode_overrides(mode, dry_run), f"train.max_steps={steps}"])
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    counts: dict[str, Any] = {}
    syncs = counted_syncs(counts)
    done = [0]

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        done[0] += 1
        prof.step()
        if done[0] == warm:
            syncs.__enter__()
        elif done[0] == steps:
            syncs.__exit__(None, None, None)

    torch._dynamo.reset()
    release()
    with profile(activities=activities, schedule=schedule(wait=warm - 1, warmup=1, active=steps - warm)) as prof:
        hook = register_optimizer_step_post_hook(after_step)
        try:
            train(cfg)
        except Exception as exc:  # the row says why; the other sections go on
            return row | {"error": one_line(exc)}
        finally:
            hook.remove()
            if warm <= done[0] < steps:
                syncs.__exit__(None, None, None)
    profiled = steps - warm
    row.update(
        steps_profiled=profiled,
        host_reads_per_step=counts["host_reads"] / profiled,
        cuda_sync_warnings_per_step=None if not cuda else counts["cuda_sync_warnings"] / profiled,
        sites=counts["sites"],
        file=f"profile-{slug(w.shape.name)}-{slug(mode)}.md",
    )
    averages = prof.key_averages()
    tables = [("self CPU time", averages.table(sort_by="self_cpu_time_total", row_limit=20))]
    if cuda:
        tables.append(("self CUDA time", averages.table(sort_by="self_cuda_time_total", row_limit=20)))
    lines = [
        f"# {w.shape.name}, {mode}: {profiled} optimizer steps of {w.shape.micro} rows profiled (after {warm})",
        "",
        f"host reads of tensor values per optimizer step: {row['host_reads_per_step']:.2f}"
        + (f"; CUDA sync warnings per step: {row['cuda_sync_warnings_per_step']:.2f}" if cuda else ""),
        "",
        "where (reads in the profiled steps): "
        + "; ".join(f"{site.replace(str(ROOT) + '/', '')} x{n}" for site, n in counts["sites"]),
    ]
    for title, table in tables:
        lines += ["", f"## Top operations by {title}", "", "```", table, "```"]
    (out / row["file"]).write_text("\n".join(lines) + "\n")
    shutil.rmtree(Path(cfg.run.output_dir), ignore_errors=True)
    return row


def left_behind() -> dict[str, float] | None:
    """On CUDA, after a run and a garbage collection: the allocator's allocated bytes and those of the CUDA
    tensors Python can still reach (what a run leaves to the next one in the same process)."""
    if not torch.cuda.is_available():
        return None
    gc.collect()
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in gc.get_objects()
        if isinstance(t, torch.Tensor) and t.is_cuda
    }
    return {"allocated_mib": torch.cuda.memory_allocated() / MiB, "reachable_tensors_mib": sum(storages.values()) / MiB}


# ----------------------------------------------------------------------------------------------
# 2. Memory: the planner against the allocator.


def rung_overrides(w: Workload, index: int) -> tuple[str, list[str], int, int]:
    """bench_memory's rung at this shape's max_length; decoders take LoRA on the family's default targets."""
    name, overrides, micro, accumulation, _ = RUNGS[index]
    if w.shape.kind == "decoder":
        overrides = [o if o != LORA else "model.lora={r: 8, alpha: 16}" for o in overrides]
        name = name.replace("q/v", "on the family's default targets")
    return (
        name,
        [*overrides, f"train.micro_batch_size={micro}", f"train.gradient_accumulation_steps={accumulation}"],
        micro,
        accumulation,
    )


def measure_rungs(w: Workload, rungs: Iterable[int], clock: Clock | None) -> list[dict[str, Any]]:
    """Measured peak of each rung's second window: CUDA's allocator, or MemTracker on a CPU."""
    texts, labels = [t for t, _ in w.rows], [y for _, y in w.rows]
    out = []
    for index in rungs:
        name, overrides, micro, accumulation = rung_overrides(w, index)
        row: dict[str, Any] = {"model": w.shape.name, "rung": name, "micro": micro, "accumulation": accumulation}
        if clock is not None and clock.left() < max(3, w.shape.row_s):
            row["skipped"] = "time cap of the memory section"
            out.append(row)
            continue
        cfg = w.config(f"memory-{index}", overrides)
        tok = build_tokenizer(cfg)
        try:
            with torch.random.fork_rng(devices=[]):
                if torch.cuda.is_available():
                    row["allocated_before_mib"] = torch.cuda.memory_allocated() / MiB  # 0 in a fresh process
                    got = measure_cuda(cfg, micro, accumulation, tok, LABELS, texts, labels, w.shape.max_length)
                    row["measured_mib"], row["reserved_mib"] = got["max_allocated"] / MiB, got["max_reserved"] / MiB
                    row["fragmentation_mib"] = row["reserved_mib"] - row["measured_mib"]
                    row["measured_by"] = "torch.cuda.max_memory_allocated"
                else:
                    m = measure_real(cfg, micro, accumulation, tok, LABELS, texts, labels, w.shape.max_length)
                    row["measured_mib"], row["measured_by"] = m.peak_bytes / MiB, "MemTracker (CPU)"
        except Exception as exc:  # a rung this device cannot run is recorded; the ladder goes on
            row["error"] = one_line(exc)
        release()
        out.append(row)
    return out


def memory_section(w: Workload, clock: Clock, out: Path, dry_run: bool) -> list[dict[str, Any]]:
    """Measurement and plan per rung, then the measured rungs again with expandable segments. On a GPU every
    measurement runs in a fresh child process (one per allocator setting): in this process the precision runs
    before it leave allocations that `max_memory_allocated` would count (the first GPU run read ~3 GB extra).
    On a CPU MemTracker counts only the tensors it tracks, so the rungs are measured here."""
    rungs = list(w.shape.rungs)
    if torch.cuda.is_available():
        fresh = child_rows(w, rungs, clock.left() * 0.6, out, None, dry_run)
        measured = [i for i, r in zip(rungs, fresh, strict=True) if "measured_mib" in r]
        others = child_rows(w, measured, clock.left(), out, "expandable_segments:True", dry_run)
    else:
        fresh = measure_rungs(w, rungs, clock)
        measured = [i for i, r in zip(rungs, fresh, strict=True) if "skipped" not in r]
        others = [{"skipped": "CPU: no CUDA allocator"} for _ in measured]
    by_rung = dict(zip(measured, others, strict=True))
    for index, row in zip(rungs, fresh, strict=True):
        if "skipped" not in row:
            plan_rung(w, index, row)
        for key in ("measured_mib", "reserved_mib", "fragmentation_mib", "error", "skipped"):
            if key in by_rung.get(index, {}):
                row[f"expandable_{key}"] = by_rung[index][key]
    return fresh


def plan_rung(w: Workload, index: int, row: dict[str, Any]) -> None:
    """`predict_peak` for the rung (for CUDA on a GPU machine: its attention kernels and workspaces)."""
    _, overrides, micro, accumulation = rung_overrides(w, index)
    cfg = w.config(f"memory-{index}", overrides)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        with torch.random.fork_rng(devices=[]):
            plan = predict_peak(cfg, micro, accumulation, build_tokenizer(cfg), LABELS, w.shape.max_length, device)
        row["planned_mib"] = plan.peak_bytes / MiB
        row["planned_categories_mib"] = {k: v / MiB for k, v in plan.categories.items()}
        if row.get("measured_mib"):
            row["plan_over_measured"] = row["planned_mib"] / row["measured_mib"]
            row["within_10pct"] = abs(row["plan_over_measured"] - 1) <= 0.10
    except Exception as exc:  # the measurement stays; the table says why there is no plan
        row["plan_error"] = one_line(exc)


def child_rows(
    w: Workload, rungs: list[int], timeout: float, out: Path, alloc_conf: str | None, dry_run: bool
) -> list[dict[str, Any]]:
    """`rungs` measured in a fresh child process, with `PYTORCH_CUDA_ALLOC_CONF=alloc_conf` (the allocator
    reads it when CUDA initialises; None: the default allocator). The child writes its rows after each rung,
    so those measured before a timeout are kept."""

    def base(index: int, **why: str) -> dict[str, Any]:
        name, _, micro, accumulation = rung_overrides(w, index)
        return {"model": w.shape.name, "rung": name, "micro": micro, "accumulation": accumulation, **why}

    if timeout < 20:
        return [base(i, skipped="time cap of the memory section") for i in rungs]
    result = out / f"{'expandable' if alloc_conf else 'fresh'}-{w.shape.name}.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env.update({"PYTORCH_CUDA_ALLOC_CONF": alloc_conf} if alloc_conf else {})
    cmd = [
        sys.executable,
        __file__,
        "--memory-child",
        w.shape.name,
        str(w.work),
        ",".join(map(str, rungs)),
        str(result),
        *(["--dry-run"] if dry_run else []),
    ]
    result.unlink(missing_ok=True)
    err = None
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            err = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
    except subprocess.TimeoutExpired:
        err = "time cap of the memory section (child process)"
    rows = json.loads(result.read_text()) if result.exists() else []
    missing = [base(i, skipped=err) if err and "time cap" in err else base(i, error=f"child: {err}") for i in rungs]
    return rows + missing[len(rows) :]


# ----------------------------------------------------------------------------------------------
# 3. Trainer side by side, and the OOM backoff.


def trainer_run(
    w: Workload,
    mode: str,
    grouped: bool,
    steps: int,
    micro: int,
    train_file: Path,
    auto_batch: bool = False,
    simulate_cap: int | None = None,
) -> dict[str, Any]:
    """transformers.Trainer as a user writes it (DataCollatorWithPadding, TrainingArguments defaults
    plus finetune's hyper-parameters) on the same rows, model and initialisation."""
    from accelerate.state import AcceleratorState
    from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments

    cfg = w.config("trainer", [f"precision.mode={mode}", f"train.micro_batch_size={micro}"])
    tok = build_tokenizer(cfg)
    lines = train_file.read_text(encoding="utf-8").splitlines()[1:]
    texts, labels = [x.split("\t")[0] for x in lines], [int(x.split("\t")[1]) for x in lines]
    enc = tok(texts, truncation=True, max_length=cfg.data.max_length)
    dataset = [
        {"input_ids": i, "attention_mask": a, "labels": y}
        for i, a, y in zip(enc["input_ids"], enc["attention_mask"], labels, strict=True)
    ]
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg, LABELS, tok)
    if simulate_cap is not None:  # the CPU dry run: a batch above the cap fails as CUDA's allocator would

        def cap(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            if kwargs["input_ids"].shape[0] > simulate_cap:
                raise torch.OutOfMemoryError("CUDA out of memory. (simulated by gpu_check --dry-run)")

        model.register_forward_pre_hook(cap, with_kwargs=True)
    marks: dict[str, float] = {}
    warm = max(1, steps // 10)  # as finetune's first log interval: warm-up excluded

    class Marks(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == warm:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                marks["warm"] = time.perf_counter()

        def on_train_end(self, *a: Any, **kw: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks["end"] = time.perf_counter()

    hp = shared_hparams(cfg, steps)
    with tempfile.TemporaryDirectory(prefix="gpu-check-trainer-") as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            logging_strategy="no",
            max_steps=steps,
            bf16=mode == "bf16",
            fp16=mode == "fp16",
            use_cpu=not torch.cuda.is_available(),
            auto_find_batch_size=auto_batch,
            **({"train_sampling_strategy": "group_by_length"} if grouped else {}),
            **hp,
        )
        AcceleratorState._reset_state()  # Accelerate keeps the first Accelerator's precision per process
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=DataCollatorWithPadding(tok),
            processing_class=tok,
            callbacks=[Marks()],
        )
        release()
        trainer.train()
        batch = int(trainer._train_batch_size)
        AcceleratorState._reset_state()
    out: dict[str, Any] = {"batch_size_after": batch, "batch_size_asked": micro}
    if "warm" in marks and steps > warm:
        out["samples_per_s"] = (steps - warm) * batch / (marks["end"] - marks["warm"])
    del trainer, model
    release()
    return out


def trainer_section(w: Workload, precision: list[dict[str, Any]], clock: Clock) -> list[dict[str, Any]]:
    """Trainer defaults and group_by_length next to finetune's bf16 row of the precision section
    (same rows, steps, micro-batch, seed and initialisation)."""
    mode = "bf16"
    ours = next((r for r in precision if r["mode"] == mode and r.get("samples_per_s")), None)
    rows = [
        {
            "model": w.shape.name,
            "precision": mode,
            "contestant": "finetune",
            **(
                {"samples_per_s": ours["samples_per_s"], "samples_per_s_untracked": ours["samples_per_s_untracked"]}
                if ours
                else {"skipped": "no bf16 row in section 1"}
            ),
        }
    ]
    for grouped in (False, True):
        row: dict[str, Any] = {
            "model": w.shape.name,
            "precision": mode,
            "contestant": "Trainer, group_by_length" if grouped else "Trainer, defaults",
        }
        if clock.left() < 10:
            row["skipped"] = "time cap of the Trainer section"
        else:
            try:
                row.update(trainer_run(w, mode, grouped, w.shape.steps, w.shape.micro, w.train_file))
            except Exception as exc:
                row["error"] = one_line(exc)
        if ours and row.get("samples_per_s"):
            row["finetune_over_this"] = ours["samples_per_s"] / row["samples_per_s"]
            if ours["samples_per_s_untracked"]:
                row["finetune_untracked_over_this"] = ours["samples_per_s_untracked"] / row["samples_per_s"]
        rows.append(row)
    return rows


@contextlib.contextmanager
def memory_cap(w: Workload, micro: int) -> Iterator[dict[str, Any]]:
    """CUDA: `set_per_process_memory_fraction` halfway between the planned peaks of micro/2 and micro
    (bf16, every row max_length tokens); CPU: the OOM injected at step 1 (finetune/core/faults.py)."""
    info: dict[str, Any] = {}
    if not torch.cuda.is_available():
        old = os.environ.get(faults.ENV)
        os.environ[faults.ENV] = "oom_at_step:1"
        info["cap"] = "simulated: FINETUNE_TEST_ONLY_FAULTS=oom_at_step:1 (finetune), a forward hook (Trainer)"
        try:
            yield info
        finally:
            if old is None:
                del os.environ[faults.ENV]
            else:
                os.environ[faults.ENV] = old
        return
    cfg = w.config("oom-plan", ["precision.mode=bf16"])
    tok = build_tokenizer(cfg)
    with torch.random.fork_rng(devices=[]):
        hi = predict_peak(cfg, micro, 1, tok, LABELS, w.shape.max_length, "cuda").peak_bytes
        lo = predict_peak(cfg, micro // 2, 2, tok, LABELS, w.shape.max_length, "cuda").peak_bytes
    release()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = torch.cuda.memory_allocated() + (hi + lo) // 2
    info.update(
        cap=f"set_per_process_memory_fraction({cap / total:.5f}) = {cap / MiB:,.0f} MiB",
        planned_mib={micro: hi / MiB, micro // 2: lo / MiB},
    )
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        yield info
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        release()


def oom_section(w: Workload, clock: Clock) -> list[dict[str, Any]]:
    """finetune and Trainer (auto_find_batch_size) at a micro-batch the cap does not hold."""
    from finetune.train import train

    micro, rows = w.shape.oom_micro, []
    if clock.left() < 20:
        return [{"model": w.shape.name, "skipped": "time cap of the OOM section"}]
    with memory_cap(w, micro) as info:
        row: dict[str, Any] = {
            "model": w.shape.name,
            "contestant": "finetune",
            "micro_asked": micro,
            "effective_before": micro,
            "cap": info["cap"],
        }
        try:
            cfg = w.config(
                "oom-finetune",
                [
                    "precision.mode=bf16",
                    f"data.train_file={w.fixed_file.name}",
                    f"train.micro_batch_size={micro}",
                    "train.max_steps=3",
                ],
            )
            train(cfg)
            summary = json.loads((Path(cfg.run.output_dir) / "memory.json").read_text())["config"]
            row.update(
                micro_after=summary["micro_batch_size"], accumulation_after=summary["gradient_accumulation_steps"]
            )
            row["effective_after"] = row["micro_after"] * row["accumulation_after"]
        except Exception as exc:
            row["error"] = one_line(exc)
        rows.append(row)
        release()
        row = {
            "model": w.shape.name,
            "contestant": "Trainer, auto_find_batch_size",
            "micro_asked": micro,
            "effective_before": micro,
            "cap": info["cap"],
        }
        try:
            got = trainer_run(
                w,
                "bf16",
                False,
                3,
                micro,
                w.fixed_file,
                auto_batch=True,
                simulate_cap=None if torch.cuda.is_available() else micro // 2,
            )
            row.update(
                micro_after=got["batch_size_after"], accumulation_after=1, effective_after=got["batch_size_after"]
            )
        except Exception as exc:
            row["error"] = one_line(exc)
        rows.append(row)
    for r in rows:
        if "effective_after" in r:
            r["effective_batch_kept"] = r["effective_after"] == r["effective_before"]
            r["backed_off"] = r["micro_after"] < micro
    return rows


# ----------------------------------------------------------------------------------------------
# Report.


YES_NO = {True: "yes", False: "NO"}


def _f(x: Any, fmt: str = ",.0f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _why(r: dict[str, Any]) -> str | None:
    return f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['error']}" if "error" in r else None


def table_head(title: str, columns: list[str]) -> list[str]:
    """A markdown section title and the header of its table."""
    return ["", f"### {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def precision_table(rows: list[dict[str, Any]]) -> list[str]:
    """One row per (model, mode)."""
    lines = [
        "### Precision (`finetune.train.train`, random weights, synthetic rows)",
        "",
        f"MFU = tokens/s x (6 N + 12 l d T) / {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s (N: nn.Linear weights, "
        "l layers, d hidden, T mean real tokens per row); loss: mean of the last log interval; within noise: "
        "|loss - fp32's| <= max(2 x |fp32 - fp32 seed 1|, 0.01) (0.01 where no second fp32 seed ran)",
        "",
        "samples/s: the log intervals after the first (untracked: without those holding the memory report's "
        "MemTracker windows, whose steps are named; tokens/s and MFU use it)",
        "",
        "| model | mode | steps x micro | samples/s (untracked; MemTracker steps) | tokens/s | MFU "
        "| first interval s (incl. compile) | graphs "
        "| fp16 skipped | loss first -> last | vs fp32 | within noise | peak MiB (CPU: RSS) | reserved MiB "
        "| peak reserved - peak allocated MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['mode']} |"
        if _why(r):
            lines.append(f"{head} {_why(r)} |" + " |" * 13)
            continue
        a = r.get("allocator") or {}
        frag = a["peak_reserved_bytes"] - a["peak_allocated_bytes"] if a else None
        mfu = f"{100 * r['mfu']:.2f}%" if r.get("mfu") else "-"
        lines.append(
            f"{head} {r['steps']} x {r['micro']} | {_f(r['samples_per_s'])} ({_f(r['samples_per_s_untracked'])}; "
            f"{', '.join(map(str, r['memtracker_steps'])) or 'none'}) | {_f(r.get('tokens_per_s'))} | "
            f"{mfu} | "
            f"{_f(r['first_interval_s'], '.1f')} | "
            f"{_f(r['compile_graphs'], 'd')} | {_f(r['fp16_skipped_steps'], 'd')} | "
            f"{r['first_loss']:.4f} -> {r['last_loss']:.4f} | {_f(r.get('loss_delta_vs_fp32'), '+.4f')} | "
            f"{ {True: 'yes', False: 'NO', None: '-'}[r.get('loss_within_noise')] } | {_f(r['peak_memory_mib'])} | "
            f"{_f(a['peak_reserved_bytes'] / MiB if a else None)} | {_f(frag / MiB if frag is not None else None)} |"
        )
    return lines


def profile_table(rows: list[dict[str, Any]]) -> list[str]:
    """One row per profiled run: host syncs per optimizer step and where the operation tables are."""
    lines = table_head(
        "Profile (torch.profiler; host syncs counted over the profiled optimizer steps)",
        [
            "model",
            "mode",
            "steps profiled",
            "host reads / step",
            "CUDA sync warnings / step",
            "most reads at",
            "tables",
        ],
    )
    for r in rows:
        if _why(r):
            lines.append(f"| {r['model']} | {r['mode']} | {_why(r)} |" + " |" * 4)
            continue
        site = f"{r['sites'][0][0].split('/')[-1]} x{r['sites'][0][1]}" if r["sites"] else "-"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['steps_profiled']} | {r['host_reads_per_step']:.2f} | "
            f"{_f(r['cuda_sync_warnings_per_step'], '.2f')} | {site} | {r['file']} |"
        )
    return lines


def left_behind_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What each precision run left allocated on the GPU after it returned (a garbage collection later)."""
    left = [r for r in rows if r.get("left_behind")]
    if not left:
        return []
    return [
        "",
        "Left allocated after each run returned (gc.collect() first; MiB allocated / of which CUDA tensors Python "
        "still reaches): "
        + "; ".join(
            f"{r['model']} {r['mode']} {r['left_behind']['allocated_mib']:,.0f} / "
            f"{r['left_behind']['reachable_tensors_mib']:,.0f}"
            for r in left
        ),
    ]


def memory_table(rows: list[dict[str, Any]]) -> list[str]:
    """One row per rung: plan, allocator, expandable segments."""
    lines = table_head(
        "Memory: the plan against the allocator (second window, worst case max_length tokens per row)",
        [
            "model",
            "rung",
            "micro x accum",
            "plan MiB",
            "measured MiB",
            "plan / measured",
            "within 10%",
            "reserved MiB",
            "frag MiB",
            "expandable: measured / reserved / frag MiB",
        ],
    )
    for r in rows:
        head = f"| {r['model']} | {r['rung']} | {r['micro']} x {r['accumulation']} |"
        if "skipped" in r:
            lines.append(f"{head} {_why(r)} |" + " |" * 6)
            continue
        exp = _why({k[11:]: v for k, v in r.items() if k.startswith("expandable_")}) or (
            f"{_f(r.get('expandable_measured_mib'))} / {_f(r.get('expandable_reserved_mib'))} / "
            f"{_f(r.get('expandable_fragmentation_mib'))}"
        )
        lines.append(
            f"{head} {r['plan_error'] if 'plan_error' in r else _f(r.get('planned_mib'), ',.1f')} | "
            f"{_f(r.get('measured_mib'), ',.1f')}"
            f"{f' ({_why(r)})' if 'error' in r else ''}"
            f" | {_f(r.get('plan_over_measured'), '.3f')} | {YES_NO.get(r.get('within_10pct'), '-')}"
            f" | {_f(r.get('reserved_mib'))} | {_f(r.get('fragmentation_mib'))} | {exp} |"
        )
    return lines


def trainer_table(rows: list[dict[str, Any]]) -> list[str]:
    """finetune's bf16 run next to Trainer's."""
    lines = table_head(
        "Side by side with transformers.Trainer (same model, rows, steps, precision)",
        [
            "model",
            "precision",
            "contestant",
            "samples/s (finetune: untracked)",
            "finetune / this",
            "finetune untracked / this",
        ],
    )
    for r in rows:
        untracked = f" ({_f(r['samples_per_s_untracked'])})" if "samples_per_s_untracked" in r else ""
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['contestant']} | {_why(r) or _f(r.get('samples_per_s'))}"
            f"{untracked} | {_f(r.get('finetune_over_this'), '.2f')} | "
            f"{_f(r.get('finetune_untracked_over_this'), '.2f')} |"
        )
    return lines


def oom_table(rows: list[dict[str, Any]]) -> list[str]:
    """The out-of-memory backoff of both."""
    lines = table_head(
        "Out-of-memory backoff at a micro-batch that does not fit",
        [
            "model",
            "contestant",
            "cap",
            "micro asked",
            "after",
            "accumulation after",
            "effective batch before -> after",
            "kept",
        ],
    )
    for r in rows:
        if _why(r) and "contestant" not in r:
            lines.append(f"| {r['model']} | {_why(r)} |" + " |" * 6)
            continue
        lines.append(
            f"| {r['model']} | {r['contestant']} | {r['cap']} | {r['micro_asked']} | "
            f"{_why(r) or r['micro_after']} | {r.get('accumulation_after', '-')} | "
            f"{r['effective_before']} -> {r.get('effective_after', '-')} | "
            f"{ {True: 'yes', False: 'no', None: '-'}[r.get('effective_batch_kept')] } |"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The tables docs/PRECISION.md (precision, Trainer, OOM) and docs/MEMORY.md (ladder) take."""
    env = result["environment"]
    kind = "DRY RUN on CPU, tiny shapes: plumbing" if result["dry_run"] else "GPU run"
    lines = [
        f"{env['device']}; torch {env['torch']}, transformers {env['transformers']}, accelerate "
        f"{env['accelerate']}; {kind}; {result['wall_s']:.0f} s in all",
        "",
    ]
    lines += precision_table(result["precision"]) + left_behind_lines(result["precision"])
    lines += profile_table(result["profile"]) if result.get("profile") else []
    lines += memory_table(result["memory"])
    lines += trainer_table(result["trainer"]) + oom_table(result["oom"])
    if result["skipped"]:
        lines += ["", "Not run: " + "; ".join(result["skipped"])]
    return "\n".join(lines) + "\n"


def environment() -> dict[str, Any]:
    import accelerate
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": sys.version.split()[0],
        "bitsandbytes": importlib.util.find_spec("bitsandbytes") is not None,
    }


# ----------------------------------------------------------------------------------------------
# Entry points.


def prepare(directory: Path) -> int:
    """Download the wheels the GPU machine lacks (Python 3.12, x86-64) at this venv's versions."""
    directory.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platforms = [
        a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64") for a in ("--platform", p)
    ]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(directory),
        *pins,
    ]
    proc = subprocess.run(cmd)
    size = sum(p.stat().st_size for p in directory.glob("*.whl"))
    print(f"{len(list(directory.glob('*.whl')))} wheels, {size / MiB:.1f} MiB in {directory}: {' '.join(pins)}")
    return proc.returncode


def memory_child(name: str, work: Path, rungs: list[int], result: Path, dry_run: bool) -> int:
    """`--memory-child`: `rungs` measured in a fresh process (the parent sets PYTORCH_CUDA_ALLOC_CONF)."""
    shape = shapes(dry_run)[name]
    data = [(x.split("\t")[0], int(x.split("\t")[1])) for x in (work / "train.tsv").read_text().splitlines()[1:]]
    w = Workload(shape, work, work / "tokenizer", data, work / "train.tsv", work / "fixed.tsv")  # the parent's files
    rows: list[dict[str, Any]] = []
    for index in rungs:  # written after each rung: a parent's timeout keeps what was measured
        rows += measure_rungs(w, [index], None)
        result.write_text(json.dumps(finite(rows), allow_nan=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check", help="gpu_check.json/.md go here")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the same code as a plumbing check")
    parser.add_argument("--models", nargs="+", default=None, help="minilm, qwen2.5-0.5b (default both)")
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["precision", "memory", "trainer", "oom"],
        choices=SECTIONS,
        help="profile runs with --profile whether named or not",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help=f"precision rows to run (default all: {', '.join(map(slug, ALL_MODES))})",
    )
    parser.add_argument(
        "--profile",
        metavar="MODE",
        default=None,
        help="one short run of MODE per model under torch.profiler: top operations and host syncs per step, "
        "written to profile-MODEL-MODE.md under --out",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the whole run's cap, shared by the selected sections and models (GPU: 400; dry run: none)",
    )
    parser.add_argument("--prepare", type=Path, metavar="DIR", help="download the GPU machine's missing wheels")
    parser.add_argument("--memory-child", nargs=4, metavar=("MODEL", "WORK", "RUNGS", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare:
        return prepare(args.prepare)
    if args.memory_child:
        name, work, rungs, result = args.memory_child
        return memory_child(name, Path(work), [int(i) for i in rungs.split(",")], Path(result), args.dry_run)
    if not torch.cuda.is_available() and not args.dry_run:
        print("error: no CUDA device; --dry-run runs the same code on the CPU with tiny shapes", file=sys.stderr)
        return 2
    # the dry run is the suite's check of every row: a busy CPU must slow it, not thin it out
    args.budget_s = args.budget_s or (math.inf if args.dry_run else 400.0)
    clock = Clock(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile is not None and slug(args.profile) not in map(slug, ALL_MODES):
        parser.error(f"--profile {args.profile}: one of {', '.join(map(slug, ALL_MODES))}")
    sections = [*args.sections, *(["profile"] if args.profile else [])]
    result: dict[str, Any] = {
        "dry_run": args.dry_run,
        "environment": environment(),
        "peak_flops": PEAK_BF16_FLOPS,
        "precision": [],
        "profile": [],
        "memory": [],
        "trainer": [],
        "oom": [],
        "skipped": [],
        "wall_s": 0.0,
        "budget_s": args.budget_s,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    # measure_cuda builds the planner's 8-bit stand-in, not bitsandbytes: no truth to be had that way
    result["skipped"].append(
        "8-bit AdamW and QLoRA rows (bitsandbytes is not on the GPU machine and its wheel is over the 64 MiB "
        "that travel there; benchlib.measure_cuda would measure the planner's own 8-bit stand-in)"
    )

    def emit() -> None:  # after every row: a run stopped at its limit still leaves its numbers
        result["wall_s"] = time.perf_counter() - clock.start
        (args.out / "gpu_check.json").write_text(json.dumps(finite(result), indent=2, allow_nan=False))
        (args.out / "gpu_check.md").write_text(markdown(result))

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        loads = {
            name: workload(s, Path(tmp) / name)
            for name, s in shapes(args.dry_run).items()
            if args.models is None or name in args.models
        }
        # what is alive now (torch, transformers, the tokenizers) lives to the end: later collections
        # (Trainer's and Accelerate's after every try of a batch size) need not walk it again
        gc.freeze()
        pairs = planned_pairs(sections, list(loads))
        for i, (section, name, share) in enumerate(pairs):
            w = loads[name]
            clock.section(pair_cap(share, sum(p[2] for p in pairs[i:]), clock.total_left()))
            print(f"[gpu_check] {section} {name} ({time.perf_counter() - clock.start:.0f} s)", flush=True)
            if section == "precision":
                modes = chosen_modes(w.shape.modes, args.modes)
                precision_section(w, modes, clock, args.dry_run, result["precision"], emit)
            elif section == "profile":
                result["profile"].append(profile_run(w, args.profile, clock, args.dry_run, args.out))
            elif section == "memory":
                result["memory"] += memory_section(w, clock, args.out, args.dry_run)
            elif section == "trainer":
                result["trainer"] += trainer_section(w, result["precision"], clock)
            else:
                result["oom"] += oom_section(w, clock)
            emit()
    emit()
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
