"""Prediction with an exported model: texts in, one prediction per text out, in input order.

`finetune predict` streams: the input (.txt, .csv/.tsv, .jsonl, .parquet; a .json list is read whole), parsed
as the run parsed its data files of that format (`input_options`, `finetune.data.reading.iter_rows`), is
read in chunks of `--chunk-size` texts, each chunk is sorted by length into batches (less padding), and
its predictions are written as a numbered part file in a hidden directory beside the output as soon as
the chunk is done. At the end the parts are joined into the output (.csv, .jsonl or .parquet), written
under a temporary name and renamed, so an output that exists is complete. A run that stops (a kill, a
crash, an error in row 40,000) leaves its parts: the same command again continues after the last part
(the state file records the input's size and time, the model and the options, and a rerun whose
input or options changed says which and stops).

Output row i is input row i: a row with no text (a blank line, an empty cell, a null; `is_blank`) is not
given to the model but gets an empty row in its place (`empty_row`: label, score and probabilities null),
and blank lines that end a file are no rows (`iter_rows`' `keep_blank`). Before the model loads, an input
that is not text (`check_text`) and an output folder that cannot be written (`check_output`) are refused;
a model.onnx that ONNX Runtime cannot load is refused when it loads, before any output is written.

The model is final/ (PyTorch) or an ONNX export (`finetune export --onnx`, fp32 or int8) run by ONNX
Runtime: both give fp32 logits per text (long texts windowed and aggregated as in training,
`model_logits`) read by the problem type (`predict_texts`). Used by `finetune predict` and `evaluate`.
"""

from __future__ import annotations

import codecs
import csv
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from finetune.config.files import load_config
from finetune.config.tasks import MULTI, REGRESSION, SINGLE
from finetune.core.errors import UserError
from finetune.data.build import Windowing, encode_texts
from finetune.data.reading import EXTENSION_FORMATS, FileOptions, count_rows, iter_rows, load_raw_splits
from finetune.deploy.final import VOCAB_FILES, check_final, load_final, recorded_reading
from finetune.evaluation.metrics import bootstrap_ci, compute_metrics, per_text, predictions
from finetune.model.load import position_limit
from finetune.training.runtime import progress_bar

INPUTS = tuple(EXTENSION_FORMATS)
OUTPUTS = (".jsonl", ".csv", ".parquet")
BACKENDS = ("pytorch", "onnx")
ONNX_FILE = "model.onnx"
_TEXT_BLOCK = 1 << 20  # bytes decoded at a time when an input is checked to be text


# ----------------------------------------------------------------------------------------------
# Texts in.


def input_format(path: Path) -> str:
    """The input's format, by its extension.

    Raises:
        UserError: an extension predict cannot read.
    """
    fmt = EXTENSION_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UserError(f"--input {path}: cannot infer its format from the name; use one of {', '.join(INPUTS)}")
    return fmt


def input_options(path: Path, model: Path) -> FileOptions:
    """How the input is parsed: as the run read its data files (its data.delimiter, quoting, header,
    column_names, encoding, encoding_errors, which final/config.json records) when the input is of a
    format the run read; else as such files usually are: a header, commas (csv) or tabs with quotes as
    text (tsv), UTF-8 with or without a BOM (every input of a final/ from before the record).

    Raises:
        UserError: an extension predict cannot read.
    """
    fmt = input_format(path)
    recorded = recorded_reading(model)
    if recorded is not None and fmt in recorded.get("formats", []):
        return FileOptions.from_keys(recorded)
    return FileOptions.from_keys({"quoting": "none" if fmt == "tsv" else "minimal", "encoding": "utf-8-sig"})


def _chunks(path: Path, chunk_size: int, options: FileOptions) -> Iterator[list[Any]]:
    """The input's rows (`iter_rows`: dicts, or strings for .txt lines and .jsonl/.json strings; blank lines
    kept) in lists of `chunk_size` (the last may be shorter).

    Raises:
        UserError: the input cannot be decoded or parsed.
    """
    rows = iter_rows(path, input_format(path), options, f"--input {path}", keep_blank=True)
    while chunk := list(itertools.islice(rows, chunk_size)):
        yield chunk


