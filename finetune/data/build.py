"""Raw splits (`finetune.data.reading`) -> tokenized splits with the data report -> dataloaders.

Tokenization runs once through `datasets.map` (cached on disk for
files). Training batches come from the window's seeded length-grouped batch sampler, whose batches
also carry the number of samples in their accumulation window (`finetune.data.window.WindowedBatchSampler`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import datasets
import huggingface_hub
import numpy as np
import torch
from torch.utils.data import DataLoader

from finetune.config.schema import Config
from finetune.config.tasks import MULTI, REGRESSION, SINGLE
from finetune.core.errors import UserError
from finetune.core.fileio import file_sha256
from finetune.data.collate import Collator
from finetune.data.packing import PackingCollator
from finetune.data.reading import RawSplits, load_raw_splits, read_unlabeled
from finetune.data.window import WindowedBatchSampler, WindowedDataset

logger = logging.getLogger("finetune")
datasets.logging.set_verbosity_error()
huggingface_hub.utils.logging.set_verbosity_error()  # offline: no retry warnings, one UserError line
datasets.disable_progress_bars()  # loading is quick; the training bar is the one to watch

# ----------------------------------------------------------------------------------------------
# Tokenization and the data report.


@dataclass(frozen=True)
class Windowing:
    """How a text longer than `max_length` becomes model input: one truncated row (`truncation`:
    head, tail or head_tail) or several overlapping windows (`chunk_stride` tokens of overlap)."""

    max_length: int
    truncation: str | None = None  # None: head
    head_fraction: float = 0.25
    chunk_stride: int | None = None

    @classmethod
    def of(cls, cfg: Config) -> Windowing:
        d = cfg.data
        return cls(d.max_length, d.truncation, d.head_fraction, d.chunk_stride)


def _special_layout(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a single text (e.g. [CLS] ... [SEP], <s> ...).

    Raises:
        UserError: the tokenizer does not wrap a text in a fixed prefix and suffix.
    """
    inner = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for i in range(len(full) - len(inner) + 1):
        if full[i : i + len(inner)] == inner:
            return full[:i], full[i + len(inner) :]
    raise UserError("data.truncation: this tokenizer's special tokens are not a fixed prefix/suffix; use head")


def _keep(ids: list[int], budget: int, mode: str, head_fraction: float) -> list[int]:
    """tail: the last `budget` tokens; head_tail: round(budget x head_fraction) first, the rest last."""
    if len(ids) <= budget:
        return ids
    head = 0 if mode == "tail" else round(budget * head_fraction)
    return ids[:head] + ids[len(ids) - (budget - head) :]


def encode_texts(
    tokenizer: Any, texts: list[str], pairs: list[str] | None, w: Windowing, measure: bool = True
) -> dict[str, list[Any]]:
    """Model inputs for `texts` (and `pairs`) plus `doc` (the index of each row's text: several rows
    per text with chunking), `length` and, with `measure` (the data report's: prediction skips the
    extra tokenization), `truncated` (the text did not fit in one row).

    Raises:
        UserError: a chunk stride that leaves no room for new tokens in a window.
    """
    n = len(texts)
    if w.chunk_stride is not None:
        room = w.max_length - tokenizer.num_special_tokens_to_add(pair=False)
        if w.chunk_stride >= room:
            raise UserError(
                f"data.chunk_stride={w.chunk_stride} must be smaller than data.max_length minus the "
                f"special tokens ({room})"
            )
        enc = dict(
            tokenizer(
                texts, truncation=True, max_length=w.max_length, stride=w.chunk_stride, return_overflowing_tokens=True
            )
        )
        docs = list(enc.pop("overflow_to_sample_mapping"))
    elif w.truncation in ("tail", "head_tail"):
        prefix, suffix = _special_layout(tokenizer)
        budget = w.max_length - len(prefix) - len(suffix)
        inner = tokenizer(texts, add_special_tokens=False)["input_ids"]
        ids = [prefix + _keep(x, budget, w.truncation, w.head_fraction) + suffix for x in inner]
        enc = {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}
        if "token_type_ids" in tokenizer.model_input_names:
            enc["token_type_ids"] = [[0] * len(x) for x in ids]
        docs = list(range(n))
    else:
        enc = dict(tokenizer(texts, pairs, truncation=True, max_length=w.max_length))
        docs = list(range(n))
    enc["doc"] = docs
    enc["length"] = [len(x) for x in enc["input_ids"]]
    if measure:
        full = tokenizer(texts, pairs, truncation=False)["input_ids"]
        enc["truncated"] = [len(full[d]) > w.max_length for d in docs]
    return enc


