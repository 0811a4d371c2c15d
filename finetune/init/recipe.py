"""`finetune init`'s training recipe: how long and how fast to train, from the data's shape and a measured step.

Single-label data gets an adaptive recipe: a bound on the epochs from the rows per class (few rows a class:
more passes), early stopping on a validation set (a stratified slice of train when there is no validation
file) evaluated twice an epoch, the best checkpoint as final/, a learning rate by model size and warmup by
task shape (one text or a pair), and a wall-time budget (`train.max_minutes`) estimated from a training step
timed on this machine. Multi-label and regression keep their measured tables (RECIPES).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune.config.schema import Config
from finetune.config.tasks import MULTI, REGRESSION, SINGLE
from finetune.core.errors import UserError
from finetune.memory.peak import autocast_context, step_and_zero, train_micro_step
from finetune.memory.planner import build_for_planning

# The recipe per problem type: train.* keys, and the epochs by training rows (the first bound the row count is
# below). Multi-label and regression anchored on configs/goemotions-minilm.yaml (43,410 rows: 2 epochs beat 1 by
# 5 points of test macro-F1) and configs/stsb-minilm.yaml (5,749 rows: 3 epochs beat 2), both with
# model.head_init=prior (docs/RESULTS.md, scripts/bench_quality.py). Single-label's table is what init wrote
# before the adaptive recipe (`adaptive`), kept for `recipe`'s callers.
RECIPES: dict[str, dict[str, Any]] = {
    SINGLE: {"learning_rate": 1e-4, "warmup_ratio": 0.06, "epochs": ((1_000, 10), (5_000, 5), (20_000, 3), (None, 2))},
    MULTI: {"learning_rate": 1e-4, "warmup_ratio": 0.06, "epochs": ((1_000, 10), (5_000, 5), (20_000, 3), (None, 2))},
    REGRESSION: {"learning_rate": 1e-4, "warmup_ratio": 0.1, "epochs": ((1_000, 10), (5_000, 5), (None, 3))},
}

# Per-model changes to that recipe. all-mpnet-base-v2 (12 layers of 768, about 6 times MiniLM's work a row):
# the sentence-transformers fine-tuning rate, at most 3 epochs, and micro-batches of at most 4,096 tokens
# (the planner: 4.8 GiB of tensors at 32 x 128 in fp32), accumulated back to an effective batch of 32; bf16
# autocast where the machine has bf16 units (`bf16_units`): faster steps there, with MRPC and STS-B at their
# goals (docs/RESULTS.md).
MODEL_RECIPES: dict[str, dict[str, Any]] = {
    "mpnet-base": {"learning_rate": 2e-5, "max_epochs": 3, "tokens": 4096, "bf16": True}
}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of x86 bf16 matrix units

# Single-label: each class seen about this many times over the run bounds the epochs (within EPOCHS); more
# rows than that a class need fewer passes, and early stopping ends a run that stopped improving before the bound
SEEN_PER_CLASS = 800
EPOCHS = (3, 20)  # fewest, most passes the bound may be
EVALS_PER_EPOCH = 2
PATIENCE_EPOCHS = 2  # evaluations without improvement before stopping, in epochs
VALIDATION_ROWS = (300, 2000)  # a validation slice carved from train: at least (or a fifth of train), at most
MIN_ROWS = 4  # the fewest single-label training rows init writes a recipe for
BUDGET_FACTOR = 1.5  # the budget over the time the epochs bound takes at the measured step
# final/ holds the latest checkpoint this many standard errors of the best validation accuracy or nearer: on a
# few hundred validation rows the best is often a lucky early evaluation, where test accuracy still rose
BEST_WITHIN_SE = 1.0


# A handful of rows a class (at most FEWSHOT_ROWS on average): no validation slice worth the name can be carved,
# and a randomly initialised head fine-tuned for a few steps stays near chance. The few-shot recipe reads the
# encoder through mean pooling (model.pooling=mean), starts the head from a logistic regression on those features
# (model.head_init=probe), tunes the encoder contrastively for the first half of a fixed number of passes
# (train.contrastive_steps; the head refitted after it), then with the classification loss, every row in training;
# how the constants were chosen is in docs/ARCHITECTURE.md ("A handful of rows a class").
FEWSHOT_ROWS = 64
FEWSHOT_MIN_ROWS = 2  # rows a class the few-shot path needs (a class of one row is a label with no example to learn)
FEWSHOT = {"epochs": 40, "learning_rate": 5e-5, "warmup_ratio": 0.1}
FEWSHOT_CONTRASTIVE = 0.5  # the share of the steps that are contrastive
FEWSHOT_BATCH = 16  # rows a step: a few dozen rows still make several steps a pass

KINDS = {SINGLE: "single-label", MULTI: "multi-label", REGRESSION: "regression"}

# The encoders `finetune init` times and compares when no --model is given: the default first, stronger later
ENCODERS = ("minilm-l6", "mpnet-base")
# Without --minutes, the strongest installed encoder whose estimated run fits this many minutes is written (a
# run on a few dozen rows fits on any of them; on tens of thousands of rows MiniLM's does): tens of minutes on
# a laptop-class CPU, a coffee break rather than an evening
DEFAULT_MINUTES = 30.0


def choose_encoder(estimates: dict[str, tuple[float, float] | str], minutes: float | None) -> str:
    """The strongest of ENCODERS whose estimated run fits `minutes` (timed ones only); the default without
    a budget or when none fits."""
    fits = [m for m in ENCODERS if not isinstance(estimates.get(m, ""), str) and estimates[m][0] <= (minutes or 0)]
    return fits[-1] if fits else ENCODERS[0]


def encoders_note(
    estimates: dict[str, tuple[float, float] | str],
    chosen: str,
    minutes: float | None,
    data: str,
    default: bool = False,
) -> str:
    """init's line on each encoder's estimated run time here, which one it wrote and how to switch."""
    parts = []
    for alias in ENCODERS:
        e = estimates.get(alias, "not timed")
        if isinstance(e, str):
            parts.append(f"{alias}: not timed ({e.rstrip('.')})")
        else:
            switch = "written" if alias == chosen else f"finetune init {data} --model {alias}"
            parts.append(f"{alias} about {max(1, round(e[0]))} min at {e[1]:.2f} s a step ({switch})")
    fits = minutes is not None and not isinstance(estimates.get(chosen, ""), str) and estimates[chosen][0] <= minutes
    budget = f"the default budget of {minutes or 0:g} minutes (--minutes M sets another)" if default else ""
    budget = budget or f"--minutes {minutes or 0:g}"
    why = (
        ""
        if minutes is None
        else f"the strongest whose run fits {budget}"
        if fits
        else f"none fits {budget}: the fastest, stopped at the budget"
    )
    later = ", stronger" if len(ENCODERS) > 1 else ""
    return (
        f"estimated run time on this machine by encoder (fastest first{later}; the epochs bound at a step timed "
        "here, early stopping may end sooner): " + "; ".join(parts) + (f"; chose {chosen}: {why}" if why else "")
    )


def bf16_units(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """What runs bf16 matrix products natively here (the GPU training will use, else a CPU flag of
    CPU_BF16_FLAGS), None when nothing does: elsewhere bf16 is emulated and slower than fp32."""
    if torch.cuda.is_available():
        return "the GPU" if torch.cuda.is_bf16_supported() else None
    try:
        flags = set(cpuinfo.read_text(errors="replace").split())
    except OSError:
        return None
    return next((f"the CPU ({flag})" for flag in CPU_BF16_FLAGS if flag in flags), None)


def precision_mode(model: str) -> tuple[str | None, str]:
    """(precision.mode, why) for `model` on this machine: bf16 where its MODEL_RECIPES entry asks for it and
    `bf16_units` finds hardware for it; (None, why not) keeps the schema's fp32."""
    if not MODEL_RECIPES.get(model, {}).get("bf16"):
        return None, ""
    units = bf16_units()
    if units is None:
        return None, f"precision fp32: no bf16 units found here, where {model} would take bf16 autocast"
    return "bf16", f"precision bf16 autocast: {units} runs bf16 natively, faster steps than fp32 for {model}"


