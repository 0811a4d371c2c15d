"""`finetune init DATA`'s config: from what sniff.py sniffed to a commented config that trains with no edits.

max_length from the texts' (or pairs') token lengths within the model's position limit, the data's shape
for `recipe.py` (rows, rows per class, pair, validation rows, the model's size), a training step timed here,
each encoder's estimated run time when no model is named, and the config written with the reasons as
comments, validated before it is kept.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from finetune.config.files import load_config, validate_config
from finetune.config.schema import TrainConfig
from finetune.config.tasks import SINGLE
from finetune.core.errors import UserError
from finetune.init.recipe import (
    DEFAULT_MINUTES,
    ENCODERS,
    KINDS,
    MODEL_RECIPES,
    Shape,
    choose_encoder,
    encoders_note,
    micro_batch,
    parameter_count,
    precision_mode,
    single_label,
    step_seconds,
    train_keys,
)
from finetune.init.sniff import Sniffed, sniff_data, split_rows
from finetune.memory.peak import GiB, margin_bytes
from finetune.memory.planner import default_device, predict_peak
from finetune.model.load import build_tokenizer, model_config, row_limit


def _yaml(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render(
    model: str,
    out_name: str,
    data: dict[str, Any],
    train: dict[str, Any],
    notes: list[str],
    problem_type: str | None,
    checkpoint: dict[str, Any] | None = None,
    precision: dict[str, Any] | None = None,
    model_keys: dict[str, Any] | None = None,
) -> str:
    """The config text: launch line, schema modeline, the reasons as comments, then the sections."""
    lines = [
        f"# accelerate launch --cpu finetune/train.py --config {out_name}",
        "# yaml-language-server: $schema=configs/schema.json",
        "# written by `finetune init`; what it found:",
    ] + [f"#   {n}" for n in notes]
    lines += ["run:", f"  output_dir: runs/{Path(out_name).stem}", "  seed: 42", "model:", f"  name_or_path: {model}"]
    if problem_type:
        lines.append(f"  problem_type: {problem_type}")
    lines += [f"  {k}: {_yaml(v)}" for k, v in (model_keys or {}).items()]
    lines.append("data:")
    lines += [f"  {k}: {_yaml(v)}" for k, v in data.items()]
    lines.append("train:")
    lines += [f"  {k}: {_yaml(v)}" for k, v in train.items()]
    for section, keys in (("checkpoint", checkpoint), ("precision", precision)):
        if keys:
            lines.append(f"{section}:")
            lines += [f"  {k}: {_yaml(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def _max_length(s: Sniffed, data: dict[str, Any], tok: Any, limit: int | None) -> int:
    """The 99th percentile of the token lengths (a pair: both texts together), rounded up to 16, at
    least 32, at most the model's position limit and 512; said in `s.notes`."""
    text_col = data.get("text_column", "text")
    stride = max(1, len(s.columns[text_col]) // 2000)  # ~2,000 texts spread over the file
    sample = [str(t) for t in s.columns[text_col][::stride]]
    pair_col = data.get("text_pair_column")  # a pair is one model row: its length is both texts together
    pairs = [str(t) for t in s.columns[pair_col][::stride]] if pair_col else None
    lengths = sorted(len(x) for x in tok(sample, pairs, truncation=False)["input_ids"])
    s.mean_tokens = statistics.fmean(lengths)
    p99 = lengths[min(len(lengths) - 1, math.ceil(0.99 * len(lengths)) - 1)]
    wanted = max(32, 16 * math.ceil(p99 / 16))
    cap = min(512, limit or 512)
    what = "pairs (both texts together)" if pairs else "texts"
    note = f"max_length {min(wanted, cap)}: the 99th percentile of {len(lengths)} {what} is {p99} tokens"
    if pairs:  # the tokenizer's longest_first truncation: the longer text gives up tokens until the pair fits
        note += "; a longer pair loses tokens from its longer text first, so neither text is cut away"
    if wanted > cap:
        why = (
            "the model's position limit"
            if limit is not None and limit <= 512
            else f"init's ceiling; the model reads up to {limit} tokens at more memory"
        )
        note += f", cut to {cap} ({why}): longer texts are truncated (data.truncation, or windows: data.chunk_stride)"
    s.notes.append(note)
    return min(wanted, cap)


def _class_rows(s: Sniffed, data: dict[str, Any], rows: int) -> dict[str, int]:
    """Rows per label over the whole train file (the sample's counts scaled to `rows`)."""
    values = s.columns.get(data.get("label_column", "label"), [])
    counts = Counter(str(v) for v in values)
    scale = rows / max(1, len(values))
    return {k: max(1, round(v * scale)) for k, v in counts.items()}


def _shape(s: Sniffed, data: dict[str, Any], splits: dict[str, Path], model: str, batch: int) -> Shape:
    """The data's shape as the recipe sees it: rows, rows a class, pair, validation rows, the model's size."""
    sampled = len(next(iter(s.columns.values())))
    rows = split_rows(splits["train"], s, sampled) if "train" in splits else sampled
    validation = splits.get("validation")
    return Shape(
        rows=rows,
        class_rows=_class_rows(s, data, rows),
        pair="text_pair_column" in data,
        validation=split_rows(validation, s, 1) if validation else 0,
        batch=batch,
        model=model,
    )


def _time_step(
    shape: Shape, cfg: Any, tok: Any, micro: int, accumulation: int, mean_tokens: float, timed: float | None = None
) -> None:
    """`shape.step_seconds` (`timed` when the step was measured already) and `shape.step_tokens`: a step at the
    rows' mean padded length (batches are grouped by length: each pads to about 1.1x its rows' mean), not at
    max_length, which only the longest batches reach."""
    shape.step_tokens = min(cfg.data.max_length, max(8, 8 * math.ceil(1.1 * mean_tokens / 8)))
    shape.step_seconds = timed or step_seconds(
        cfg, sorted(shape.class_rows) or ["a", "b"], tok, micro, accumulation, shape.step_tokens
    )


def _estimate(alias: str, s: Sniffed, data: dict[str, Any], splits: dict[str, Path]) -> tuple[float, float] | str:
    """(minutes the recipe's run takes, seconds a step) with `alias` on this data, a step timed here; why not."""
    notes = list(s.notes)
    try:
        cfg = load_config_for_tokenizer(alias)
        tok = build_tokenizer(cfg)
        cfg.data.max_length = _max_length(s, dict(data), tok, row_limit(cfg, tok))
        micro, accumulation = micro_batch(alias, cfg.data.max_length)
        cfg.precision.mode = precision_mode(alias)[0] or cfg.precision.mode
        shape = _shape(s, data, splits, alias, micro * accumulation)
        shape.parameters = parameter_count(model_config(cfg, tok)[0])
        _time_step(shape, cfg, tok, micro, accumulation, s.mean_tokens)
        return float(single_label(shape).minutes or 0.0), float(shape.step_seconds or 0.0)
    except UserError as e:
        return str(e)
    finally:
        s.notes[:] = notes  # the chosen model's own notes come later


def available_bytes(device: str, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Memory a run can have here: the GPU's total, else the system's MemAvailable (None: not readable)."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[1])
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def fit_micro_batch(cfg: Any, tok: Any, labels: list[str], micro: int, accumulation: int) -> tuple[int, int, str]:
    """(micro-batch, accumulation, note): the planner's peak (with its margin) of a window at data.max_length, the
    micro-batch halved and the accumulation doubled until it fits the memory available here (`available_bytes`)."""
    device = default_device()
    have = available_bytes(device)
    while True:
        m = predict_peak(cfg, micro, accumulation, tok, labels, device=device)
        need = m.peak_bytes + margin_bytes(m.peak_bytes, device)
        if have is None or need <= have or micro == 1:
            break
        micro, accumulation = micro // 2, accumulation * 2
    where = "unknown memory here" if have is None else f"{have / GiB:.1f} GiB available here ({device})"
    fits = have is None or need <= have
    note = (
        f"planned peak {need / GiB:.2f} GiB (`finetune plan`: tensors of a window of {micro} x "
        f"{cfg.data.max_length} tokens, x{accumulation} accumulated, {cfg.precision.mode}"
        + (", with the CUDA margin" if device == "cuda" else "; the process adds its own libraries on a CPU")
        + f") against {where}"
        + ("" if fits else ": does not fit even one row a micro-batch; see `finetune plan --grid`")
    )
    return micro, accumulation, note


def _batch_note(model: str, micro: int, accumulation: int, chosen: int) -> str | None:
    """Why the micro-batch is not 32 rows (None when it is): memory, the model's token budget or long rows."""
    own = MODEL_RECIPES.get(model, {})
    if micro < chosen:
        return f"micro_batch_size {micro} x gradient_accumulation_steps {accumulation}: {chosen} rows did not fit"
    if micro != 32 and own.get("tokens"):
        return (
            f"micro_batch_size {micro} x gradient_accumulation_steps {accumulation}: at most {own['tokens']:,} "
            f"tokens a micro-batch for {model}"
        )
    return f"micro_batch_size {micro}: rows of more than 256 tokens" if micro != 32 else None


def init_config(
    data_path: Path,
    out: Path,
    model: str | None = None,
    force: bool = False,
    budget: bool = True,
    minutes: float | None = None,
) -> list[str]:
    """Write a config for `data_path` to `out`; return the notes printed to the user. With `budget`, a
    training step of the model is timed here and single-label data gets a time budget from it; without
    `model`, each of recipe.ENCODERS is timed and compared, and with `minutes` the strongest that fits is chosen.

    Raises:
        UserError: unreadable or ambiguous data, `minutes` without a timed single-label recipe, or `out`
            exists without `force`.
    """
    if out.exists() and not force:
        raise UserError(f"{out} exists; choose another -o or pass --force to replace it")
    data_path = data_path.resolve()
    if not data_path.exists():
        raise UserError(f"{data_path} does not exist")
    s, data, splits = sniff_data(data_path)
    problem_type = data.pop("problem_type", SINGLE)
    if minutes is not None and (not budget or problem_type != SINGLE):
        raise UserError(
            f"--minutes {minutes:g}: a time budget is chosen for single-label data with a timed step "
            + ("(not with --no-budget)" if not budget else f"(this file is {KINDS[problem_type]})")
        )
    steps: dict[str, float] = {}
    if budget and problem_type == SINGLE and model is None:
        estimates = {alias: _estimate(alias, s, data, splits) for alias in ENCODERS}
        steps = {alias: e[1] for alias, e in estimates.items() if not isinstance(e, str)}
        budget_minutes = minutes if minutes is not None else DEFAULT_MINUTES
        model = choose_encoder(estimates, budget_minutes)
        s.notes.append(encoders_note(estimates, model, budget_minutes, data_path.name, default=minutes is None))
    model = model or ENCODERS[0]
    cfg = load_config_for_tokenizer(model)
    tok = build_tokenizer(cfg)
    data["max_length"] = _max_length(s, data, tok, row_limit(cfg, tok))
    micro, accumulation = micro_batch(model, data["max_length"])
    shape = _shape(s, data, splits, model, micro * accumulation)
    shape.parameters = parameter_count(model_config(cfg, tok)[0])
    mode, why_mode = precision_mode(model)
    if why_mode:
        s.notes.append(why_mode)
    cfg.data.max_length = data["max_length"]
    cfg.precision.mode = mode or cfg.precision.mode
    chosen = micro
    if budget:  # the planner builds the model on fake tensors: seconds, as the timed step below
        micro, accumulation, plan_note = fit_micro_batch(
            cfg, tok, sorted(shape.class_rows) or ["a", "b"], micro, accumulation
        )
        shape.batch = micro * accumulation
        s.notes.append(plan_note)
    if budget and problem_type == SINGLE:
        _time_step(shape, cfg, tok, micro, accumulation, s.mean_tokens, steps.get(model))
    train, more_data, checkpoint, model_keys = train_keys(problem_type, shape, model, micro, accumulation, s.notes)
    if minutes is not None and "max_minutes" not in train and problem_type == SINGLE:
        s.notes.append(f"--minutes {minutes:g}: chose the encoder; the few-shot recipe's passes are fixed")
    elif minutes is not None and minutes < train.get("max_minutes", math.inf):  # the user's budget bounds the recipe's
        s.notes.append(f"--minutes {minutes:g}: train.max_minutes {minutes:g} (the recipe's own budget replaced)")
        train["max_minutes"] = minutes
    data |= more_data
    note = _batch_note(model, micro, accumulation, chosen)
    if note:
        s.notes.append(note)
    # keys at the schema's default are said in the notes above, not written
    train = {k: v for k, v in train.items() if v != TrainConfig.model_fields[k].default}
    out.parent.mkdir(parents=True, exist_ok=True)
    kind = problem_type if problem_type != SINGLE else None
    precision = {"mode": mode} if mode else None
    out.write_text(render(model, str(out), data, train, s.notes, kind, checkpoint, precision, model_keys))
    try:
        load_config(out)  # what was written validates
    except UserError:
        out.unlink()  # nothing written on an error
        raise
    return s.notes


def load_config_for_tokenizer(model: str) -> Any:
    """A minimal config naming `model`, to build its tokenizer the way training will."""
    return validate_config(
        {"run": {"output_dir": "unused"}, "model": {"name_or_path": model}, "data": {"train_file": "unused"}}
    )
