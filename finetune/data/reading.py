"""Reading a dataset: local files (csv, tsv, json, jsonl, parquet, text; a folder per label; a text
file per label) or a hub dataset -> raw splits with mapped labels (`RawSplits`, `load_raw_splits`).

Every dataset goes through the same general options (delimiter, quoting, header, encoding, column
names, label map, line regex, seeded grouped validation split); there is no dataset-specific code path.
Tokenizing and batching are `finetune.data.build`.

How a file of each format is opened and parsed lives here alone (`FileOptions`, `csv_options`, `iter_rows`,
`count_rows`): training reads whole files through `datasets`, `finetune predict` streams its input and
`finetune init` samples a file through the same options and parsers, so a file reads alike in all three.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import logging
import math
import random
import re
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub
import pandas as pd

from finetune.config.schema import Config, DataConfig
from finetune.config.tasks import MULTI, REGRESSION, SINGLE
from finetune.core.errors import UserError

logger = logging.getLogger("finetune")
datasets.logging.set_verbosity_error()
huggingface_hub.utils.logging.set_verbosity_error()  # offline: no retry warnings, one UserError line
datasets.disable_progress_bars()  # loading is quick; the training bar is the one to watch

# a file's format by its extension (data.format=auto; `finetune predict`'s input always)
EXTENSION_FORMATS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".json": "json",
    ".jsonl": "jsonl",
    ".parquet": "parquet",
    ".txt": "text",
}


@dataclass
class RawSplits:
    """Text splits with columns `text`, optional `text_pair`, `label`: the raw label as str (single-label),
    a list of raw labels as str (multi-label) or a float (regression)."""

    train: datasets.Dataset
    validation: datasets.Dataset | None
    test: datasets.Dataset | None
    label_names: list[str]
    raw_to_name: dict[str, str]
    files: dict[str, Path] = field(default_factory=dict)
    problem_type: str = SINGLE
    excluded: int = 0  # training rows left out by data.exclude_rows

    @property
    def target(self) -> LabelTarget:
        """Raw label -> what the model is trained on."""
        return LabelTarget(self.problem_type, tuple(self.label_names), tuple(sorted(self.raw_to_name.items())))

    def targets(self, ds: datasets.Dataset) -> list[Any]:
        """The target of every row of a split."""
        target = self.target
        return [target(v) for v in ds["label"][:]]


@dataclass(frozen=True)
class LabelTarget:
    """A raw label -> a label id, a multi-hot float list, or the float itself. Small and picklable:
    `datasets.map` fingerprints it for its cache."""

    problem_type: str
    label_names: tuple[str, ...]
    raw_to_name: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:  # built once, not per row (a frozen dataclass sets it through object)
        index = {raw_value: self.label_names.index(name) for raw_value, name in self.raw_to_name}
        object.__setattr__(self, "_index", index)

    def __call__(self, raw: Any) -> Any:
        if self.problem_type == REGRESSION:
            return float(raw)
        index = self._index  # type: ignore[attr-defined]
        if self.problem_type == MULTI:
            hot = [0.0] * len(self.label_names)
            for v in raw:
                hot[index[v]] = 1.0
            return hot
        return index[raw]


# ----------------------------------------------------------------------------------------------
# Reading files.

# the data keys that say how a file is parsed once its format is known
READING_KEYS = ("delimiter", "quoting", "header", "column_names", "encoding", "encoding_errors")
_ROWS_PER_READ = 4096  # rows parsed at a time when a file is streamed


@dataclass(frozen=True)
class FileOptions:
    """How a data file of a known format is parsed: `data.delimiter`, `quoting`, `header`, `column_names`,
    `encoding` and `encoding_errors`. Training reads with its config's (`of`), `finetune predict` with those
    final/ records of the run, `finetune init` with those it sniffed (`from_keys`)."""

    delimiter: str | None
    quoting: str
    header: bool
    column_names: tuple[str, ...] | None
    encoding: str
    encoding_errors: str

    @classmethod
    def from_keys(cls, keys: Mapping[str, Any]) -> FileOptions:
        """From data.* keys (others are ignored); a key not there takes the schema's default."""
        values = {k: keys[k] if k in keys else DataConfig.model_fields[k].default for k in READING_KEYS}
        names = values.pop("column_names")
        return cls(**values, column_names=tuple(names) if names is not None else None)

    @classmethod
    def of(cls, d: DataConfig) -> FileOptions:
        """A config's data section's."""
        return cls.from_keys(d.model_dump(include=set(READING_KEYS)))

    def as_keys(self) -> dict[str, Any]:
        """The data.* keys, JSON-ready, as `from_keys` reads them back."""
        names = list(self.column_names) if self.column_names is not None else None
        return {k: getattr(self, k) for k in READING_KEYS} | {"column_names": names}