def recipe(problem_type: str, n_train: int, model: str = "minilm-l6") -> dict[str, Any]:
    """train.* keys for `problem_type` and `n_train` training rows, from RECIPES: fewer rows, more passes;
    `model`'s MODEL_RECIPES entry changes the learning rate and caps the epochs."""
    r = RECIPES[problem_type]
    epochs = next(e for bound, e in r["epochs"] if bound is None or n_train < bound)
    own = MODEL_RECIPES.get(model, {})
    rate = own.get("learning_rate", r["learning_rate"])
    epochs = min(epochs, own.get("max_epochs", epochs))
    return {"epochs": epochs, **{k: v for k, v in r.items() if k != "epochs"}, "learning_rate": rate}


def micro_batch(model: str, max_length: int) -> tuple[int, int]:
    """(micro-batch, accumulation): 32 rows, 16 above 256 tokens a row; where `model` has a token budget
    (MODEL_RECIPES), halved until within it and accumulated back to an effective batch of 32."""
    micro = 16 if max_length > 256 else 32
    tokens = MODEL_RECIPES.get(model, {}).get("tokens")
    if not tokens:
        return micro, 1
    micro = 32
    while micro > 1 and micro * max_length > tokens:
        micro //= 2
    return micro, 32 // micro


@dataclass
class Shape:
    """What the recipe looks at: training rows, rows per class (single-label), one text or a pair, whether a
    validation file exists, the batch, the model's size, and (when measured) seconds a training step."""

    rows: int
    class_rows: dict[str, int]
    pair: bool
    validation: int  # rows of the validation file (0: none, a slice of train is held out)
    batch: int = 32
    parameters: int | None = None  # the encoder's parameters (None: not known)
    step_seconds: float | None = None  # one optimizer step at the written batch and step_tokens, on this machine
    step_tokens: int | None = None  # the rows' length the step was timed at
    model: str = "minilm-l6"