@dataclass
class Columns:
    """Where a row's text (and second text of a pair) is; None for rows that are texts themselves."""

    text: str | None
    pair: str | None

    @classmethod
    def of(cls, first: Any, path: Path, text_column: str, pair_column: str | None) -> Columns:
        """The columns for an input whose first row is `first`: `text_column`, and `pair_column` or else a
        `text_pair` column when there is one.

        Raises:
            UserError: --pair-column on an input without columns, or a named column the first row lacks.
        """
        if not isinstance(first, dict):
            if pair_column is not None:
                raise UserError(f"--pair-column {pair_column!r}: --input {path} has no columns (one text per row)")
            return cls(None, None)
        columns = list(first)
        for flag, col in (("--text-column", text_column), ("--pair-column", pair_column)):
            if col is not None and col not in first:
                raise UserError(f"--input {path} has no column {col!r} ({flag}); columns: {columns}")
        return cls(text_column, pair_column or ("text_pair" if "text_pair" in columns else None))

    def texts(self, rows: list[Any], path: Path, start: int) -> tuple[list[str], list[str] | None]:
        """The texts (and pairs) of `rows`, which start at row `start` of the input; "" for a null (a blank
        .jsonl line, a null in a .json or .parquet).

        Raises:
            UserError: a row without a named column.
        """
        if self.text is None:
            return ["" if r is None else str(r) for r in rows], None
        for i, r in enumerate(rows):
            for col in (self.text, self.pair):
                if r is not None and col is not None and (not isinstance(r, dict) or col not in r):
                    raise UserError(f"--input {path}: row {start + i + 1} has no column {col!r}")
        texts = [_cell(r, self.text) for r in rows]
        return texts, [_cell(r, self.pair) for r in rows] if self.pair else None


def _cell(row: dict[str, Any] | None, column: str) -> str:
    return "" if row is None or row[column] is None else str(row[column])


def is_blank(text: str, pair: str | None = None) -> bool:
    """Whether a row has no text for the model: its text (and pair) empty or whitespace only."""
    return not text.strip() and not (pair or "").strip()


def input_columns(job: Job, options: FileOptions, first: list[Any] | None) -> Columns:
    """The columns of `job.input`, whose first chunk is `first`: those of its first row that is not a blank
    line (`Columns.of`), checked on the first chunk before the model loads.

    Raises:
        UserError: an input without a text (no rows, or blank ones only), or `Columns`' refusals.
    """
    if first is None:
        raise UserError(f"--input {job.input} has no texts")

    def later() -> Iterator[list[Any]]:  # read again only where the first chunk does not decide
        return itertools.islice(_chunks(job.input, job.chunk_size, options), 1, None)

    sample = next((r for r in itertools.chain(first, itertools.chain.from_iterable(later())) if r is not None), None)
    if sample is None:
        raise UserError(f"--input {job.input} has no texts")
    columns = Columns.of(sample, job.input, job.text_column, job.pair_column)

    def has_text(index: int, rows: list[Any]) -> bool:
        texts, pairs = columns.texts(rows, job.input, index * job.chunk_size)
        return not all(is_blank(t, p) for t, p in zip(texts, pairs or [None] * len(texts), strict=True))

    if not any(has_text(i, rows) for i, rows in enumerate(itertools.chain([first], later()))):
        raise UserError(f"--input {job.input} has no texts (blank rows only)")
    return columns


def check_input(path: Path) -> None:
    """Raises:
    UserError: the input is missing, not a file, or of a format predict cannot read.
    """
    if not path.is_file():
        raise UserError(f"--input {path} does not exist" if not path.exists() else f"--input {path} is not a file")
    input_format(path)