def data_formats(cfg: Config) -> list[str]:
    """The formats the run's data files are read as, where its `FileOptions` apply: text for data.label_files
    (one text per line, decoded with data.encoding), none for a hub dataset or saved datasets."""
    d = cfg.data
    if d.hub_dataset is not None:
        return []
    formats = {"text"} if d.label_files is not None else set()
    for name in (d.train_file, d.validation_file, d.test_file):
        path = cfg.resolved_path(name)
        if path is not None and path.is_file():
            with contextlib.suppress(UserError):  # a file of no known format: training refused it already
                formats.add(_file_format(cfg, path))
    return sorted(formats)


def csv_options(fmt: str, opts: FileOptions) -> dict[str, Any]:
    """`pandas.read_csv` keywords for a csv/tsv file. Training hands them to `datasets` (whose csv reader is
    pandas), prediction and init to pandas itself: fields, quotes and missing cells read alike in all three."""
    kwargs: dict[str, Any] = dict(
        sep=opts.delimiter or ("\t" if fmt == "tsv" else ","),
        quoting=csv.QUOTE_NONE if opts.quoting == "none" else csv.QUOTE_MINIMAL,
        header=0 if opts.header else None,
        encoding=opts.encoding,
        encoding_errors=opts.encoding_errors,
        # "NA", "null" and friends are text in a sentence, not missing values
        keep_default_na=False,
        na_values=[""],
    )
    if opts.column_names is not None:
        kwargs["names"] = list(opts.column_names)
    return kwargs


@contextlib.contextmanager
def _parse_errors(what: str) -> Iterator[None]:
    """A decoding or parsing error (pandas', pyarrow's, json's, the codecs') as one line naming `what`."""
    try:
        yield
    except (ValueError, LookupError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(f"cannot read {what}: {type(exc).__name__}: {first}") from None


def _frames(
    source: Path | io.StringIO, fmt: str, opts: FileOptions, nrows: int | None = None, keep_blank: bool = False
) -> Iterator[Any]:
    """A csv/tsv file's rows in DataFrames of `_ROWS_PER_READ`, every cell as text: per chunk, a column of
    numbers would otherwise turn "007" into 7 in one chunk and not in the next. A blank line is no row, or
    with `keep_blank` a row of missing cells."""
    kwargs = csv_options(fmt, opts) | {"skip_blank_lines": not keep_blank}
    try:
        reader = pd.read_csv(source, chunksize=_ROWS_PER_READ, nrows=nrows, dtype=str, **kwargs)
    except pd.errors.EmptyDataError:  # not even a header
        return
    with reader:
        yield from reader


def _open_text(source: Path | io.StringIO, opts: FileOptions) -> Any:
    """A text file opened as training opens it (universal newlines), or text already read."""
    if isinstance(source, Path):
        return source.open(encoding=opts.encoding, errors=opts.encoding_errors)
    return contextlib.nullcontext(source)


def iter_rows(
    source: Path | io.StringIO, fmt: str, opts: FileOptions, what: str | None = None, keep_blank: bool = False
) -> Iterator[Any]:
    """A file's rows one at a time, streamed (a .json list is read whole): dicts for csv/tsv (every cell as
    text, "" when empty), parquet and json(l) records; strings for a text file's lines and json(l) strings.
    `source` is a path, or for csv/tsv/jsonl/text the file's text already read.

    A blank (or whitespace-only) line of a text, jsonl, csv or tsv file is no row; with `keep_blank` (prediction:
    output row i is input row i) it is one ("" for a text file, None for jsonl, empty cells for csv/tsv),
    except blank lines after the file's last other line, which nothing follows to keep in line.

    Raises:
        UserError: the file cannot be decoded or parsed as `fmt`, or a .json file is not a list; `what`
            names the file (its path by default).
    """
    what = what or str(source)
    with _parse_errors(what):
        if fmt in ("csv", "tsv"):
            yield from _table_rows(source, fmt, opts, keep_blank)
        elif fmt == "parquet":
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(source).iter_batches(batch_size=_ROWS_PER_READ):
                yield from batch.to_pylist()
        elif fmt == "json":
            with _open_text(source, opts) as f:
                records = json.load(f)
            if not isinstance(records, list):  # an object would give its keys as rows
                raise UserError(f"{what}: a .json file must be a list of texts or of records")
            yield from records
        else:
            yield from _line_rows(source, fmt, opts, what, keep_blank)


def _table_rows(source: Path | io.StringIO, fmt: str, opts: FileOptions, keep_blank: bool) -> Iterator[dict]:
    """`iter_rows` of a csv/tsv file."""
    blank_before = 0  # blank lines held back until a row with a cell follows them
    for frame in _frames(source, fmt, opts, keep_blank=keep_blank):
        names, cells = [str(c) for c in frame.columns], [frame[c].fillna("").tolist() for c in frame.columns]
        blank = frame.isna().all(axis=1).tolist() if keep_blank else [False] * len(frame)
        for row, is_blank in zip(zip(*cells, strict=True), blank, strict=True):
            if is_blank:
                blank_before += 1
                continue
            yield from (dict.fromkeys(names, "") for _ in range(blank_before))
            blank_before = 0
            yield dict(zip(names, row, strict=True))


def _line_rows(source: Path | io.StringIO, fmt: str, opts: FileOptions, what: str, keep_blank: bool) -> Iterator[Any]:
    """`iter_rows` of a text or jsonl file."""
    blank_before = 0  # blank lines held back until a line with text follows them
    with _open_text(source, opts) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                blank_before += keep_blank
                continue
            yield from itertools.repeat(None if fmt == "jsonl" else "", blank_before)
            blank_before = 0
            if fmt != "jsonl":
                yield line.rstrip("\n")
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"cannot read {what}: line {number} is not JSON ({exc})") from None
            yield row


