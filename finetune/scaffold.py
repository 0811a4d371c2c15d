"""`finetune init DATA`: from a data file or folder to a commented config that trains with no edits.

The file is sniffed as people have it (delimiter, header, quoting, encoding, the folder-per-label
layout); the text, optional pair and label columns are chosen with the reason said; labels and token
lengths are counted; max_length, a validation split, the learning rate and the epochs are suggested.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.config import load_config, validate_config
from finetune.errors import UserError
from finetune.model import build_tokenizer

LABEL_NAMES = ("label", "labels", "class", "category", "target", "y", "score", "quality", "sentiment", "intent")
PAIR_HINTS = ("2", "_b", "pair", "hypothesis", "second", "question2")
SPLIT_WORDS = {"validation": ("dev", "valid", "validation", "val"), "test": ("test",)}


@dataclass
class Sniffed:
    """What `finetune init` found in the data."""

    path: Path
    format: str
    columns: dict[str, list[str]]  # name -> values as text (the sample read)
    settings: dict[str, Any] = field(default_factory=dict)  # data.* keys the file needs
    notes: list[str] = field(default_factory=list)  # what was chosen and why


def _encoding(raw: bytes) -> str:
    if raw.startswith(b"\xef\xbb\xbf"):
        return "utf-8-sig"
    try:
        raw.decode("utf-8")
        return "utf-8"
    except UnicodeDecodeError:
        return "latin-1"


def _rows(text: str, delimiter: str, quoting: int) -> list[list[str]]:
    return list(csv.reader(text.splitlines(), delimiter=delimiter, quoting=quoting))


def sniff_table(path: Path, limit: int = 64 << 20) -> Sniffed:
    """csv/tsv: delimiter, quoting (the parse whose rows all have one width), header, encoding; the
    whole file is read (up to `limit` bytes) so that every label is seen.

    Raises:
        UserError: no consistent table (ragged rows with every quoting), or an empty file.
    """
    raw = path.read_bytes()[:limit]
    encoding = _encoding(raw[: 1 << 20])
    lines = raw.decode(encoding, errors="replace").splitlines()
    if len(raw) == limit:
        lines = lines[:-1]  # a line cut at the limit
    if not any(x.strip() for x in lines):
        raise UserError(f"{path} is empty")
    text = "\n".join(lines)
    delimiter = "\t" if path.suffix.lower() == ".tsv" or text.count("\t") > text.count(",") else ","
    candidates = [("minimal", csv.QUOTE_MINIMAL), ("none", csv.QUOTE_NONE)]
    parsed = {name: _rows(text, delimiter, q) for name, q in candidates}
    widths = {name: {len(r) for r in rows if r} for name, rows in parsed.items()}
    consistent = [name for name in ("minimal", "none") if len(widths[name]) == 1 and max(widths[name]) > 1]
    if not consistent:
        what = "tabs" if delimiter == "\t" else "commas"
        raise UserError(
            f"{path}: rows have different numbers of {what} with and without quote handling; set data.format, "
            "data.delimiter and data.quoting by hand"
        )
    counts = {name: sum(1 for r in parsed[name] if r) for name in consistent}
    # CSV-style quoting shows as doubled quotes inside quoted fields; without them a quote is text
    # (and a quote-aware parse that joins lines into one row is wrong anyway)
    csv_style = '""' in text or "none" not in consistent
    quoting = "minimal" if "minimal" in consistent and counts["minimal"] == max(counts.values()) and csv_style \
        else consistent[-1]
    rows = [r for r in parsed[quoting] if r]
    first = rows[0]
    header = len(rows) > 1 and csv.Sniffer().has_header(text[:20000])
    # a header names columns: short, non-empty cells that do not come back as values further down
    later = [set(r[i] for r in rows[1:2000] if len(r) > i) for i in range(len(first))]
    if header and any(not c.strip() or len(c) > 40 or c in later[i] for i, c in enumerate(first)):
        header = False
    names = [c.strip().lstrip("\ufeff") or f"column{i}" for i, c in enumerate(first)] if header else \
        [f"column{i}" for i in range(len(first))]  # fmt: skip
    body = rows[1:] if header else rows
    columns = {n: [r[i] for r in body] for i, n in enumerate(names)}
    settings: dict[str, Any] = {"format": "tsv" if delimiter == "\t" else "csv", "quoting": quoting, "header": header}
    if delimiter == "\t" and path.suffix.lower() != ".tsv":
        settings["delimiter"] = "\t"
    if encoding != "utf-8":
        settings["encoding"] = encoding
    if not header:
        settings["column_names"] = names
    s = Sniffed(path, settings["format"], columns, settings)
    s.notes.append(f"read as {settings['format']}, quoting {quoting}, {'a' if header else 'no'} header, {encoding}")
    return s


def sniff_records(path: Path, limit: int = 4000) -> Sniffed:
    """jsonl/json/parquet: records with named fields.

    Raises:
        UserError: unreadable records, or records that are not objects.
    """
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            records = pq.read_table(path).slice(0, limit).to_pylist()
        elif suffix == ".jsonl":
            records = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()[:limit] if x.strip()]
        else:
            records = json.loads(path.read_text(encoding="utf-8"))[:limit]
    except (ValueError, OSError, TypeError) as exc:
        raise UserError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None
    if not records or not all(isinstance(r, dict) for r in records):
        raise UserError(f"{path}: expected records (objects with named fields), one per text")
    names = list(records[0])
    columns = {n: [r.get(n) if isinstance(r.get(n), list) else str(r.get(n, "")) for r in records] for n in names}
    return Sniffed(path, suffix.lstrip("."), columns, {"format": suffix.lstrip(".")}, [f"read as {suffix} records"])


def _mean_len(values: list[Any]) -> float:
    return statistics.fmean(len(str(v)) for v in values) if values else 0.0


def _is_number(v: Any) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def _label_parts(values: list[Any]) -> set[str]:
    return {str(x).strip() for v in values for x in (v if isinstance(v, list) else str(v).split(","))}


def choose_columns(s: Sniffed) -> dict[str, Any]:
    """The text, pair and label columns and the problem type, with the reasons in `s.notes`.

    Raises:
        UserError: no column to learn from, or no label column, naming the candidates.
    """
    cols = s.columns
    n = len(next(iter(cols.values())))
    label = next((c for c in cols if c.strip().lower().lstrip("#").strip() in LABEL_NAMES), None)
    if label is None:  # labels: few distinct values (or few distinct parts of comma-joined values)
        few = [c for c in cols if 2 <= len(_label_parts(cols[c])) <= max(2, min(200, n // 5))]
        label = min(few, key=lambda c: _mean_len(cols[c]), default=None)
    texts = sorted((c for c in cols if c != label and not all(_is_number(v) for v in cols[c][:200])),
                   key=lambda c: -_mean_len(cols[c]))  # fmt: skip
    if not texts or label is None:
        raise UserError(f"{s.path}: cannot tell the {'label' if texts else 'text'} column among {list(cols)}; "
                        "write the config by hand (data.text_column, data.label_column)")  # fmt: skip
    chosen: dict[str, Any] = {"text_column": texts[0], "label_column": label}
    if len(texts) > 1 and _mean_len(cols[texts[1]]) >= 0.5 * _mean_len(cols[texts[0]]) and any(
        h in c.lower() for c in texts[:2] for h in PAIR_HINTS
    ):  # two texts of comparable length, one named like a second text: sentence pairs
        first, second = sorted(texts[:2])
        chosen.update(text_column=first, text_pair_column=second)
        s.notes.append(f"texts: columns {first!r} and {second!r} as a sentence pair; remove data.text_pair_column "
                       "to use one text")  # fmt: skip
    else:
        s.notes.append(f"text: column {texts[0]!r} (the longest texts, {_mean_len(cols[texts[0]]):.0f} characters "
                       "on average); change data.text_column")  # fmt: skip
    values = cols[label]
    parts = _label_parts(values)
    multi = any(isinstance(v, list) or "," in str(v) for v in values) and len(parts) <= 200
    if multi:
        chosen["problem_type"] = "multi_label_classification"
        if not any(isinstance(v, list) for v in values):
            chosen["label_delimiter"] = ","
        s.notes.append(f"labels: column {label!r} holds several labels per text ({len(parts)} labels): multi-label")
    elif all(_is_number(v) for v in values) and any(not float(v).is_integer() for v in values):
        chosen["problem_type"] = "regression"
        s.notes.append(f"labels: column {label!r} holds {len(set(values))} distinct numbers: regression")
    else:
        s.notes.append(f"labels: column {label!r}, {len(set(map(str, values)))} classes; change data.label_column")
    return chosen


def sniff_folders(path: Path) -> Sniffed:
    """One sub-folder per label, one file per document (the first 5,000 characters of each)."""
    sub = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    texts = {n: [f.read_text(errors="replace")[:5000] for f in sorted((path / n).glob("*")) if f.is_file()]
             for n in sub}  # fmt: skip
    columns = {"text": [t for v in texts.values() for t in v], "label": [n for n, v in texts.items() for _ in v]}
    return Sniffed(path, "folder", columns, notes=[f"one folder per label: {sub}; one file per document"])


def _names_file(folder: Path, labels: set[str]) -> Path | None:
    """A text file beside the data naming the labels by line, when the labels are ids 0..n-1 into it."""
    if not labels or not all(x.isdigit() for x in labels):
        return None
    for p in sorted(folder.glob("*.txt")):
        lines = [x for x in p.read_text(errors="replace").splitlines() if x.strip()]
        if 1 < len(lines) <= 1000 and max(int(x) for x in labels) < len(lines) and all(len(x) < 60 for x in lines):
            return p
    return None


def _split_files(folder: Path) -> dict[str, Path]:
    tables = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in tables)
    found: dict[str, Path] = {}
    for p in files:
        stem = p.stem.lower()
        split = next((k for k, words in SPLIT_WORDS.items() if any(stem.startswith(w) for w in words)), None)
        if split is None and stem.startswith("train"):
            split = "train"
        if split is not None:
            found.setdefault(split, p)
    return found


def suggest(n_train: int) -> tuple[float, int]:
    """(learning rate, epochs) for a small encoder: fewer rows, more passes."""
    epochs = 10 if n_train < 1000 else 5 if n_train < 5000 else 3 if n_train < 20000 else 2
    return 1e-4, epochs


def _yaml(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render(model: str, out_name: str, data: dict[str, Any], train: dict[str, Any], notes: list[str],
           problem_type: str | None) -> str:  # fmt: skip
    """The config text: launch line, schema modeline, the reasons as comments, then the sections."""
    lines = [f"# accelerate launch --cpu finetune/train.py --config {out_name}",
             "# yaml-language-server: $schema=configs/schema.json",
             "# written by `finetune init`; what it found:"] + [f"#   {n}" for n in notes]  # fmt: skip
    lines += ["run:", f"  output_dir: runs/{Path(out_name).stem}", "  seed: 42", "model:", f"  name_or_path: {model}"]
    if problem_type:
        lines.append(f"  problem_type: {problem_type}")
    lines.append("data:")
    lines += [f"  {k}: {_yaml(v)}" for k, v in data.items()]
    lines.append("train:")
    lines += [f"  {k}: {_yaml(v)}" for k, v in train.items()]
    return "\n".join(lines) + "\n"


def init_config(data_path: Path, out: Path, model: str = "minilm-l6", force: bool = False) -> list[str]:
    """Write a config for `data_path` to `out`; return the notes printed to the user.

    Raises:
        UserError: unreadable or ambiguous data, or `out` exists without `force`.
    """
    if out.exists() and not force:
        raise UserError(f"{out} exists; choose another -o or pass --force to replace it")
    data_path = data_path.resolve()
    if not data_path.exists():
        raise UserError(f"{data_path} does not exist")
    data: dict[str, Any] = {"data_dir": str(data_path.parent)}
    splits: dict[str, Path] = {}
    notes: list[str] = []
    if data_path.is_dir() and any(p.is_dir() for p in data_path.iterdir()):
        s, chosen = sniff_folders(data_path), {}
        data.update(train_file=data_path.name, encoding_errors="replace")
        notes += s.notes
    else:
        if data_path.is_dir():
            splits = _split_files(data_path)
            if "train" not in splits:
                raise UserError(f"{data_path}: no train* file (csv/tsv/jsonl/json/parquet) and no label sub-folders")
            data["data_dir"] = str(data_path)
        else:
            splits = {"train": data_path}
        train_file = splits["train"]
        tabular = train_file.suffix.lower() not in (".jsonl", ".json", ".parquet")
        s = sniff_table(train_file) if tabular else sniff_records(train_file)
        chosen = choose_columns(s)
        data.update(train_file=train_file.name, **s.settings)
        notes += s.notes
        for split, p in splits.items():
            if split != "train":
                data[f"{split}_file"] = p.name
                notes.append(f"{split}: {p.name}")
        data.update({k: v for k, v in chosen.items() if k != "problem_type"})
        names = _names_file(train_file.parent, _label_parts(s.columns[chosen["label_column"]]))
        if names is not None:
            data["labels_file"] = str(names)
            notes.append(f"label names: {names.name} (line number = label id)")
    problem_type = chosen.get("problem_type")
    if "validation" not in splits:
        data["validation_split"] = 0.1
        notes.append("no validation file: 10% of train held out (data.validation_split)")
    tok = build_tokenizer(load_config_for_tokenizer(model))
    text_col = chosen.get("text_column", "text")
    stride = max(1, len(s.columns[text_col]) // 2000)  # ~2,000 texts spread over the file
    sample = [str(t) for t in s.columns[text_col][::stride]]
    pair_col = chosen.get("text_pair_column")  # a pair is one model row: its length is both texts together
    pairs = [str(t) for t in s.columns[pair_col][::stride]] if pair_col else None
    lengths = sorted(len(x) for x in tok(sample, pairs, truncation=False)["input_ids"])
    p99 = lengths[min(len(lengths) - 1, math.ceil(0.99 * len(lengths)) - 1)]
    data["max_length"] = min(512, max(32, 16 * math.ceil(p99 / 16)))
    notes.append(f"max_length {data['max_length']}: the 99th percentile of {len(lengths)} texts is {p99} tokens")
    n_train = len(next(iter(s.columns.values())))
    lr, epochs = suggest(n_train)
    train = {"epochs": epochs, "micro_batch_size": 16 if data["max_length"] > 256 else 32, "learning_rate": lr,
             "warmup_ratio": 0.06, "eval_every_steps": 200}  # fmt: skip
    notes.append(f"{n_train} training rows read: {epochs} epochs at learning rate {lr:g}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(model, str(out), data, train, notes, problem_type))
    load_config(out)  # what was written validates
    return notes


def load_config_for_tokenizer(model: str) -> Any:
    """A minimal config naming `model`, to build its tokenizer the way training will."""
    return validate_config({"run": {"output_dir": "unused"}, "model": {"name_or_path": model},
                            "data": {"train_file": "unused"}})  # fmt: skip