def check_text(path: Path, options: FileOptions) -> None:
    """Refuse an input of a text format (all but .parquet) that is not text, naming the file and the line,
    before the model loads: a NUL character (a binary file given as .txt or .csv), or bytes its encoding
    (`options`: the run's data.encoding, else UTF-8) cannot decode where its data.encoding_errors is strict.
    One pass over the file's bytes, a block at a time.

    Raises:
        UserError: the input holds a NUL character or bytes its encoding cannot decode.
    """
    if input_format(path) == "parquet":
        return
    try:
        decoder = codecs.getincrementaldecoder(options.encoding)(errors=options.encoding_errors)
    except LookupError:
        raise UserError(f"--input {path}: unknown encoding {options.encoding!r} (the run's data.encoding)") from None
    name = "UTF-8" if codecs.lookup(options.encoding).name.startswith("utf-8") else options.encoding
    line = 1
    with path.open("rb") as f:
        while True:
            block = f.read(_TEXT_BLOCK)
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                at = line + exc.object[: exc.start].decode(options.encoding, errors="replace").count("\n")
                raise UserError(
                    f"cannot read --input {path}: byte 0x{exc.object[exc.start]:02x} on line {at} is not {name} "
                    f"text; save the texts as {name} (e.g. iconv -f latin1 -t utf-8), or a binary file's texts "
                    "as a .txt (one per line) or .csv"
                ) from None
            if "\x00" in text:
                at = line + text[: text.index("\x00")].count("\n")
                raise UserError(
                    f"cannot read --input {path}: a NUL byte on line {at}, so not text (a binary file?); give "
                    f"the texts as a {name} .txt (one per line) or .csv/.tsv (a column)"
                )
            line += text.count("\n")
            if not block:
                return


# ----------------------------------------------------------------------------------------------
# The model: final/ with PyTorch, or an ONNX export with ONNX Runtime.


class OnnxClassifier:
    """An ONNX export run by ONNX Runtime behind the little of a transformers model that prediction uses:
    `config` (the export's config.json, final/'s) and `model(**batch).logits` (a torch tensor)."""

    def __init__(self, directory: Path, threads: int | None = None) -> None:
        """Load `directory`'s model.onnx and config.json.

        Raises:
            UserError: ONNX Runtime cannot load model.onnx (damaged, truncated, its external weights gone, an
                operator it lacks), or transformers cannot read config.json.
        """
        import onnxruntime
        from onnxruntime.capi import onnxruntime_pybind11_state as ort
        from transformers import AutoConfig

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()  # the same threads as PyTorch's
        # idle threads that spin steal the CPU from the tokenizer and from other jobs on a shared machine
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = onnxruntime.InferenceSession(
                str(directory / ONNX_FILE), options, providers=["CPUExecutionProvider"]
            )
        except (
            ort.InvalidProtobuf,
            ort.InvalidGraph,
            ort.InvalidArgument,
            ort.NoSuchFile,
            ort.Fail,
            ort.NotImplemented,
        ) as exc:
            why = str(exc).split("failed:", 1)[-1].strip().splitlines()[0][:200]  # after its "Load model from"
            raise UserError(
                f"ONNX Runtime cannot load {directory / ONNX_FILE} ({why}): it is damaged or incomplete; "
                "export it again with finetune export --onnx"
            ) from None
        self.inputs = [i.name for i in self.session.get_inputs()]
        try:
            self.config = AutoConfig.from_pretrained(directory)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"cannot read {directory / 'config.json'}: {first}; export it again") from None

    def __call__(self, **batch: torch.Tensor) -> Any:
        feed = {k: batch[k].numpy().astype(np.int64) for k in self.inputs}
        return SimpleNamespace(logits=torch.from_numpy(self.session.run(["logits"], feed)[0]))