def table_columns(path: Path, fmt: str, opts: FileOptions, nrows: int | None = None) -> dict[str, list[str]]:
    """A csv/tsv file's columns (its first `nrows` rows), every cell as text ("" when empty), as `iter_rows`
    reads them.

    Raises:
        UserError: the file cannot be decoded or parsed as `fmt`.
    """
    columns: dict[str, list[str]] = {}
    with _parse_errors(str(path)):
        for frame in _frames(path, fmt, opts, nrows):
            for name in frame.columns:
                columns.setdefault(str(name), []).extend(frame[name].fillna("").tolist())
    return columns


def count_rows(path: Path, fmt: str, opts: FileOptions, what: str | None = None, keep_blank: bool = False) -> int:
    """How many rows `iter_rows` gives (with `keep_blank` alike): parquet's metadata, a csv/tsv file's parsed
    rows (a quoted field may hold line breaks), else one pass over the rows.

    Raises:
        UserError: as `iter_rows`.
    """
    with _parse_errors(what or str(path)):
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        if fmt in ("csv", "tsv") and not keep_blank:  # kept blank rows: iter_rows alone says which count
            return sum(len(frame) for frame in _frames(path, fmt, opts))
    return sum(1 for _ in iter_rows(path, fmt, opts, what, keep_blank))


def _file_format(cfg: Config, path: Path) -> str:
    if cfg.data.format != "auto":
        return cfg.data.format
    if cfg.data.line_regex is not None:
        return "text"
    fmt = EXTENSION_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UserError(f"cannot tell the format of {path} from its extension; set data.format")
    return fmt


def _check_decodable(path: Path, encoding: str) -> None:
    """Fail with the line number when the file does not decode with `data.encoding`."""
    raw = path.read_bytes()
    try:
        raw.decode(encoding)
    except LookupError:
        raise UserError(f"data.encoding: unknown encoding {encoding!r}") from None
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{path} line {line}: byte 0x{raw[exc.start]:02x} is not valid {encoding}; set data.encoding (e.g. latin-1)"
        ) from None


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return exc


def _decode(cfg: Config, path: Path) -> str:
    """A whole text file, decoded with `data.encoding` and `data.encoding_errors`."""
    try:
        return path.read_bytes().decode(cfg.data.encoding, errors=cfg.data.encoding_errors)
    except LookupError:
        raise UserError(f"data.encoding: unknown encoding {cfg.data.encoding!r}") from None
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}: byte 0x{exc.object[exc.start]:02x} at offset {exc.start} is not valid {cfg.data.encoding}; "
            "set data.encoding, or data.encoding_errors=replace to read it with replacement characters"
        ) from None


def read_label_folders(cfg: Config, path: Path) -> datasets.Dataset:
    """scikit-learn's `load_files` layout: one sub-folder per label, one file per document.

    Files at the top level (a README, a licence) are not documents: they are listed in the log and
    skipped. Columns are named `data.text_column` and `data.label_column`.

    Raises:
        UserError: no label folders, an empty label folder, an empty or undecodable document.
    """
    folders = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    skipped = sorted(p.name for p in path.iterdir() if p.is_file())
    if skipped:
        logger.info(f"{path}: skipped top-level files {skipped} (the labels are the sub-folders)")
    if not folders:
        raise UserError(f"{path} has no label sub-folders (one folder per label, one file per document)")
    texts, labels = [], []
    for folder in folders:
        files = sorted(f for f in folder.rglob("*") if f.is_file() and not f.name.startswith("."))
        if not files:
            raise UserError(f"label folder {folder} is empty (no documents)")
        for f in files:
            text = _decode(cfg, f).strip()
            if not text:
                raise UserError(f"{f} is empty (label folder {folder.name})")
            texts.append(text)
            labels.append(folder.name)
    return _seeded_order(cfg, {cfg.data.text_column: texts, cfg.data.label_column: labels})