def tokenize_split(
    ds: datasets.Dataset, tokenizer: Any, windowing: Windowing | int, target: Callable[[Any], Any] | None
) -> datasets.Dataset:
    """Tokenize once (cached by `map`): rows as `encode_texts` makes them, `doc` numbered over the
    whole split, `labels` from `target` (`RawSplits.target`) repeated for every window of a text."""
    w = windowing if isinstance(windowing, Windowing) else Windowing(windowing)
    has_pair = "text_pair" in ds.column_names

    def encode(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out = encode_texts(tokenizer, batch["text"], batch["text_pair"] if has_pair else None, w)
        if target is not None and "label" in batch:
            out["labels"] = [target(batch["label"][d]) for d in out["doc"]]
        out["doc"] = [indices[d] for d in out["doc"]]
        return out

    remove = [c for c in ds.column_names if c in ("text", "text_pair", "label")]
    return ds.map(encode, batched=True, with_indices=True, remove_columns=remove, desc="tokenize")


def with_swapped_pairs(
    raw_train: datasets.Dataset,
    train: datasets.Dataset,
    tokenizer: Any,
    windowing: Windowing,
    target: Callable[[Any], Any],
) -> datasets.Dataset:
    """`train` (tokenized from `raw_train`) followed by every pair tokenized as (second, first): a
    model of a symmetric relation sees both orders, as sentence-transformers' cross-encoder STS-B
    recipe trains. The copies count as texts of their own (`doc` after the originals)."""
    swapped = raw_train.rename_columns({"text": "text_pair", "text_pair": "text"})
    copies = tokenize_split(swapped, tokenizer, windowing, target)
    offset = len(raw_train)
    copies = copies.map(lambda b: {"doc": [d + offset for d in b["doc"]]}, batched=True, desc="swap pairs")
    return datasets.concatenate_datasets([train, copies])


def sample_weights(
    train: datasets.Dataset, label_names: list[str], class_weights: str | list[float] | None
) -> list[float] | None:
    """Per training row: its class weight x 1/(windows of its text); None when every weight is 1.

    Raises:
        UserError: a class weight list of the wrong length.
    """
    docs = train["doc"][:]
    windows = Counter(docs)
    weights = [1.0 / windows[d] for d in docs]
    if class_weights is not None:
        labels = train["labels"][:]
        if class_weights == "auto":  # inverse class frequency over texts (not windows), mean 1 over classes
            first = {d: y for d, y in zip(docs, labels, strict=True)}
            counts = Counter(first.values())
            inverse = [1.0 / counts[c] if counts[c] else 0.0 for c in range(len(label_names))]
            mean = sum(inverse) / sum(1 for x in inverse if x)
            per_class = [x / mean for x in inverse]
            logger.info(
                "class weights (auto): "
                + ", ".join(f"{n} {w:.3g}" for n, w in zip(label_names, per_class, strict=True))
            )
        else:
            if len(class_weights) != len(label_names):
                raise UserError(
                    f"train.class_weights has {len(class_weights)} weights for {len(label_names)} labels "
                    f"{label_names} (label-id order)"
                )
            per_class = list(class_weights)
        weights = [w * per_class[y] for w, y in zip(weights, labels, strict=True)]
    return None if all(w == 1.0 for w in weights) else weights


def _label_summary(raw: RawSplits, ds: datasets.Dataset) -> dict[str, Any]:
    """Per-label counts (positives per label for multi-label), or the score distribution (regression)."""
    if raw.problem_type == REGRESSION:
        t = torch.tensor(ds["label"][:], dtype=torch.float64)
        return {
            "score_stats": {
                "min": float(t.min()),
                "max": float(t.max()),
                "mean": float(t.mean()),
                "std": float(t.std()) if len(t) > 1 else 0.0,
            }
        }
    labels = ds["label"][:]
    rows = labels if raw.problem_type == MULTI else [[v] for v in labels]
    counts = Counter(raw.raw_to_name[v] for row in rows for v in set(row))
    out: dict[str, Any] = {"class_counts": {n: counts.get(n, 0) for n in raw.label_names}}
    if raw.problem_type == MULTI:
        out["labels_per_row"] = float(sum(len(set(r)) for r in rows) / max(1, len(rows)))
    return out


def build_data_report(raw: RawSplits, tokenized: dict[str, datasets.Dataset]) -> dict[str, Any]:
    """Rows per split, class balance (or score distribution), duplicates within and across splits,
    truncated share."""
    report: dict[str, Any] = {"labels": raw.label_names, "problem_type": raw.problem_type, "splits": {}}
    train_texts = set(raw.train["text"][:])
    for name, ds in (("train", raw.train), ("validation", raw.validation), ("test", raw.test)):
        if ds is None:
            continue
        texts = ds["text"][:]
        tok = tokenized[name]
        cut = {d for d, t in zip(tok["doc"][:], tok["truncated"][:], strict=True) if t}  # texts longer than a row
        entry: dict[str, Any] = {
            "rows": len(ds),
            **_label_summary(raw, ds),
            "duplicates_within": len(texts) - len(set(texts)),
            "truncated_fraction": float(len(cut) / max(1, len(ds))),
            "mean_tokens": float(sum(tok["length"][:]) / max(1, len(tok))),  # per model row (a window when chunked)
        }
        if len(tok) != len(ds):
            entry["windows"] = len(tok)
        if name == "train" and raw.excluded:
            entry["excluded_rows"] = raw.excluded
        if name != "train":
            entry["overlap_with_train"] = sum(1 for t in set(texts) if t in train_texts)
        report["splits"][name] = entry
    return report


SPARK = "▁▂▃▄▅▆▇█"


def _class_summary(counts: dict[str, int], show: int = 12) -> str:
    """Every class with its count, or for many classes the smallest and largest few, a histogram
    line of all counts (sorted, largest first) and the imbalance ratio; data_report.json has them all."""
    if len(counts) <= show:
        return ", ".join(f"{k} {v}" for k, v in counts.items())
    ranked = sorted(counts.items(), key=lambda kv: kv[1])
    top = max(v for _, v in ranked) or 1
    spark = "".join(SPARK[min(7, int(8 * v / (top + 1)))] for _, v in reversed(ranked))
    smallest = ", ".join(f"{k} {v}" for k, v in ranked[:3])
    largest = ", ".join(f"{k} {v}" for k, v in reversed(ranked[-3:]))
    low = ranked[0][1]
    ratio = f"{top / low:.1f}x" if low else "inf (a class without rows)"
    return f"{len(counts)} classes; smallest {smallest}; largest {largest}; imbalance {ratio}; {spark}"


def format_data_report(report: dict[str, Any]) -> str:
    """A few log lines summarising the data report."""
    lines = []
    for name, e in report["splits"].items():
        if "score_stats" in e:
            st = e["score_stats"]
            balance = f"score {st['min']:g}..{st['max']:g}, mean {st['mean']:.3g}, sd {st['std']:.3g}"
        else:
            balance = _class_summary(e["class_counts"])
            if "labels_per_row" in e:
                balance = f"positives per label: {balance}; {e['labels_per_row']:.2f} labels/row"
        extra = f", {e['overlap_with_train']} also in train" if "overlap_with_train" in e else ""
        if e.get("excluded_rows"):
            extra += f"; {e['excluded_rows']} rows left out (data.exclude_rows)"
        if e.get("unlabeled_rows"):
            extra += f"; {e['unlabeled_rows']} unlabeled rows learnt from the teacher alone (distill.unlabeled_file)"
        if "swapped_rows" in e:
            extra += f"; trains on {e['swapped_rows']} more rows with the pair's texts swapped"
        lines.append(
            f"{name}: {e['rows']} rows ({balance}); {e['duplicates_within']} duplicate texts{extra}; "
            f"{100 * e['truncated_fraction']:.1f}% truncated; {e['mean_tokens']:.1f} tokens/row"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Distillation: the teacher's outputs beside each training row.


class SoftTargets(Protocol):
    """The teacher's outputs for the texts a student trains on (`finetune.deploy.teacher.TeacherOutputs`)."""

    def __call__(
        self, texts: list[str], pairs: list[str] | None, label_names: list[str], problem_type: str
    ) -> np.ndarray:
        """fp32 logits, one row per text in order.

        Raises:
            UserError: a teacher whose label names or problem type are not the data's.
        """
        ...


def _with_soft_columns(ds: datasets.Dataset, logits: np.ndarray, gold: float) -> datasets.Dataset:
    """`teacher_logits` (the row's text's, repeated for every window of a long text) and `gold` (1.0: the row's
    label counts, 0.0: an unlabeled row) added to a tokenized split whose `doc` numbers the rows of `logits`."""
    docs = ds["doc"][:]
    ds = ds.add_column(
        "teacher_logits", [logits[d].tolist() for d in docs], feature=datasets.Sequence(datasets.Value("float32"))
    )
    return ds.add_column("gold", [gold] * len(ds), feature=datasets.Value("float32"))


def with_teacher(
    train: datasets.Dataset,
    weights: list[float] | None,
    raw: RawSplits,
    unlabeled: datasets.Dataset | None,
    soft_targets: SoftTargets,
    tokenizer: Any,
    windowing: Windowing,
) -> tuple[datasets.Dataset, list[float] | None]:
    """The tokenized training split with the teacher's logits of every row, followed by the unlabeled rows (their
    `labels` a placeholder of the labels' type that `gold` 0.0 keeps out of the loss, their `doc` after the labelled
    texts'), and the sample weights of both (an unlabeled row: 1/windows of its text)."""
    pair = "text_pair" in raw.train.column_names
    texts = raw.train["text"][:] + (unlabeled["text"][:] if unlabeled is not None else [])
    pairs = raw.train["text_pair"][:] + (unlabeled["text_pair"][:] if unlabeled is not None else []) if pair else None
    logits = np.asarray(soft_targets(texts, pairs, raw.label_names, raw.problem_type), dtype=np.float32)
    n = len(raw.train)
    train = _with_soft_columns(train, logits[:n], 1.0)
    if unlabeled is None:
        return train, weights
    extra = _with_soft_columns(tokenize_split(unlabeled, tokenizer, windowing, None), logits[n:], 0.0)
    placeholder = {SINGLE: 0, MULTI: [0.0] * len(raw.label_names), REGRESSION: 0.0}[raw.problem_type]
    extra = extra.add_column("labels", [placeholder] * len(extra), feature=train.features["labels"])
    extra = extra.map(lambda b: {"doc": [d + n for d in b["doc"]]}, batched=True, desc="unlabeled rows")
    extra = extra.select_columns(train.column_names).cast(train.features)
    windows = Counter(extra["doc"][:])
    extra_weights = [1.0 / windows[d] for d in extra["doc"][:]]
    if weights is not None or any(w != 1.0 for w in extra_weights):
        weights = (weights or [1.0] * len(train)) + extra_weights
    return datasets.concatenate_datasets([train, extra]), weights


@dataclass
class Data:
    """Tokenized splits and what was learned about them."""

    train: Any
    validation: Any
    test: Any
    label_names: list[str]
    report: dict[str, Any]
    files: dict[str, Path]
    sha256: dict[str, str]  # of each data file: provenance.json, and resume refuses changed data
    problem_type: str = SINGLE
    texts: dict[str, list[str]] = field(default_factory=dict)  # validation / test texts: predictions.jsonl
    pairs: dict[str, list[str]] = field(default_factory=dict)  # their second texts, for pair tasks


def build_data(cfg: Config, tokenizer: Any, soft_targets: SoftTargets | None = None) -> Data:
    """Read and tokenize all splits; build the data report. With `soft_targets` (`distill.teacher`) every training
    row carries its teacher's logits and `distill.unlabeled_file`'s rows join the training split (`with_teacher`).

    Raises:
        UserError: unreadable or inconsistent data, options that need validation data without it, an unreadable
            unlabeled file, or a teacher that does not fit the data.
    """
    raw = load_raw_splits(cfg)
    unlabeled = None
    if soft_targets is not None and cfg.distill.unlabeled_file is not None:
        unlabeled, raw.files["unlabeled"] = read_unlabeled(cfg)
    if raw.validation is None:
        needs = [
            k
            for k, v in (
                ("train.eval_every_steps", cfg.train.eval_every_steps),
                ("train.early_stopping_patience", cfg.train.early_stopping_patience),
            )
            if v
        ]
        if needs:
            raise UserError(
                f"{' and '.join(needs)} need validation data: set data.validation_file or data.validation_split, "
                f"or remove {' and '.join(needs)}"
            )
    windowing = Windowing.of(cfg)
    tok = {
        name: tokenize_split(ds, tokenizer, windowing, raw.target)
        for name, ds in (("train", raw.train), ("validation", raw.validation), ("test", raw.test))
        if ds is not None
    }
    report = build_data_report(raw, tok)
    if cfg.data.swap_pairs:
        tok["train"] = with_swapped_pairs(raw.train, tok["train"], tokenizer, windowing, raw.target)
        report["splits"]["train"]["swapped_rows"] = len(tok["train"]) - report["splits"]["train"]["rows"]
    weights = sample_weights(tok["train"], raw.label_names, cfg.train.class_weights)
    if soft_targets is not None:
        tok["train"], weights = with_teacher(tok["train"], weights, raw, unlabeled, soft_targets, tokenizer, windowing)
        report["splits"]["train"]["unlabeled_rows"] = len(unlabeled) if unlabeled is not None else 0
    if weights is not None:
        tok["train"] = tok["train"].add_column("weight", weights)
    sha = {split: file_sha256(p) for split, p in raw.files.items()}
    held_out = {n: ds for n, ds in (("validation", raw.validation), ("test", raw.test)) if ds is not None}
    return Data(
        tok["train"],
        tok.get("validation"),
        tok.get("test"),
        raw.label_names,
        report,
        raw.files,
        sha,
        raw.problem_type,
        texts={n: ds["text"][:] for n, ds in held_out.items()},
        pairs={n: ds["text_pair"][:] for n, ds in held_out.items() if "text_pair" in ds.column_names},
    )


# ----------------------------------------------------------------------------------------------
# Batching.


def build_train_loader(
    ds: datasets.Dataset,
    tokenizer: Any,
    cfg: Config,
    micro_batch_size: int,
    accumulation: int,
    num_processes: int,
    attention_cost: float = 0.0,
) -> tuple[DataLoader, WindowedBatchSampler]:
    """The training DataLoader over global micro-batches, and its sampler (for set_epoch).

    With `data.packing` each process packs its share of a micro-batch into rows
    (`PackingCollator`; `attention_cost` from `finetune.data.packing.attention_cost`).
    """
    sampler = WindowedBatchSampler(
        ds["length"][:],
        batch_size=micro_batch_size * num_processes,
        accumulation=accumulation,
        seed=cfg.run.seed,
        group_by_length=cfg.data.group_by_length,
        pad_to_multiple=num_processes,
        weights=ds["weight"][:] if "weight" in ds.column_names else None,
    )
    # its own generator: a DataLoader without one draws its base seed from the global torch RNG at
    # every iterator creation, which shifts dropout masks after a mid-epoch resume (exact resume)
    collate = (
        PackingCollator(tokenizer, cfg.data.max_length, attention_cost) if cfg.data.packing else Collator(tokenizer)
    )
    loader = DataLoader(
        WindowedDataset(ds),
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        generator=torch.Generator().manual_seed(cfg.run.seed),
    )
    return loader, sampler


def build_eval_loader(ds: datasets.Dataset, tokenizer: Any, batch_size: int, num_workers: int = 0) -> DataLoader:
    """An evaluation DataLoader in length order (least padding; order does not change metrics)."""
    lengths = ds["length"][:]
    order = sorted(range(len(ds)), key=lambda i: lengths[i])
    # own generator: evaluating must not consume the global RNG (it would change later dropout masks)
    return DataLoader(
        WindowedDataset(ds.select(order)),
        batch_size=batch_size,
        shuffle=False,
        collate_fn=Collator(tokenizer),
        num_workers=num_workers,
        generator=torch.Generator(),
    )