def check_model(directory: Path, backend: str = "pytorch") -> None:
    """Refuse, before anything loads, a directory that is not of the backend's kind or lacks its files.

    Raises:
        UserError: an unknown backend, an ONNX export given to PyTorch or final/ to ONNX Runtime, missing or
            corrupt files (final/: `check_final`), no tokenizer or config.json, an unreadable model.onnx,
            onnxruntime not installed.
    """
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    has_onnx = (directory / ONNX_FILE).is_file()
    if backend == "pytorch":
        if has_onnx and not (directory / "model.safetensors").is_file():
            raise UserError(f"{directory} is an ONNX export: predict with --backend onnx, or give a run's final/")
        check_final(directory)
        return
    if not has_onnx:
        hint = " (a run's final/: use --backend pytorch, or export it with finetune export --onnx)"
        raise UserError(f"{directory} has no {ONNX_FILE}{hint if directory.is_dir() else ''}")
    if not (directory / "tokenizer_config.json").is_file() or not any((directory / v).is_file() for v in VOCAB_FILES):
        raise UserError(f"{directory} has no tokenizer (tokenizer_config.json and its vocabulary): export it again")
    if not (directory / "config.json").is_file():
        raise UserError(f"{directory / 'config.json'} is missing: export it again with finetune export --onnx")
    try:
        with (directory / ONNX_FILE).open("rb"):
            pass
    except OSError as exc:
        raise UserError(f"cannot read {directory / ONNX_FILE}: {exc.strerror}") from None
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        raise UserError("--backend onnx needs onnxruntime: pip install onnxruntime") from None


def load_model(directory: Path, backend: str = "pytorch") -> tuple[Any, Any]:
    """The tokenizer and model of `directory`: final/ for PyTorch, an ONNX export for ONNX Runtime.

    Raises:
        UserError: `check_model`'s refusals, transformers cannot load the directory, or ONNX Runtime its
            model.onnx.
    """
    check_model(directory, backend)
    if backend == "pytorch":
        return load_final(directory)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load the tokenizer of {directory}: {first}; export it again") from None
    return tokenizer, OnnxClassifier(directory)


# ----------------------------------------------------------------------------------------------
# Logits and predictions.


def model_logits(
    tokenizer: Any,
    model: Any,
    texts: list[str],
    pairs: list[str] | None = None,
    batch_size: int = 64,
    max_length: int | None = None,
    on_texts: Callable[[int], None] | None = None,
) -> Any:
    """The model's fp32 logits for each text (with its `pairs` entry), in input order (a numpy array).
    Rows are sorted by length into batches (less padding). `on_texts(n)` is told after each batch how many
    more texts have all their rows done (a progress bar); without it, a bar over the batches.

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
    left = np.bincount(enc["doc"], minlength=len(texts))  # rows of each text not yet done
    bar = on_texts is None and len(starts) > 1
    with torch.no_grad():
        for s in progress_bar(starts, desc="predict", unit="batch", disable=not bar, leave=False):
            idx = order[s : s + batch_size]
            batch = tokenizer.pad([{k: enc[k][i] for k in keys} for i in idx], return_tensors="pt")
            out[idx] = model(**batch).logits.float()
            if on_texts is not None:
                docs = np.asarray(enc["doc"])[idx]
                np.subtract.at(left, docs, 1)
                on_texts(int((left[np.unique(docs)] == 0).sum()))
    docs = torch.tensor(enc["doc"])
    logits, _, _ = per_text(out, docs, docs, getattr(c, "chunk_aggregate", "mean"))
    return logits.numpy()


# What a model's config (final/config.json, or an ONNX export's copy of it) says about reading its logits.


def label_names(config: Any) -> list[str]:
    """The model's label names in id order."""
    return [config.id2label[i] for i in range(config.num_labels)]


def problem_type(config: Any) -> str:
    """The model's problem type (single-label when the config names none, as transformers reads it)."""
    return getattr(config, "problem_type", None) or SINGLE