def _seeded_order(cfg: Config, columns: dict[str, list[str]]) -> datasets.Dataset:
    """Rows read label by label, in a seeded random order: `data.max_train_samples` then takes a
    sample of every label rather than the first labels' rows."""
    order = list(range(len(next(iter(columns.values())))))
    random.Random(cfg.run.seed).shuffle(order)
    return datasets.Dataset.from_dict({k: [v[i] for i in order] for k, v in columns.items()})


def read_label_files(cfg: Config) -> tuple[datasets.Dataset, dict[str, Path]]:
    """`data.label_files`: one text file per label, one text per line (blank lines skipped).

    Raises:
        UserError: a label file that does not exist or holds no text.
    """
    d = cfg.data
    assert d.label_files is not None
    texts, labels, files = [], [], {}
    for label, name in d.label_files.items():
        path = cfg.resolved_path(name)
        assert path is not None
        if not path.is_file():
            raise UserError(f"data.label_files[{label!r}]: {path} does not exist")
        lines = [x.strip() for x in _decode(cfg, path).splitlines() if x.strip()]
        if not lines:
            raise UserError(f"data.label_files[{label!r}]: {path} holds no text")
        texts += lines
        labels += [str(label)] * len(lines)
        files[f"train:{label}"] = path
    return _seeded_order(cfg, {d.text_column: texts, d.label_column: labels}), files


def read_file(cfg: Config, path: Path) -> datasets.Dataset:
    """Read one local file, a `Dataset.save_to_disk` directory or a folder-per-label directory into a
    Dataset with every column as given.

    Raises:
        UserError: the file is missing, undecodable or not in the configured format.
    """
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return _read_saved(path)
        return read_label_folders(cfg, path)
    if not path.is_file():
        raise UserError(f"data file {path} does not exist")
    fmt = _file_format(cfg, path)
    d = cfg.data
    if path.stat().st_size == 0:
        raise UserError(f"{path} is empty (no header, no rows)")
    if fmt in ("csv", "tsv", "text", "json", "jsonl") and d.encoding_errors == "strict":
        _check_decodable(path, d.encoding)
    try:
        if fmt in ("csv", "tsv"):
            kwargs = csv_options(fmt, FileOptions.of(d))
            ds = datasets.load_dataset("csv", data_files=str(path), split="train", **kwargs)
        elif fmt in ("json", "jsonl"):
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
        elif fmt == "parquet":
            ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(
                "text", data_files=str(path), split="train", encoding=d.encoding, encoding_errors=d.encoding_errors
            )
    except UserError:
        raise
    except Exception as exc:  # datasets wraps pandas/arrow errors; show the root cause in one line
        cause = _root_cause(exc)
        msg = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        if "corresponds to no data" in msg:  # datasets' words for a file with a header and no rows
            raise UserError(
                f"{path} has no rows" + (" (only a header)" if fmt in ("csv", "tsv") and d.header else "")
            ) from None
        raise UserError(f"cannot read {path} as {fmt}: {msg}") from None
    if fmt == "text" and d.line_regex is not None:
        ds = _apply_line_regex(ds, d.line_regex, path)
    if len(ds) == 0:
        raise UserError(f"{path} has no rows")
    return ds


