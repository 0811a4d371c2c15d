"""Datasets from local files or the hub -> label-mapped, tokenized splits -> dataloaders.

Every dataset goes through the same general options (delimiter, quoting, header, encoding,
column names, label map, line regex, seeded stratified validation split); there is no
dataset-specific code path. Tokenization runs once through `datasets.map` (cached on disk for
files). Training batches come from a seeded length-grouped batch sampler whose batches also
carry the number of samples in their accumulation window (see `WindowedBatchSampler`).
"""

from __future__ import annotations

import csv
import hashlib
import heapq
import json
import logging
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data import Dataset as TorchDataset

from finetune.config import Config
from finetune.errors import UserError

logger = logging.getLogger("finetune")
datasets.logging.set_verbosity_error()
huggingface_hub.utils.logging.set_verbosity_error()  # offline: no retry warnings, one UserError line
datasets.disable_progress_bars()  # loading is quick; the training bar is the one to watch

_EXT_FORMAT = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "jsonl", ".parquet": "parquet", ".txt": "text"}


SINGLE, MULTI, REGRESSION = "single_label_classification", "multi_label_classification", "regression"


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


def _file_format(cfg: Config, path: Path) -> str:
    if cfg.data.format != "auto":
        return cfg.data.format
    if cfg.data.line_regex is not None:
        return "text"
    fmt = _EXT_FORMAT.get(path.suffix.lower())
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
            delimiter = d.delimiter or ("\t" if fmt == "tsv" else ",")
            kwargs: dict[str, Any] = dict(
                sep=delimiter,
                quoting=csv.QUOTE_NONE if d.quoting == "none" else csv.QUOTE_MINIMAL,
                header=0 if d.header else None,
                encoding=d.encoding,
                encoding_errors=d.encoding_errors,
                # "NA", "null" and friends are text in a sentence, not missing values
                keep_default_na=False,
                na_values=[""],
            )
            if d.column_names is not None:
                kwargs["names"] = d.column_names
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
        feature = {SINGLE: datasets.Value("string"), REGRESSION: datasets.Value("float64"),
                   MULTI: datasets.Sequence(datasets.Value("string"))}[cfg.model.problem_type]  # fmt: skip
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


def load_raw_splits(cfg: Config) -> RawSplits:
    """Read, normalize, label-check and split the configured data (no tokenization yet).

    Raises:
        UserError: missing or unreadable files, missing columns or values, labels that do not fit
            the problem type, validation/test labels unseen in training.
    """
    d = cfg.data
    files: dict[str, Path] = {}
    if d.hub_dataset is not None:
        train = _hub_split(cfg, d.hub_train_split)
        val = _hub_split(cfg, d.hub_validation_split) if d.validation_split is None else None
        test = _hub_split(cfg, d.hub_test_split)
        src = {"train": d.hub_dataset, "validation": d.hub_dataset, "test": d.hub_dataset}
    else:
        if d.label_files is not None:
            train, files = read_label_files(cfg)
        for split, name in (("train", d.train_file), ("validation", d.validation_file), ("test", d.test_file)):
            path = cfg.resolved_path(name)
            if path is not None:
                files[split] = path
        if d.label_files is None:
            train = read_file(cfg, files["train"])
        val = read_file(cfg, files["validation"]) if "validation" in files else None
        test = read_file(cfg, files["test"]) if "test" in files else None
        src = {k: str(v) for k, v in files.items()}
        src.setdefault("train", "data.label_files")
    assert train is not None
    train = _normalize(cfg, train, src["train"])
    names, raw_to_name = _label_names(cfg, train["label"][:], src["train"])
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
    return RawSplits(train, val, test, names, raw_to_name, files, cfg.model.problem_type)


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
            raise UserError(f"data.chunk_stride={w.chunk_stride} must be smaller than data.max_length minus the "
                            f"special tokens ({room})")  # fmt: skip
        enc = dict(tokenizer(texts, truncation=True, max_length=w.max_length, stride=w.chunk_stride,
                             return_overflowing_tokens=True))  # fmt: skip
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
            logger.info("class weights (auto): " + ", ".join(
                f"{n} {w:.3g}" for n, w in zip(label_names, per_class, strict=True)))  # fmt: skip
        else:
            if len(class_weights) != len(label_names):
                raise UserError(f"train.class_weights has {len(class_weights)} weights for {len(label_names)} labels "
                                f"{label_names} (label-id order)")  # fmt: skip
            per_class = list(class_weights)
        weights = [w * per_class[y] for w, y in zip(weights, labels, strict=True)]
    return None if all(w == 1.0 for w in weights) else weights