def label_thresholds(config: Any) -> list[float]:
    """The multi-label decision thresholds in label id order: final/config.json's `label_thresholds`, 0.5 for a
    label without one (every label of other problem types)."""
    given = getattr(config, "label_thresholds", None) or {}
    return [given.get(name, 0.5) for name in label_names(config)]


def predict_texts(
    tokenizer: Any,
    model: Any,
    texts: list[str],
    batch_size: int = 64,
    max_length: int | None = None,
    pairs: list[str] | None = None,
    on_texts: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """One prediction per text, in input order, as the model's problem type reads its logits (`predictions`):
    single-label: `label`, `score` and softmax `probabilities`; multi-label: `labels` (the labels at or
    above their thresholds from final/config.json's `label_thresholds`, else 0.5) and sigmoid
    `probabilities`; regression: `score`."""
    logits = model_logits(tokenizer, model, texts, pairs, batch_size, max_length, on_texts)
    names, kind = label_names(model.config), problem_type(model.config)
    probs, predicted = predictions(logits, kind, label_thresholds(model.config))
    out = []
    for i in range(len(logits)):
        p: dict[str, Any] = {"text": texts[i], **({"text_pair": pairs[i]} if pairs is not None else {})}
        if probs is None:  # regression
            p["score"] = float(predicted[i])
        elif kind == MULTI:
            p["labels"] = [n for n, on in zip(names, predicted[i].tolist(), strict=True) if on]
        else:
            p.update(label=names[int(predicted[i])], score=float(probs[i, predicted[i]]))
        if probs is not None:
            p["probabilities"] = dict(zip(names, probs[i].tolist(), strict=True))
        out.append(p)
    return out


def empty_row(config: Any, text: str, pair: str | None = None) -> dict[str, Any]:
    """The output row of a row with no text (`is_blank`): its text (and pair) as read, and what the problem
    type predicts (`output_columns`) and the probabilities null."""
    head, names = output_columns(config, pair is not None)
    row = dict.fromkeys(head) | {"text": text, **({"text_pair": pair} if pair is not None else {})}
    return row | ({"probabilities": None} if names else {})


def predict_rows(
    tokenizer: Any,
    model: Any,
    texts: list[str],
    pairs: list[str] | None = None,
    batch_size: int = 64,
    on_texts: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """One output row per input row, in input order: `predict_texts` for the rows with a text, `empty_row` for
    those without (`is_blank`: a model reads nothing there, and a label for it would be noise counted as a
    prediction). `on_texts` is also told of the empty rows."""
    keep = [i for i, t in enumerate(texts) if not is_blank(t, pairs[i] if pairs is not None else None)]
    kept_pairs = [pairs[i] for i in keep] if pairs is not None else None
    rows = [empty_row(model.config, t, pairs[i] if pairs is not None else None) for i, t in enumerate(texts)]
    if keep:
        preds = predict_texts(
            tokenizer, model, [texts[i] for i in keep], batch_size, pairs=kept_pairs, on_texts=on_texts
        )
        for i, p in zip(keep, preds, strict=True):
            rows[i] = p
    if on_texts is not None and len(keep) < len(texts):
        on_texts(len(texts) - len(keep))
    return rows


def evaluate_final(directory: Path, config_file: str | Path, overrides: list[str]) -> dict[str, Any]:
    """`finetune evaluate`: the metrics, with bootstrap intervals, of final/ `directory` on the validation and test
    data of a config (`overrides` applied), its texts cut where the config's `data.max_length` says and multi-label
    decisions at final/'s thresholds; `{split: metrics}`.

    Raises:
        UserError: a bad config, final/ or data; the model's labels or problem type differ from the config's; the
            config has no validation or test data.
    """
    cfg = load_config(config_file, overrides)
    tokenizer, model = load_final(Path(directory))
    raw = load_raw_splits(cfg)
    names, kind, thresholds = label_names(model.config), problem_type(model.config), label_thresholds(model.config)
    if names != raw.label_names:
        raise UserError(f"the model's labels {names} differ from the data's {raw.label_names}")
    if kind != cfg.model.problem_type:
        raise UserError(f"the model is a {kind} model, the config says model.problem_type={cfg.model.problem_type}")
    result: dict[str, Any] = {}
    for split, ds in (("validation", raw.validation), ("test", raw.test)):
        if ds is None:
            continue
        pairs = ds["text_pair"][:] if "text_pair" in ds.column_names else None  # data.text_pair_column
        logits = model_logits(tokenizer, model, ds["text"][:], pairs, max_length=cfg.data.max_length)
        y_true = np.asarray(raw.targets(ds))
        result[split] = compute_metrics(kind, y_true, logits, names, thresholds) | bootstrap_ci(
            kind, y_true, logits, len(names), thresholds, cfg.train.bootstrap_resamples, cfg.run.seed
        )
    if not result:
        raise UserError(f"{config_file} has no validation or test data to evaluate on")
    return result


# ----------------------------------------------------------------------------------------------
# Predictions out.


def output_columns(config: Any, pairs: bool) -> tuple[list[str], list[str]]:
    """The output's columns for a model's `config`, with or without pairs: the text (and pair) and what the
    problem type predicts (label and score / labels / score), then the labels whose probabilities follow
    (none for regression)."""
    kind = problem_type(config)
    outputs = {REGRESSION: ["score"], MULTI: ["labels"]}.get(kind, ["label", "score"])
    names = [] if kind == REGRESSION else label_names(config)
    return ["text", *(["text_pair"] if pairs else []), *outputs], names


def csv_rows(preds: list[dict[str, Any]], columns: tuple[list[str], list[str]]) -> Iterator[list[Any]]:
    """.csv cells in `output_columns` order: text (pair), label / labels (joined by |) / score, then
    prob_<label> per label; an empty row's cells after its text are empty."""
    head, names = columns
    for p in preds:
        cells = [
            "" if p[k] is None else "|".join(p[k]) if k == "labels" else f"{p[k]:.6f}" if k == "score" else p[k]
            for k in head
        ]
        probs = p.get("probabilities") or {}
        yield [*cells, *[f"{probs[n]:.6f}" if n in probs else "" for n in names]]


def csv_header(config: Any, pairs: bool) -> list[str]:
    """The .csv output's header for a model's `config` (its problem type and labels), with or without pairs."""
    head, names = output_columns(config, pairs)
    return [*head, *[f"prob_{n}" for n in names]]


def write_part(path: Path, preds: list[dict[str, Any]], columns: tuple[list[str], list[str]]) -> None:
    """One chunk's predictions in the output's format (.csv without its header) and `output_columns`, written
    under a temporary name and renamed: a part that exists is complete."""
    tmp = path.with_name(path.name + ".tmp")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        tmp.write_text("".join(json.dumps(p) + "\n" for p in preds), encoding="utf-8")
    elif suffix == ".csv":
        with tmp.open("w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(csv_rows(preds, columns))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        head, names = columns
        types = {"labels": pa.list_(pa.string()), "score": pa.float64()}  # the rest: strings
        schema = pa.schema(
            [(k, types.get(k, pa.string())) for k in head] + [(f"prob_{n}", pa.float64()) for n in names]
        )
        table = {k: [p[k] for p in preds] for k in head} | {
            f"prob_{n}": [(p.get("probabilities") or {}).get(n) for p in preds] for n in names
        }
        pq.write_table(pa.table(table, schema=schema), tmp)
    tmp.replace(path)


def join_parts(parts: Path, out: Path, header: list[str] | None) -> None:
    """The part files of `parts` in order, joined into `out` (a temporary name, then renamed)."""
    files = sorted(parts.glob(f"part-*{out.suffix.lower()}"))
    tmp = out.with_name(f".{out.name}.tmp")
    if out.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        writer = None
        for f in files:
            table = pq.read_table(f)
            writer = writer or pq.ParquetWriter(tmp, table.schema)
            writer.write_table(table)
        if writer is not None:
            writer.close()
    else:
        with tmp.open("wb") as dst:
            if out.suffix.lower() == ".csv" and header is not None:
                dst.write(_csv_line(header).encode("utf-8"))
            for f in files:
                with f.open("rb") as src:
                    shutil.copyfileobj(src, dst)
    tmp.replace(out)


def _csv_line(cells: list[str]) -> str:
    import io

    buf = io.StringIO()
    csv.writer(buf).writerow(cells)
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------
# Streaming, resumable prediction (`finetune predict`).


@dataclass
class Job:
    """What a `finetune predict` run is: a rerun continues a stopped one only when all of it is the same."""

    input: Path
    output: Path
    model: Path
    backend: str
    text_column: str
    pair_column: str | None
    chunk_size: int

    def state(self) -> dict[str, Any]:
        stat = self.input.stat()
        return {
            "input": str(self.input.resolve()),
            "input_size": stat.st_size,
            "input_mtime_ns": stat.st_mtime_ns,
            "model": str(self.model.resolve()),
            "backend": self.backend,
            "text_column": self.text_column,
            "pair_column": self.pair_column,
            "chunk_size": self.chunk_size,
            # parts written when blank lines were no rows hold other rows than their numbers say
            "blank_rows": "kept",
        }

    @property
    def parts(self) -> Path:
        return self.output.with_name(f".{self.output.name}.parts")


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse, before the model loads, an output predict cannot write: else an OSError traceback would come
    once the first chunk's predictions are ready.

    Raises:
        UserError: an output format predict cannot write, an output that exists without --overwrite, or an
            output whose folder cannot be made (a file is in the way) or written in.
    """
    if out.suffix.lower() not in OUTPUTS:
        raise UserError(f"--output {out}: cannot infer its format from the name; use one of {', '.join(OUTPUTS)}")
    if out.exists() and not overwrite:
        raise UserError(f"--output {out} exists: pass --overwrite to replace it")
    if out.is_dir():
        raise UserError(f"--output {out} is a directory")
    folder = out.absolute().parent
    while not os.path.exists(folder) and folder != folder.parent:  # the nearest folder there, to make the rest in
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"--output {out}: {folder} is not a folder; choose an output path in a folder")
    try:  # a folder made and removed: permission bits say nothing to root, nor of a read-only or virtual file system
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.", dir=folder))
    except OSError as exc:
        raise UserError(
            f"--output {out}: cannot write in {folder} ({exc.strerror}); choose a folder you can write to"
        ) from None


def parts_done(job: Job, overwrite: bool) -> int:
    """How many chunks an earlier, stopped run of `job` finished (0 for a fresh start); writes the state file.

    Raises:
        UserError: an earlier run's parts are there but it was another job (named), without --overwrite.
    """
    state_file = job.parts / "state.json"
    if overwrite:
        shutil.rmtree(job.parts, ignore_errors=True)
    if state_file.is_file():
        try:
            before = json.loads(state_file.read_text())
        except json.JSONDecodeError:
            before = {}
        changed = [k for k, v in job.state().items() if before.get(k) != v]
        if changed:
            raise UserError(
                f"cannot continue the stopped run into {job.output}: its {', '.join(changed)} changed since "
                f"({job.parts} holds its parts); pass --overwrite to start again"
            )
        done = 0
        suffix = job.output.suffix.lower()
        while (job.parts / f"part-{done:06d}{suffix}").is_file():
            done += 1
        return done
    shutil.rmtree(job.parts, ignore_errors=True)
    job.parts.mkdir(parents=True)
    state_file.write_text(json.dumps(job.state(), indent=2))
    return 0


_WORKER: dict[str, Any] = {}


def _worker_start(directory: Path, backend: str, threads: int) -> None:
    """A `--workers` process: its share of the threads, and the model loaded once."""
    torch.set_num_threads(threads)
    _WORKER["model"] = load_model(directory, backend)


def _worker_predict(texts: list[str], pairs: list[str] | None, batch_size: int) -> list[dict[str, Any]]:
    tokenizer, model = _WORKER["model"]
    return predict_rows(tokenizer, model, texts, pairs, batch_size, on_texts=lambda n: None)


def predicted_chunks(
    job: Job,
    todo: Iterator[tuple[int, list[str], list[str] | None]],
    batch_size: int,
    workers: int,
    bar: Any,
    loaded: tuple[Any, Any] | None,
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """Each chunk's rows (`predict_rows`), in input order: in this process with the `loaded` tokenizer and
    model, or with `workers` processes (each loads the model and takes its share of the threads; chunks go
    out in turn and come back in order, at most two per worker in flight)."""
    if workers == 1:
        tokenizer, model = loaded or load_model(job.model, job.backend)
        for index, texts, pairs in todo:
            yield index, predict_rows(tokenizer, model, texts, pairs, batch_size, on_texts=bar.update)
        return
    import multiprocessing
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    threads = max(1, torch.get_num_threads() // workers)
    spawn = multiprocessing.get_context("spawn")  # a fork would copy this process's thread pools
    with ProcessPoolExecutor(workers, spawn, _worker_start, (job.model, job.backend, threads)) as pool:
        pending: deque[tuple[int, Any]] = deque()
        for index, texts, pairs in todo:
            pending.append((index, pool.submit(_worker_predict, texts, pairs, batch_size)))
            while len(pending) >= 2 * workers or (pending and pending[0][1].done()):
                done_index, future = pending.popleft()
                preds = future.result()
                bar.update(len(preds))
                yield done_index, preds
        while pending:
            done_index, future = pending.popleft()
            preds = future.result()
            bar.update(len(preds))
            yield done_index, preds


def run_predict(job: Job, batch_size: int = 64, overwrite: bool = False, workers: int = 1) -> int:
    """`finetune predict`: stream `job.input` through the model into `job.output`; returns the texts written.

    Raises:
        UserError: bad input, output or model (before anything is written), or a bad row in the input.
    """
    check_input(job.input)
    check_output(job.output, overwrite)
    options = input_options(job.input, job.model)
    check_text(job.input, options)
    chunks = _chunks(job.input, job.chunk_size, options)
    first = next(chunks, None)
    columns = input_columns(job, options, first)
    total = count_rows(job.input, input_format(job.input), options, f"--input {job.input}", keep_blank=True)
    # loaded before anything is written, a damaged model is one line; with --workers each loads its own
    loaded: tuple[Any, Any] | None = load_model(job.model, job.backend)
    out_columns = output_columns(loaded[1].config, columns.pair is not None)
    header = csv_header(loaded[1].config, columns.pair is not None)
    if workers > 1:
        loaded = None
    try:
        job.output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--output {job.output}: cannot make {job.output.parent} ({exc.strerror})") from None
    done = parts_done(job, overwrite)
    if done:
        print(f"continuing {job.output}: {done} chunk(s) of {job.chunk_size} texts already done", file=sys.stderr)
    todo = (
        (i, *columns.texts(rows, job.input, i * job.chunk_size))
        for i, rows in enumerate(itertools.chain([first], chunks))
        if i >= done
    )
    started, n, new = time.perf_counter(), min(done * job.chunk_size, total), 0
    with progress_bar(total=total, initial=n, desc="predict", unit="text", dynamic_ncols=True) as bar:
        for index, preds in predicted_chunks(job, todo, batch_size, workers, bar, loaded):
            write_part(job.parts / f"part-{index:06d}{job.output.suffix.lower()}", preds, out_columns)
            n, new = n + len(preds), new + len(preds)
    join_parts(job.parts, job.output, header)
    shutil.rmtree(job.parts)
    seconds = time.perf_counter() - started
    print(f"wrote {n} predictions to {job.output} ({new / max(seconds, 1e-9):.0f} texts/s)", file=sys.stderr)
    return n