def _read_saved(path: Path) -> datasets.Dataset:
    """A dataset saved with `save_to_disk`; a saved DatasetDict has one such directory per split."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise UserError(
            f"{path} is a saved DatasetDict; point the data file at one split directory ({', '.join(splits)})"
        )
    if not (path / "state.json").is_file():
        raise UserError(f"data file {path} is a directory but not a saved dataset (Dataset.save_to_disk)")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise UserError(f"cannot read saved dataset {path}: {str(_root_cause(exc)).strip().splitlines()[0]}") from None
    if len(ds) == 0:
        raise UserError(f"{path} has no rows")
    return ds


def _apply_line_regex(ds: datasets.Dataset, pattern: str, path: Path) -> datasets.Dataset:
    rx = re.compile(pattern)
    names = list(rx.groupindex)
    columns: dict[str, list[str]] = {n: [] for n in names}
    for i, line in enumerate(ds["text"][:]):
        if not line.strip():
            continue  # blank lines carry no example
        m = rx.match(line)
        if m is None:
            raise UserError(f"{path} line {i + 1} does not match data.line_regex: {line[:60]!r}")
        for n in names:
            columns[n].append(m.group(n))
    return datasets.Dataset.from_dict(columns)


def _normalize(cfg: Config, ds: datasets.Dataset, path: str, need_label: bool = True) -> datasets.Dataset:
    """Select text/pair/label columns, check for missing values, read labels as the problem type needs."""
    d = cfg.data
    wanted = {"text": d.text_column}
    if d.text_pair_column:
        wanted["text_pair"] = d.text_pair_column
    if need_label and d.label_columns is None:
        wanted["label"] = d.label_column
    keys = {"text": "data.text_column", "text_pair": "data.text_pair_column", "label": "data.label_column"}
    for role, col in [*wanted.items(), *(("label", c) for c in (d.label_columns if need_label else None) or [])]:
        if col not in ds.column_names:
            key = "data.label_columns" if col not in wanted.values() else keys[role]
            raise UserError(f"{path} has no column {col!r} ({key}); its columns are {ds.column_names}")
    first_line = 2 if (d.header and _looks_tabular(cfg, path)) else 1
    for role, col in wanted.items():
        values = ds[col][:]  # a list: iterating a datasets Column formats row by row (30x slower)
        for i, v in enumerate(values):
            if (
                v is None
                or (isinstance(v, float) and math.isnan(v))
                or (role != "label" and isinstance(v, str) and not v.strip())
            ):
                raise UserError(f"{path} row {i + 1} (line {i + first_line}) has no value in column {col!r}")
    labels = _read_labels(cfg, ds, path, first_line) if need_label else None
    ds = ds.select_columns(list(dict.fromkeys(v for k, v in wanted.items() if k != "label")))
    ds = ds.rename_columns({col: role for role, col in wanted.items() if col != role and role != "label"})
    if labels is not None:
        feature = {
            SINGLE: datasets.Value("string"),
            REGRESSION: datasets.Value("float64"),
            MULTI: datasets.Sequence(datasets.Value("string")),
        }[cfg.model.problem_type]
        ds = ds.add_column("label", labels, feature=feature)
    return ds


def _read_labels(cfg: Config, ds: datasets.Dataset, path: str, first_line: int) -> list[Any]:
    """The label of every row, as the problem type reads it: str, list of str, or float."""
    d, kind = cfg.data, cfg.model.problem_type
    if d.label_columns is not None:  # multi-label, one 0/1 column per label
        cols = {c: [_flag(v, path, i + first_line, c) for i, v in enumerate(ds[c][:])] for c in d.label_columns}
        return [[c for c in d.label_columns if cols[c][i]] for i in range(len(ds))]
    values = ds[d.label_column][:]
    if kind == REGRESSION:
        out = []
        for i, v in enumerate(values):
            try:
                out.append(float(v))
            except (TypeError, ValueError):
                raise UserError(
                    f"{path} line {i + first_line}: label {v!r} in column {d.label_column!r} is not a number "
                    "(model.problem_type=regression)"
                ) from None
        return out
    if kind == MULTI:
        return [_label_list(v, d.label_delimiter, path, i + first_line) for i, v in enumerate(values)]
    for i, v in enumerate(values):
        if isinstance(v, list) or (isinstance(v, str) and v.strip().startswith("[") and v.strip().endswith("]")):
            raise UserError(
                f"{path} line {i + first_line}: label {v!r} is a list, but model.problem_type is "
                "single_label_classification; set model.problem_type=multi_label_classification"
            )
    return [_label_str(v) for v in values]


def _flag(value: Any, path: str, line: int, column: str) -> bool:
    text = _label_str(value).lower()
    if text in ("1", "true"):
        return True
    if text in ("0", "false", ""):
        return False
    raise UserError(f"{path} line {line}: column {column!r} (data.label_columns) holds {value!r}, not 0 or 1")


def _label_list(value: Any, delimiter: str | None, path: str, line: int) -> list[str]:
    """A multi-label cell: a list, a JSON list, or names/ids joined by `data.label_delimiter`."""
    if isinstance(value, list):
        return [_label_str(v) for v in value]
    text = _label_str(value)
    if delimiter is None:
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, list):
            raise UserError(
                f"{path} line {line}: multi-label cell {text!r} is not a JSON list; for labels joined by a "
                "character set data.label_delimiter (e.g. ','), or use data.label_columns"
            )
        return [_label_str(v) for v in parsed]
    return [x.strip() for x in text.split(delimiter) if x.strip()]


def _looks_tabular(cfg: Config, path: str) -> bool:
    try:
        return _file_format(cfg, Path(path)) in ("csv", "tsv")
    except UserError:
        return False


def _label_str(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def _sort_key(v: str) -> tuple[int, Any]:
    try:
        return (0, int(v))
    except ValueError:
        return (1, v)


def _flat(labels: list[Any]) -> list[str]:
    """Every raw label of a split (multi-label cells are lists)."""
    return [v for x in labels for v in x] if labels and isinstance(labels[0], list) else list(labels)


def _labels_file(cfg: Config) -> list[str] | None:
    path = cfg.resolved_path(cfg.data.labels_file)
    if path is None:
        return None
    if not path.is_file():
        raise UserError(f"data.labels_file: {path} does not exist")
    names = [x.strip() for x in _decode(cfg, path).splitlines()]
    while names and not names[-1]:
        names.pop()
    if not names or not all(names):
        raise UserError(f"data.labels_file: {path} needs one label name per line, with no blank line between them")
    return names


def _label_names(cfg: Config, train_labels: list[Any], source: str) -> tuple[list[str], dict[str, str]]:
    """Label names (index = class id) and the raw->name map, from config or the whole train file."""
    d = cfg.data
    if cfg.model.problem_type == REGRESSION:
        if len(set(train_labels)) < 2:
            raise UserError(
                f"{source}: every label in column {d.label_column!r} is {train_labels[0]}: nothing to learn"
            )
        return [d.label_column], {}
    raw_values = sorted(set(_flat(train_labels)), key=_sort_key)
    if cfg.model.problem_type == SINGLE:
        _refuse_joined_labels(raw_values, source)
    from_file = _labels_file(cfg)
    if from_file is not None:
        # names as they are, or ids: the line number of the name in the file
        raw_to_name = {v: v if v in from_file else _name_of_id(v, from_file, source) for v in raw_values}
        names = from_file
    elif d.label_map is not None:
        raw_to_name = {str(k).strip(): v for k, v in d.label_map.items()}
        unknown = [v for v in raw_values if v not in raw_to_name]
        if unknown:
            raise UserError(f"{source}: label {unknown[0]!r} is not in data.label_map (keys: {list(raw_to_name)})")
        names = list(dict.fromkeys(raw_to_name.values()))
    else:
        raw_to_name = {v: v for v in raw_values}
        names = list(d.label_columns) if d.label_columns is not None else raw_values
    if d.labels is not None:
        missing = [n for n in dict.fromkeys(raw_to_name[v] for v in raw_values) if n not in d.labels]
        if missing:
            raise UserError(f"{source}: label {missing[0]!r} is not in data.labels {d.labels}")
        names = list(d.labels)
    raw_to_name.update({n: n for n in names if n not in raw_to_name})
    if cfg.model.problem_type == SINGLE and len(names) < 2:
        raise UserError(f"{source}: a classifier needs at least 2 labels, found {names}")
    if cfg.model.problem_type == MULTI:
        _check_multi_label(train_labels, names, raw_to_name, source)
    return names, raw_to_name


def _refuse_joined_labels(raw_values: list[str], source: str) -> None:
    """A single-label run over labels like `6,9,27` whose parts are labels too: multi-label data."""
    known = set(raw_values)
    for sep in (",", ";", "|"):
        joined = [v for v in raw_values if sep in v and all(p.strip() in known for p in v.split(sep))]
        if joined:
            raise UserError(
                f"{source}: label {joined[0]!r} joins other labels with {sep!r}, but model.problem_type is "
                f"single_label_classification; set model.problem_type=multi_label_classification and "
                f"data.label_delimiter={sep!r}"
            )


def _name_of_id(value: str, names: list[str], source: str) -> str:
    if value.isdigit() and int(value) < len(names):
        return names[int(value)]
    raise UserError(f"{source}: label {value!r} is neither a name nor an id (0..{len(names) - 1}) in data.labels_file")


def _check_multi_label(
    train_labels: list[list[str]], names: list[str], raw_to_name: dict[str, str], source: str
) -> None:
    """Every label must be learnable: present in some training rows and absent from others."""
    counts = Counter(raw_to_name[v] for row in train_labels for v in set(row))
    never = [n for n in names if counts[n] == 0]
    always = [n for n in names if counts[n] == len(train_labels)]
    if len(names) < 2 or always:
        raise UserError(f"{source}: label(s) {always or names} are in every training row: nothing to learn")
    if never:
        logger.warning(f"warning: {source}: label(s) {never[:10]} occur in no training row (they will not be learnt)")


def _check_labels(ds: datasets.Dataset, raw_to_name: dict[str, str], names: list[str], path: str) -> None:
    if "label" not in ds.column_names or getattr(ds.features["label"], "dtype", None) in ("float64", "float32"):
        return  # regression: every label was read as a number already
    for i, v in enumerate(ds["label"][:]):
        for x in v if isinstance(v, list) else [v]:
            if x not in raw_to_name or raw_to_name[x] not in names:
                raise UserError(f"{path} row {i + 1}: label {x!r} does not occur in the training labels {names}")


def _hub_split(cfg: Config, split: str | None) -> datasets.Dataset | None:
    if split is None:
        return None
    d = cfg.data
    try:
        return datasets.load_dataset(d.hub_dataset, d.hub_config, split=split)
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        if any(
            s in text
            for s in ("offline", "Offline", "ConnectionError", "connect", "resolve", "Couldn't reach", "HF_HUB_OFFLINE")
        ):
            raise UserError(
                f"cannot reach the HuggingFace hub for dataset {d.hub_dataset!r} (offline); "
                "to use local files set data.hub_dataset=null and data.train_file / data.validation_file (e.g. "
                "configs/sst2-minilm.yaml)"
            ) from None
        raise UserError(
            f"cannot load hub dataset {d.hub_dataset!r} split {split!r}: {str(exc).splitlines()[0]}"
        ) from None


@dataclass
class TrainRows:
    """The training rows as read (`RawSplits.train` before the validation split), `rows[i]` the 0-based data row
    of the file that row i came from (the reading order for label folders and hub splits), with the label names of
    the whole file (excluded rows included: every run on a subset of the file has the same label ids)."""

    data: datasets.Dataset
    rows: list[int]
    label_names: list[str]
    raw_to_name: dict[str, str]
    files: dict[str, Path]
    source: str
    total: int = 0  # rows of the file (excluded ones included)
    left_out: list[int] = field(default_factory=list)  # the rows data.exclude_rows leaves out

    @property
    def excluded(self) -> int:
        return len(self.left_out)


def read_train_rows(cfg: Config) -> TrainRows:
    """The training split as `load_raw_splits` starts from it: read, normalized, labels named, `data.exclude_rows`
    applied (nothing split off, no `data.max_train_samples` cut).

    Raises:
        UserError: as `load_raw_splits`, and an exclusion list that does not fit the file (`exclude_rows`).
    """
    d = cfg.data
    files: dict[str, Path] = {}
    if d.hub_dataset is not None:
        train, src = _hub_split(cfg, d.hub_train_split), d.hub_dataset
    elif d.label_files is not None:
        (train, files), src = read_label_files(cfg), "data.label_files"
    else:
        files["train"] = cfg.resolved_path(d.train_file)  # type: ignore[assignment]
        train, src = read_file(cfg, files["train"]), str(files["train"])
    assert train is not None
    train = _normalize(cfg, train, src)
    names, raw_to_name = _label_names(cfg, train["label"][:], src)
    out = TrainRows(train, list(range(len(train))), names, raw_to_name, files, src, len(train))
    if d.exclude_rows is not None:
        path = Path(d.exclude_rows).expanduser()
        keep = exclude_rows(train, path, src)
        out.data, out.rows = train.select(keep), keep
        out.left_out = sorted(set(range(len(train))) - set(keep))
        files["exclude_rows"] = path
    return out


EXCLUDE_COLUMN = "row"  # the column of data.exclude_rows (finetune audit's label_issues.csv) naming data rows


def exclude_rows(train: datasets.Dataset, path: Path, source: str) -> list[int]:
    """The rows of `train` to keep: all but those `path` lists in its `row` column (0-based data rows, the header
    not counted). Where the file also has a `text` column (audit's label_issues.csv has), every listed row's text
    must be the training file's text of that row: a list made for other data, or a reordered file, is refused.

    Raises:
        UserError: the file is missing, has no `row` column, or lists a row that is not a whole number within the
            training rows or whose text differs.
    """
    key = "data.exclude_rows"
    if not path.is_file():
        raise UserError(f"{key}: {path} does not exist")
    csv.field_size_limit(sys.maxsize)  # a long document's text in the list is one field
    try:  # utf-8-sig: a copy saved by a spreadsheet starts with a byte-order mark
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            table, columns = list(reader), reader.fieldnames or []
    except (csv.Error, UnicodeDecodeError, OSError) as exc:
        raise UserError(f"{key}: cannot read {path} as CSV: {exc}") from None
    if EXCLUDE_COLUMN not in columns:
        raise UserError(
            f"{key}: {path} has no column {EXCLUDE_COLUMN!r} (the data rows to leave out); its columns: {columns}"
        )
    texts = train["text"][:]
    dropped: set[int] = set()
    for line, entry in enumerate(table, start=2):
        cell = (entry.get(EXCLUDE_COLUMN) or "").strip()
        if not cell.isdigit() or int(cell) >= len(texts):
            raise UserError(
                f"{key}: {path} line {line}: row {cell!r} is not a data row of {source} (0 to {len(texts) - 1})"
            )
        row = int(cell)
        given = entry.get("text")
        if given is not None and given != texts[row]:
            raise UserError(
                f"{key}: {path} line {line}: row {row}'s text differs from {source}'s; the list was made for "
                "other data (or the file was reordered)"
            )
        dropped.add(row)
    return [i for i in range(len(texts)) if i not in dropped]


def read_unlabeled(cfg: Config) -> tuple[datasets.Dataset, Path]:
    """`distill.unlabeled_file`'s texts (`text`, and `text_pair` for pairs), read as the training file is (the data.*
    reading keys, data.text_column and data.text_pair_column); a label column is ignored.

    Raises:
        UserError: the file is missing or unreadable, or lacks a text column or a text.
    """
    path = cfg.resolved_path(cfg.distill.unlabeled_file)
    assert path is not None
    if not path.is_file():
        raise UserError(f"distill.unlabeled_file: {path} does not exist")
    try:
        return _normalize(cfg, read_file(cfg, path), str(path), need_label=False), path
    except UserError as exc:
        raise UserError(f"distill.unlabeled_file: {exc}") from None


def load_raw_splits(cfg: Config) -> RawSplits:
    """Read, normalize, label-check and split the configured data (no tokenization yet).

    Raises:
        UserError: missing or unreadable files, missing columns or values, labels that do not fit
            the problem type, validation/test labels unseen in training, a bad `data.exclude_rows`.
    """
    d = cfg.data
    rows = read_train_rows(cfg)
    train, names, raw_to_name, files = rows.data, rows.label_names, rows.raw_to_name, rows.files
    if d.hub_dataset is not None:
        val = _hub_split(cfg, d.hub_validation_split) if d.validation_split is None else None
        test = _hub_split(cfg, d.hub_test_split)
        src = {"validation": d.hub_dataset, "test": d.hub_dataset}
    else:
        for split, name in (("validation", d.validation_file), ("test", d.test_file)):
            path = cfg.resolved_path(name)
            if path is not None:
                files[split] = path
        val = read_file(cfg, files["validation"]) if "validation" in files else None
        test = read_file(cfg, files["test"]) if "test" in files else None
        src = {k: str(v) for k, v in files.items()}
    if val is not None:
        val = _normalize(cfg, val, src["validation"])
        _check_labels(val, raw_to_name, names, src["validation"])
    if test is not None:
        test = _normalize(cfg, test, src["test"])
        _check_labels(test, raw_to_name, names, src["test"])
    if d.validation_split is not None:
        train, val = _grouped_split(train, d.validation_split, cfg.run.seed, cfg.model.problem_type == SINGLE)
    if d.max_train_samples is not None:
        train = train.select(range(min(d.max_train_samples, len(train))))
    if d.max_eval_samples is not None:
        val = val.select(range(min(d.max_eval_samples, len(val)))) if val is not None else None
        test = test.select(range(min(d.max_eval_samples, len(test)))) if test is not None else None
    return RawSplits(train, val, test, names, raw_to_name, files, cfg.model.problem_type, rows.excluded)


def _grouped_split(
    ds: datasets.Dataset, fraction: float, seed: int, stratify: bool
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """A seeded split: `fraction` of every class (single-label; of all rows otherwise) goes to validation,
    and every copy of a text goes where its first drawn copy goes, so no text is in both splits."""
    texts = ds["text"][:]
    copies: dict[str, list[int]] = {}
    for i, t in enumerate(texts):
        copies.setdefault(t, []).append(i)
    keys = ds["label"][:] if stratify else [""] * len(ds)
    by_class: dict[str, list[int]] = {}
    for i, v in enumerate(keys):
        by_class.setdefault(v, []).append(i)
    rng = random.Random(seed)
    chosen: set[int] = set()
    val_idx: list[int] = []
    left = Counter(keys)  # training rows each class keeps
    for label in sorted(by_class):
        idx = by_class[label][:]
        rng.shuffle(idx)
        # at least one per class in validation, but never a class's only example (training needs it more)
        want = min(len(idx) - 1, max(1, round(len(idx) * fraction)))
        taken = sum(1 for i in idx if i in chosen)
        for i in idx:
            if taken >= want:
                break
            if i in chosen:
                continue
            group = copies[texts[i]]
            if stratify and any(left[keys[j]] <= sum(1 for g in group if keys[g] == keys[j]) for j in group):
                continue  # a duplicated text would take a class's last training rows: it stays in train
            chosen.update(group)
            val_idx.extend(group)
            left.subtract(keys[j] for j in group)
            taken += sum(1 for j in group if keys[j] == label)
    train_idx = [i for i in range(len(ds)) if i not in chosen]
    if not train_idx:
        raise UserError("data.validation_split leaves no training rows")
    # validation in seeded random order, not file order: a class-sorted file (AG News) would otherwise
    # make the first data.max_eval_samples rows of validation a single class
    rng.shuffle(val_idx)
    return ds.select(train_idx), ds.select(val_idx)
