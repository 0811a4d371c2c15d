"""Prediction with an exported final/: texts in (.txt, .csv/.tsv, .jsonl/.json), the model's fp32
logits per text (long texts windowed and aggregated as in training), one prediction per text as the
problem type reads its logits, and predictions out (.jsonl or .csv). Used by `finetune predict` and
`finetune evaluate`."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.data import Windowing, encode_texts
from finetune.errors import UserError
from finetune.metrics import per_text
from finetune.model import position_limit
from finetune.runtime import progress_bar


def _records(path: Path) -> list[Any]:
    """Rows of a .csv/.tsv (dicts), .jsonl/.json (dicts or strings) or .txt (strings) input."""
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        # a BOM (Excel exports) is not part of the first column's name; a TSV's quotes are text
        with path.open(newline="", encoding="utf-8-sig") as f:
            if suffix == ".tsv":
                return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
            return list(csv.DictReader(f))
    if suffix == ".jsonl":
        return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    if suffix == ".json":
        records = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(records, list):  # a .json object would give its keys as texts
            raise UserError(f"--input {path}: a .json input must be a list of texts or of records")
        return records
    return [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def read_texts(path: Path, text_column: str, pair_column: str | None = None) -> tuple[list[str], list[str] | None]:
    """Texts (and second texts of pairs) from .txt (one per line), .csv/.tsv (a header with
    `text_column`) or .jsonl/.json. Pairs come from `pair_column`, else from a `text_pair` column
    or key when the input has one.

    Raises:
        UserError: the file is missing, unreadable, empty, or lacks a named column in some row.
    """
    if not path.is_file():
        raise UserError(f"--input {path} does not exist")
    try:
        records = _records(path)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read --input {path}: {type(exc).__name__}: {exc}") from None
    if not records:
        raise UserError(f"--input {path} has no texts")
    if not isinstance(records[0], dict):
        if pair_column is not None:
            raise UserError(f"--pair-column {pair_column!r}: --input {path} has no columns (one text per row)")
        return [str(r) for r in records], None
    columns = list(records[0])
    pair_column = pair_column or ("text_pair" if "text_pair" in columns else None)
    for flag, col in (("--text-column", text_column), ("--pair-column", pair_column)):
        if col is not None and any(not isinstance(r, dict) or col not in r for r in records):
            raise UserError(f"--input {path} has no column {col!r} ({flag}) in every row; columns: {columns}")
    texts = [str(r[text_column]) for r in records]
    return texts, [str(r[pair_column]) for r in records] if pair_column else None


def model_logits(
    tokenizer: Any,
    model: Any,
    texts: list[str],
    pairs: list[str] | None = None,
    batch_size: int = 64,
    max_length: int | None = None,
) -> Any:
    """The model's fp32 logits for each text (with its `pairs` entry), in input order (a numpy array).

    Texts are cut at `max_length` tokens, by default the tokenizer's `model_max_length`: a final/
    carries the run's `data.max_length` there, so prediction truncates where training did.
    """
    if max_length is None:  # tokenizers without a limit report a huge sentinel
        max_length = tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else 512
    # never past the model's positions (a from-scratch model may have fewer than 512; RoBERTa's table has 2 more)
    max_length = min(max_length, position_limit(model.config) or max_length)
    c = model.config  # the run's windowing of long texts, as final/config.json records it
    w = Windowing(
        max_length, getattr(c, "truncation", None), getattr(c, "head_fraction", 0.25), getattr(c, "chunk_stride", None)
    )
    enc = encode_texts(tokenizer, texts, pairs, w, measure=False)
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    order = sorted(range(len(enc["input_ids"])), key=lambda i: enc["length"][i])  # similar lengths: less padding
    out = torch.zeros(len(order), c.num_labels)
    starts = range(0, len(order), batch_size)
    with torch.no_grad():
        for s in progress_bar(starts, desc="predict", unit="batch", disable=len(starts) < 2, leave=False):
            idx = order[s : s + batch_size]
            batch = tokenizer.pad([{k: enc[k][i] for k in keys} for i in idx], return_tensors="pt")
            out[idx] = model(**batch).logits.float()
    docs = torch.tensor(enc["doc"])
    logits, _, _ = per_text(out, docs, docs, getattr(c, "chunk_aggregate", "mean"))
    return logits.numpy()


def predict_texts(
    tokenizer: Any,
    model: Any,
    texts: list[str],
    batch_size: int = 64,
    max_length: int | None = None,
    pairs: list[str] | None = None,
) -> list[dict[str, Any]]:
    """One prediction per text, in input order, as the model's problem type reads its logits:
    single-label: `label`, `score` and softmax `probabilities`; multi-label: `labels` (the labels at or
    above their thresholds from final/config.json's `label_thresholds`, else 0.5) and sigmoid
    `probabilities`; regression: `score`."""
    logits = model_logits(tokenizer, model, texts, pairs, batch_size, max_length)
    names = [model.config.id2label[i] for i in range(model.config.num_labels)]
    kind = getattr(model.config, "problem_type", None) or "single_label_classification"
    out = []
    for i, row in enumerate(logits):
        p: dict[str, Any] = {"text": texts[i], **({"text_pair": pairs[i]} if pairs is not None else {})}
        if kind == "regression":
            p["score"] = float(row[0])
        elif kind == "multi_label_classification":
            probs = 1.0 / (1.0 + np.exp(-row.astype(np.float64)))
            thresholds = getattr(model.config, "label_thresholds", None) or {}
            p["labels"] = [n for n, q in zip(names, probs, strict=True) if q >= thresholds.get(n, 0.5)]
            p["probabilities"] = {n: float(q) for n, q in zip(names, probs, strict=True)}
        else:
            probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            best = int(probs.argmax())
            p.update(
                label=names[best],
                score=float(probs[best]),
                probabilities={n: float(q) for n, q in zip(names, probs, strict=True)},
            )
        out.append(p)
    return out


def write_predictions(out: Path, preds: list[dict[str, Any]]) -> None:
    """.jsonl: one object per text; .csv: text (pair), label / labels (joined by |) / score, prob_<label>."""
    if out.suffix.lower() == ".jsonl":
        out.write_text("".join(json.dumps(p) + "\n" for p in preds))
        return
    first = preds[0]
    head = [k for k in ("text", "text_pair", "label", "labels", "score") if k in first]
    names = list(first.get("probabilities", {}))
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*head, *[f"prob_{n}" for n in names]])
        for p in preds:
            cells = ["|".join(p[k]) if k == "labels" else (f"{p[k]:.6f}" if k == "score" else p[k]) for k in head]
            w.writerow([*cells, *[f"{p['probabilities'][n]:.6f}" for n in names]])