def _label_summary(raw: RawSplits, ds: datasets.Dataset) -> dict[str, Any]:
    """Per-label counts (positives per label for multi-label), or the score distribution (regression)."""
    if raw.problem_type == REGRESSION:
        t = torch.tensor(ds["label"][:], dtype=torch.float64)
        return {"score_stats": {"min": float(t.min()), "max": float(t.max()), "mean": float(t.mean()),
                                "std": float(t.std()) if len(t) > 1 else 0.0}}  # fmt: skip
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
        lines.append(
            f"{name}: {e['rows']} rows ({balance}); {e['duplicates_within']} duplicate texts{extra}; "
            f"{100 * e['truncated_fraction']:.1f}% truncated; {e['mean_tokens']:.1f} tokens/row"
        )
    return "\n".join(lines)


def file_sha256(path: Path) -> str:
    """sha256 of a data file, or of a saved dataset directory's files and names (for provenance.json)."""
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        if path.is_dir():
            h.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


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


def build_data(cfg: Config, tokenizer: Any) -> Data:
    """Read and tokenize all splits; build the data report.

    Raises:
        UserError: unreadable or inconsistent data, or options that need validation data without it.
    """
    raw = load_raw_splits(cfg)
    if raw.validation is None:
        needs = [k for k, v in (("train.eval_every_steps", cfg.train.eval_every_steps),
                                ("train.early_stopping_patience", cfg.train.early_stopping_patience)) if v]
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
    weights = sample_weights(tok["train"], raw.label_names, cfg.train.class_weights)
    if weights is not None:
        tok["train"] = tok["train"].add_column("weight", weights)
    report = build_data_report(raw, tok)
    sha = {split: file_sha256(p) for split, p in raw.files.items()}
    held_out = {n: ds for n, ds in (("validation", raw.validation), ("test", raw.test)) if ds is not None}
    return Data(
        tok["train"], tok.get("validation"), tok.get("test"), raw.label_names, report, raw.files, sha, raw.problem_type,
        texts={n: ds["text"][:] for n, ds in held_out.items()},
        pairs={n: ds["text_pair"][:] for n, ds in held_out.items() if "text_pair" in ds.column_names},
    )



# ----------------------------------------------------------------------------------------------
# Batching.