@dataclass
class Recipe:
    """The keys init writes (per section) and why, one note each."""

    train: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    minutes: float | None = None  # the run's estimated length at the measured step (None: no step measured)


def learning_rate(parameters: int | None, model: str) -> tuple[float, str]:
    """The peak learning rate by model size (MODEL_RECIPES first): small encoders take larger steps."""
    own = MODEL_RECIPES.get(model, {}).get("learning_rate")
    if own is not None:
        return own, f"{model}'s own rate"
    if parameters is None or parameters <= 40e6:
        return 1e-4, "a small encoder (up to 40M parameters)" if parameters else "the default encoder's rate"
    if parameters <= 150e6:
        return 5e-5, f"a base-size model ({parameters / 1e6:.0f}M parameters)"
    return 2e-5, f"a large model ({parameters / 1e6:.0f}M parameters)"


def validation_rows(rows: int, classes: int) -> int:
    """How many training rows a stratified validation slice takes: 10%, at least enough to rank checkpoints
    (VALIDATION_ROWS[0], or 4 a class) but never past a fifth of train, at most VALIDATION_ROWS[1]."""
    low = min(rows // 5, max(VALIDATION_ROWS[0], 4 * classes))
    return min(rows - 1, max(1, low, min(VALIDATION_ROWS[1], round(0.1 * rows))))  # a tiny file still validates


def adaptive(shape: Shape) -> Recipe:
    """The single-label recipe for `shape` (module docstring), with its reasons.

    Raises:
        UserError: fewer than MIN_ROWS training rows (nothing to hold out and still learn from).
    """
    if shape.rows < MIN_ROWS:
        raise UserError(f"{shape.rows} training rows: too few to train and validate a classifier (at least {MIN_ROWS})")
    r = Recipe()
    classes = max(1, len(shape.class_rows))
    held = 0
    if not shape.validation:
        held = validation_rows(shape.rows, classes)
        r.data["validation_split"] = round(held / shape.rows, 4)
        r.notes.append(
            f"no validation file: {held} training rows held out for validation, stratified by label "
            f"(data.validation_split {r.data['validation_split']:g}, about {held / classes:.0f} a class)"
        )
    train_rows = shape.rows - held
    per_class = train_rows / classes
    smallest = min(shape.class_rows.values(), default=0) * train_rows / max(1, shape.rows)
    own_max = MODEL_RECIPES.get(shape.model, {}).get("max_epochs", EPOCHS[1])
    epochs = min(own_max, max(EPOCHS[0], min(EPOCHS[1], math.ceil(SEEN_PER_CLASS / per_class))))
    steps_per_epoch = max(1, math.ceil(train_rows / shape.batch))
    evals = EVALS_PER_EPOCH if steps_per_epoch >= 20 else 1
    every = max(1, math.ceil(steps_per_epoch / evals))
    patience = PATIENCE_EPOCHS * evals
    rate, why_rate = learning_rate(shape.parameters, shape.model)
    warmup = 0.1 if shape.pair else 0.06
    r.train |= {"epochs": epochs, "learning_rate": rate, "warmup_ratio": warmup}
    r.train |= {"eval_every_steps": every, "early_stopping_patience": patience}
    r.checkpoint |= {"every_steps": every, "export": "best", "keep_last": 1, "best_within_se": BEST_WITHIN_SE}
    own = f"; {shape.model}: its own rate, at most {own_max} epochs" if shape.model in MODEL_RECIPES else ""
    r.notes.append(
        f"{classes} classes, {per_class:,.0f} training rows a class (fewest {smallest:,.0f}): at most {epochs} epochs "
        f"(each class seen about {SEEN_PER_CLASS:,} times, {EPOCHS[0]} to {EPOCHS[1]} passes{own})"
    )
    r.notes.append(
        f"early stopping: an evaluation every {every} steps ({evals} an epoch of {steps_per_epoch} steps), stop after "
        f"{patience} without a better accuracy ({PATIENCE_EPOCHS} epochs); final/ holds the latest checkpoint within "
        f"{BEST_WITHIN_SE:g} standard error of the best accuracy (checkpoint.best_within_se: "
        f"{held or shape.validation:,} validation rows cannot rank nearer ones; the further-trained weights win)"
    )
    shape_word = "sentence pairs: a longer warmup" if shape.pair else "single texts"
    r.notes.append(f"learning rate {rate:g} ({why_rate}), warmup {warmup:g} ({shape_word})")
    if shape.step_seconds is not None:
        val_rows = held or shape.validation
        eval_s = math.ceil(val_rows / (2 * shape.batch)) * shape.step_seconds * 0.7  # forward only, twice the rows
        total = epochs * steps_per_epoch * shape.step_seconds + epochs * evals * eval_s
        r.minutes = total / 60
        minutes = max(5, math.ceil(BUDGET_FACTOR * total / 60))
        r.train["max_minutes"] = minutes
        r.notes.append(
            f"time budget {minutes} minutes (train.max_minutes): {BUDGET_FACTOR:g} x the {total / 60:.1f} minutes "
            f"{epochs} epochs take at {shape.step_seconds:.2f} s a step measured here"
            + (f" ({shape.batch} rows of {shape.step_tokens} tokens, their mean length)" if shape.step_tokens else "")
            + "; the run ends there with the "
            "best checkpoint if it has not stopped before"
        )
    return r


def is_fewshot(shape: Shape) -> bool:
    """Whether `shape` (single-label) gets the few-shot recipe: at most FEWSHOT_ROWS rows a class on average."""
    return bool(shape.class_rows) and shape.rows / len(shape.class_rows) <= FEWSHOT_ROWS


def fewshot(shape: Shape) -> Recipe:
    """The few-shot recipe for `shape` (FEWSHOT's comment), with its reasons.

    Raises:
        UserError: a class with fewer than FEWSHOT_MIN_ROWS rows, or fewer than 2 classes.
    """
    small = sorted(k for k, v in shape.class_rows.items() if v < FEWSHOT_MIN_ROWS)
    if small or len(shape.class_rows) < 2:
        what = f"class {small[0]!r} has {shape.class_rows[small[0]]} row" if small else "one class"
        raise UserError(
            f"{shape.rows} training rows and {what}: the few-shot recipe needs at least {FEWSHOT_MIN_ROWS} rows a "
            "class in 2 classes or more (8 a class or more give a useful model)"
        )
    r = Recipe()
    classes = len(shape.class_rows)
    per_class = shape.rows / classes
    r.model |= {"pooling": "mean", "head_init": "probe"}
    r.train |= FEWSHOT
    batch = min(shape.batch, FEWSHOT_BATCH)
    steps = FEWSHOT["epochs"] * math.ceil(shape.rows / batch)
    r.train["contrastive_steps"] = contrastive = round(FEWSHOT_CONTRASTIVE * steps)
    r.notes.append(
        f"{classes} classes, {per_class:,.0f} training rows a class (at most {FEWSHOT_ROWS} a class on average): the "
        "few-shot recipe: the encoder read through mean pooling (model.pooling=mean), the head started from a "
        f"logistic regression on those features (model.head_init=probe), then {FEWSHOT['epochs']} passes at "
        f"learning rate {FEWSHOT['learning_rate']:g} ({steps} steps): the first {contrastive} contrastive "
        "(train.contrastive_steps: rows of one label pulled together, of different labels apart; the head refitted "
        "after them), the rest with the classification loss"
    )
    validation = (
        f"the {shape.validation:,} rows of the validation file are scored at the end"
        if shape.validation
        else "no validation slice is held out"
    )
    r.notes.append(
        f"stopping point: fixed, not chosen on validation ({validation}): with a few rows a class a held-out slice "
        "cannot rank checkpoints, so the recipe's passes were measured once on other data (docs/ARCHITECTURE.md); "
        "the test interval is the test rows' sampling error for this model, not the spread between different "
        "draws of the few training rows, which is larger (docs/RESULTS.md)"
    )
    if shape.step_seconds is not None:  # no train.max_minutes: a fixed recipe, and no checkpoint ranking to end on
        seconds = shape.step_seconds * batch / shape.batch
        r.minutes = steps * seconds / 60
        r.notes.append(f"estimated run: {r.minutes:.1f} minutes ({steps} steps at {seconds:.2f} s a step timed here)")
    return r


def single_label(shape: Shape) -> Recipe:
    """The single-label recipe: few-shot (`fewshot`) for a handful of rows a class, else `adaptive`.

    Raises:
        UserError: too few rows for either (their Raises).
    """
    return fewshot(shape) if is_fewshot(shape) else adaptive(shape)


def parameter_count(config: Any) -> int | None:
    """The encoder's parameters from a transformers config (embeddings + 12 h^2 a layer), None when unknown."""
    h, layers, vocab = (getattr(config, k, None) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    if not (h and layers and vocab):
        return None
    return int(vocab * h + layers * 12 * h * h)


# rows x tokens of the micro-batch timed on a CPU: its matrix products are already at full throughput there, so
# a larger micro-batch takes proportionally longer; timing the written one took minutes and gigabytes on long rows
TIMED_TOKENS = 1024


def step_seconds(
    cfg: Config, label_names: list[str], tokenizer: Any, micro: int, accumulation: int, length: int | None = None
) -> float:
    """Seconds of one training step (forward, backward, AdamW) of `cfg`'s model at `micro` x `length` tokens
    (data.max_length without it) x `accumulation`, timed on this machine (its GPU when there is one, as training
    will run). A CPU times one micro-batch of about TIMED_TOKENS tokens (never more rows than `micro`) and scales
    its forward and backward by the rows of the window; the optimizer step is timed once, as it runs once. The
    fastest of two timings after one to warm up."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, optimizer = build_for_planning(cfg, label_names, tokenizer, device=device)
    model.to(device).train()
    length = length or cfg.data.max_length
    rows = micro if device == "cuda" else min(micro, max(1, TIMED_TOKENS // length))
    generator = torch.Generator().manual_seed(0)
    vocab = int(getattr(tokenizer, "vocab_size", 1000))
    batch = {
        "input_ids": torch.randint(0, vocab, (rows, length), generator=generator),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "labels": torch.zeros(rows, dtype=torch.long),
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    autocast = autocast_context(cfg.precision.mode)
    scale = accumulation * micro / rows  # micro-batches of `rows` in one window
    times = []
    for _ in range(3):
        start = time.perf_counter()
        train_micro_step(model, batch, autocast, 1.0 / (rows * accumulation))
        _sync(device)  # kernels run asynchronously: a phase ends when they do
        middle = time.perf_counter()
        step_and_zero(model, optimizer, None)
        _sync(device)
        times.append(scale * (middle - start) + time.perf_counter() - middle)
    return min(times[1:])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_keys(
    problem_type: str, shape: Shape, model: str, micro: int, accumulation: int, notes: list[str]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(train, data, checkpoint, model) keys of the recipe, its reasons appended to `notes`: single-label few-shot
    (recipe.fewshot) or adaptive (recipe.adaptive), multi-label and regression from their tables."""
    train: dict[str, Any] = {"micro_batch_size": micro, "gradient_accumulation_steps": accumulation}
    if problem_type == SINGLE:
        r = single_label(shape)
        if is_fewshot(shape):  # FEWSHOT_BATCH rows a step, in micro-batches no larger than the written ones
            small = min(micro, FEWSHOT_BATCH)
            train = {"micro_batch_size": small, "gradient_accumulation_steps": max(1, FEWSHOT_BATCH // small)}
        notes += r.notes
        return train | r.train, r.data, r.checkpoint, r.model
    r2 = recipe(problem_type, shape.rows, model)
    own = MODEL_RECIPES.get(model)
    notes.append(
        f"{shape.rows} training rows: the {KINDS[problem_type]} recipe for that size (recipe.RECIPES"
        + (f"; {model}: its own rate, at most {own['max_epochs']} epochs" if own else "")
        + "): "
        + ", ".join(f"{k} {v:g}" for k, v in r2.items())
    )
    data = {} if shape.validation else {"validation_split": 0.1}
    if not shape.validation:
        notes.append("no validation file: 10% of train held out (data.validation_split)")
    return (
        {"epochs": r2["epochs"], **train, **{k: v for k, v in r2.items() if k != "epochs"}} | {"eval_every_steps": 200},
        data,
        {},
        {},
    )