class WindowedBatchSampler(Sampler[list[tuple[int, int, float]]]):
    """Seeded, optionally length-grouped batches of (index, window_samples, weight) items.

    Exact gradient accumulation needs, at the first micro-batch of a window, the number of
    samples in the whole window (the tail window of an epoch is short). The sampler knows the
    epoch's batches in advance, so it stamps that count on every item; the collator turns it
    into `batch["window_samples"]`. Batches are global (micro-batch x processes, split by
    Accelerate with `split_batches=True`); with several processes (`pad_to_multiple` = P > 1) a
    short global batch is filled to the full global size with weight-0 copies, so every process
    gets the same number of rows and no sample counts twice.
    """

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        accumulation: int,
        seed: int,
        group_by_length: bool = True,
        pad_to_multiple: int = 1,
        megabatch_factor: int = 50,
        weights: list[float] | None = None,
    ) -> None:
        self.lengths = lengths
        # per-sample loss weights (class weights, 1/windows of a chunked text): a window is normalised
        # by their sum, which is what the stamped window total is
        self.weights = weights
        self.batch_size = batch_size
        self.accumulation = accumulation
        self.seed = seed
        self.group_by_length = group_by_length
        self.pad_to_multiple = pad_to_multiple
        self.megabatch = batch_size * accumulation * megabatch_factor
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the data order of `epoch` (seed + epoch), so a resumed run sees the same order."""
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        """The epoch's batches as lists of dataset indices."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        if not self.group_by_length:
            return [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        # sort within megabatches by length (longest first), cut into accumulation windows, shuffle
        # the window order, then cut each window into micro-batches. Grouping whole windows makes
        # an epoch's windows (which samples each optimizer step sees) independent of the
        # micro-batch size: micro 16 x 2 and micro 8 x 4 step on the same samples, which is what
        # lets an out-of-memory retry halve the micro-batch mid-epoch (finetune/planner.py).
        window = self.batch_size * self.accumulation
        windows: list[list[int]] = []
        for s in range(0, len(order), self.megabatch):
            chunk = sorted(order[s : s + self.megabatch], key=lambda i: -self.lengths[i])
            windows.extend(chunk[i : i + window] for i in range(0, len(chunk), window))
        # keep a full window last: only the epoch's final window may be short
        full = [w for w in windows if len(w) == window]
        short = [w for w in windows if len(w) != window]
        perm = torch.randperm(len(full), generator=g).tolist()
        return [
            w[i : i + self.batch_size]
            for w in [full[i] for i in perm] + short
            for i in range(0, len(w), self.batch_size)
        ]

    def __iter__(self) -> Iterator[list[tuple[int, int, float]]]:
        batches = self.batches()
        for w in range(0, len(batches), self.accumulation):
            window = batches[w : w + self.accumulation]
            weight = self.weights or [1.0] * len(self.lengths)
            n = sum(weight[i] for b in window for i in b)
            for b in window:
                items = [(i, n, weight[i]) for i in b]
                if self.pad_to_multiple > 1 and len(items) < self.batch_size:
                    # Several processes: Accelerate's BatchSamplerShard (split_batches=True) refills a
                    # short global batch with samples from the epoch's start (weight 1: counted twice)
                    # unless the batch is full. Fill it with weight-0 copies of its shortest sample
                    # instead: every rank gets batch_size / P rows and nothing counts twice.
                    pad = min(b, key=lambda i: self.lengths[i])
                    items += [(pad, n, 0.0)] * (self.batch_size - len(items))
                yield items

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def num_windows(self) -> int:
        """Optimizer steps in one epoch."""
        return math.ceil(len(self) / self.accumulation)

    def heaviest_window(self, limit: int | None = None) -> int:
        """Index in this epoch (among its first `limit` windows) of the window whose largest micro-batch has
        the most padded tokens (rows x longest row; ties: the longer row, then the earlier window): where
        activation memory peaks, since batches are padded per batch."""
        batches = self.batches()[: None if limit is None else limit * self.accumulation]

        def cost(b: list[int]) -> tuple[int, int]:
            longest = max(self.lengths[i] for i in b)
            return len(b) * longest, longest

        windows = [max(cost(b) for b in batches[w : w + self.accumulation])
                   for w in range(0, len(batches), self.accumulation)]  # fmt: skip
        return max(range(len(windows)), key=lambda w: (windows[w], -w))


class WindowedDataset(TorchDataset):
    """Wraps a tokenized split so items addressed as (index, window_samples, weight) carry both."""

    def __init__(self, ds: datasets.Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: tuple[int, int, float] | int) -> dict[str, Any]:
        if isinstance(key, tuple):
            index, window, weight = key
            item = dict(self.ds[int(index)])
            item["window_samples"] = window
            item["sample_weight"] = weight
            return item
        return dict(self.ds[int(key)])


class Collator:
    """Dynamic padding plus the bookkeeping fields (labels, weights, window size, token counts)."""

    MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        model_feats = [{k: f[k] for k in self.MODEL_KEYS if k in f} for f in features]
        batch = dict(self.tokenizer.pad(model_feats, return_tensors="pt"))
        return self.add_bookkeeping(batch, features)

    @staticmethod
    def add_bookkeeping(batch: dict[str, torch.Tensor], features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Labels, and for training items the window size and per-sample weights."""
        if "labels" in features[0]:  # ids: int64; multi-hot rows and regression scores: float32
            labels = torch.tensor([f["labels"] for f in features])
            batch["labels"] = labels.float() if labels.is_floating_point() else labels
        if "doc" in features[0]:  # chunked texts: evaluation aggregates the windows of each text
            batch["doc"] = torch.tensor([f["doc"] for f in features], dtype=torch.long)
        if "window_samples" in features[0]:
            batch["window_samples"] = torch.tensor(features[0]["window_samples"], dtype=torch.float32)
            batch["sample_weight"] = torch.tensor([f["sample_weight"] for f in features], dtype=torch.float32)
        return batch


def pack_rows(lengths: list[int], max_length: int, attention_cost: float) -> tuple[int, list[tuple[int, int]]]:
    """Place sequences of `lengths` into rows: (row width, [(row, offset)] per sequence).

    For each candidate row count R (from the fewest rows that `max_length` allows up to one row
    per sequence, ~k sequences per row for each k), sequences go longest first into the currently
    emptiest row, which balances
    the rows; the width W is the fullest row. The R minimising the modelled cost
    R x W x (1 + attention_cost x W) wins: the per-token work of the linear layers is fixed, the
    attention's grows with the row width, so packing short sequences into long rows is not free
    (`attention_cost` = 1 / (2 hidden + intermediate) for a Transformer encoder layer). Rows
    never exceed max(max_length, longest sequence).
    """
    n = len(lengths)
    order = sorted(range(n), key=lambda i: -lengths[i])
    cap = max(max_length, max(lengths))
    fewest = max(1, -(-sum(lengths) // cap))
    # about k sequences per row for every k: O(sqrt(n)) candidates keep large micro-batches cheap
    candidates = sorted({max(fewest, -(-n // k)) for k in range(1, n + 1)})
    best: tuple[float, int, list[tuple[int, int]]] | None = None
    for rows in candidates:
        heap = [(0, r) for r in range(rows)]  # (fill, row): the emptiest row on top
        place: list[tuple[int, int]] = [(0, 0)] * n
        for i in order:
            filled, row = heapq.heappop(heap)
            if filled + lengths[i] > cap:
                break  # does not fit in this many rows
            place[i] = (row, filled)
            heapq.heappush(heap, (filled + lengths[i], row))
        else:
            fill = [f for f, _ in heap]
            if min(fill) == 0:
                continue  # an empty row: fewer rows do the same
            width = max(fill)
            cost = rows * width * (1.0 + attention_cost * width)
            if best is None or cost < best[0]:
                best = (cost, width, place)
    assert best is not None  # rows = len(lengths) always fits
    return best[1], best[2]


class PackingCollator(Collator):
    """Training batches with several sequences per row and block-diagonal attention.

    Output: `input_ids`, `token_type_ids`, `position_ids` (restarting at 0 for every sequence)
    and `segment_ids` (1.. per sequence in its row, 0 on padding) of shape (rows, C); `cls_index`
    (one flat index into rows x C per sequence, in sample order, where its first token sits);
    `sequence_lengths`; labels, weights and window size per sequence as in `Collator`. The model
    side (`finetune.packing.packed_logits`) turns `segment_ids` into the attention mask and pools
    at `cls_index`, so the logits equal those of the unpacked sequences.
    """

    def __init__(self, tokenizer: Any, max_length: int, attention_cost: float) -> None:
        super().__init__(tokenizer)
        self.max_length = max_length
        self.attention_cost = attention_cost

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = [len(f["input_ids"]) for f in features]
        capacity, place = pack_rows(lengths, self.max_length, self.attention_cost)
        rows = 1 + max(r for r, _ in place)
        input_ids = torch.full((rows, capacity), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        token_type_ids = torch.zeros((rows, capacity), dtype=torch.long)
        position_ids = torch.zeros((rows, capacity), dtype=torch.long)
        segment_ids = torch.zeros((rows, capacity), dtype=torch.long)
        segments_in_row = [0] * rows
        cls_index = []
        for f, n, (row, offset) in zip(features, lengths, place, strict=True):
            segments_in_row[row] += 1
            input_ids[row, offset : offset + n] = torch.tensor(f["input_ids"])
            if "token_type_ids" in f:
                token_type_ids[row, offset : offset + n] = torch.tensor(f["token_type_ids"])
            position_ids[row, offset : offset + n] = torch.arange(n)
            segment_ids[row, offset : offset + n] = segments_in_row[row]
            cls_index.append(row * capacity + offset)
        batch = {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "position_ids": position_ids,
            "segment_ids": segment_ids,
            "cls_index": torch.tensor(cls_index),
            "sequence_lengths": torch.tensor(lengths),
        }
        return self.add_bookkeeping(batch, features)


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
    (`PackingCollator`; `attention_cost` from `finetune.packing.attention_cost`).
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
