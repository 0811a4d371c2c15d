"""`finetune init DATA`, first half: what a data file or folder holds, sniffed as people have it.

Delimiter, header, quoting, encoding, a folder per label, a text file per label; formats it cannot read
(spreadsheets, archives, documents) are named, by their first bytes and by extension, with what to do
instead. The text, optional pair and label columns (one label column, or one 0/1 column per label) and
the problem type are chosen with the reason said, and the split files found. write.py writes the
config from it.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import re
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from finetune.config.tasks import MULTI, REGRESSION
from finetune.core.errors import UserError
from finetune.data.reading import FileOptions, count_rows, iter_rows, table_columns
from finetune.init.formats import check_format

LABEL_NAMES = ("label", "labels", "class", "category", "target", "y", "score", "quality", "sentiment", "intent")
SPLIT_WORDS = {"validation": ("dev", "valid", "validation", "val"), "test": ("test",)}
TABLES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
RECORDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
# a second text named after its first (NLI, QA, retrieval); numbered names (sentence1/sentence2,
# text_a/text_b, '#1 String'/'#2 String') are recognised by pattern
PAIR_NAMES = (
    ("premise", "hypothesis"),
    ("sentence", "hypothesis"),
    ("text", "hypothesis"),
    ("question", "answer"),
    ("question", "sentence"),
    ("question", "passage"),
    ("query", "passage"),
    ("query", "document"),
    ("claim", "evidence"),
)
# names a header line gives its columns (letters only: sentence1 -> sentence)
COLUMN_NAMES = {
    *LABEL_NAMES,
    *(n for p in PAIR_NAMES for n in p),
    "text",
    "tweet",
    "review",
    "comment",
    "content",
    "body",
    "title",
    "document",
    "id",
    "index",
    "tags",
    "labels",
    "emotions",
    "topic",
}
DELIMITERS = (",", ";", "|")  # how multi-label cells join their labels
FLAGS = {"0", "1", "0.0", "1.0", "true", "false"}  # the values of a 0/1 column, as data/build.py reads them


@dataclass
class Sniffed:
    """What `finetune init` found in the data."""

    path: Path
    format: str
    columns: dict[str, list[str]]  # name -> values as text (the sample read)
    settings: dict[str, Any] = field(default_factory=dict)  # data.* keys the file needs
    notes: list[str] = field(default_factory=list)  # what was chosen and why
    mean_tokens: float = 0.0  # the sampled rows' mean token length (a pair: both texts), for the timed step


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
        UserError: no consistent table (ragged rows with every quoting), an empty file, or one that training's
            reader cannot parse with the keys guessed.
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
    # (and a quote-aware parse that joins lines into one row is wrong anyway). A comma file with no quote at all
    # reads alike both ways: the standard (minimal) then, which other files of its kind (a test file written by
    # a CSV writer, `finetune predict`'s input) need for their quoted commas
    csv_style = '""' in text or (delimiter == "," and '"' not in text) or "none" not in consistent
    quoting = (
        "minimal"
        if "minimal" in consistent and counts["minimal"] == max(counts.values()) and csv_style
        else consistent[-1]
    )
    rows = [r for r in parsed[quoting] if r]
    first = rows[0]
    # csv.Sniffer guesses from types and lengths, and misses a header over text columns alone
    # ("text<TAB>labels" above "a sentence<TAB>joy|anger"): a usual column name is a header too
    named = any(re.sub(r"[^a-z]", "", c.lower()) in COLUMN_NAMES for c in first)
    header = len(rows) > 1 and (named or csv.Sniffer().has_header(text[:20000]))
    # a header names columns: short, non-empty cells that do not come back as values further down
    later = [set(r[i] for r in rows[1:2000] if len(r) > i) for i in range(len(first))]
    if header and any(not c.strip() or len(c) > 40 or c in later[i] for i, c in enumerate(first)):
        header = False
    settings: dict[str, Any] = {"format": "tsv" if delimiter == "\t" else "csv", "quoting": quoting, "header": header}
    if delimiter == "\t" and path.suffix.lower() != ".tsv":
        settings["delimiter"] = "\t"
    if encoding != "utf-8":
        settings["encoding"] = encoding
    if not header:
        settings["column_names"] = [f"column{i}" for i in range(len(first))]
    # the columns as training will read them with these keys (odd bytes replaced, as in the guess above)
    opts = replace(FileOptions.from_keys(settings), encoding_errors="replace")
    # a file cut at the limit: as many rows as the guess saw
    body = len(rows) - (1 if header else 0) if len(raw) == limit else None
    columns = table_columns(path, settings["format"], opts, nrows=body)
    s = Sniffed(path, settings["format"], columns, settings)
    s.notes.append(f"read as {settings['format']}, quoting {quoting}, {'a' if header else 'no'} header, {encoding}")
    return s


def sniff_records(path: Path, fmt: str | None = None, limit: int = 64 << 20) -> Sniffed:
    """jsonl/json/parquet (by extension, or `fmt`): records with named fields, the whole file (jsonl: up to `limit`
    bytes, parquet: up to `limit` // 256 rows) so that every label is seen, as `sniff_table` does; a file sorted
    by label showed init only its first classes when the first 4,000 records were read.

    Raises:
        UserError: unreadable records, or records that are not objects.
    """
    suffix = f".{fmt}" if fmt else path.suffix.lower()
    kind, opts = suffix.lstrip("."), FileOptions.from_keys({})
    source: Path | io.StringIO = path
    if kind == "jsonl":
        with path.open("rb") as f:
            raw = f.read(limit)
        if len(raw) == limit:
            raw = raw[: raw.rfind(b"\n") + 1]  # a line cut at the limit
        try:
            source = io.StringIO(raw.decode(opts.encoding))
        except UnicodeDecodeError as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
    rows = iter_rows(source, kind, opts, str(path))
    records = list(itertools.islice(rows, limit // 256) if kind == "parquet" else rows)
    if not records or not all(isinstance(r, dict) for r in records):
        raise UserError(f"{path}: expected records (objects with named fields), one per text")
    names = list(records[0])
    columns = {n: [r.get(n) if isinstance(r.get(n), list) else str(r.get(n, "")) for r in records] for n in names}
    return Sniffed(path, suffix.lstrip("."), columns, {"format": suffix.lstrip(".")}, [f"read as {suffix} records"])


def split_rows(path: Path, s: Sniffed, sampled: int) -> int:
    """The rows of a train or validation file, counted as training will read it with the sniffed keys (init
    reads a sample); `sampled` when the file cannot be read whole."""
    if s.format not in ("csv", "tsv", "jsonl", "json", "parquet"):
        return sampled
    try:
        return count_rows(path, s.format, replace(FileOptions.from_keys(s.settings), encoding_errors="replace"))
    except UserError:
        return sampled


def _mean_len(values: list[Any]) -> float:
    return statistics.fmean(len(str(v)) for v in values) if values else 0.0


def _is_number(v: Any) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def _json_list(text: str) -> bool:
    try:
        return isinstance(json.loads(text), list)
    except ValueError:
        return False


def _delimiter(values: list[Any]) -> str | None:
    """How a label column joins several labels per cell: "list" (list values or JSON lists, which
    data/build.py reads as they are), one of DELIMITERS, or None (one label per cell)."""
    if any(isinstance(v, list) for v in values):
        return "list"
    texts = [str(v).strip() for v in values]
    if texts and all(t.startswith("[") and t.endswith("]") for t in texts) and all(map(_json_list, texts)):
        return "list"
    return next((d for d in DELIMITERS if any(d in t for t in texts)), None)


def _label_parts(values: list[Any], delimiter: str | None = None) -> set[str]:
    """The distinct labels of a column whose cells join them with `delimiter` (see `_delimiter`)."""
    out: set[str] = set()
    for v in values:
        if delimiter == "list":
            items = v if isinstance(v, list) else json.loads(str(v))
        else:
            items = str(v).split(delimiter) if delimiter else [v]
        out.update(str(x).strip() for x in items if str(x).strip())
    return out


def _flag_columns(cols: dict[str, list[Any]]) -> list[str]:
    """Columns holding only 0/1 (or true/false), not 1 in every row (nothing to learn, and data/build.py refuses
    it): one column per label, when there are several."""
    found: list[str] = []
    for c, v in cols.items():
        flags = {str(x).strip().lower() for x in v}
        if flags and flags <= FLAGS and not flags <= {"1", "1.0", "true"}:
            found.append(c)
    return found


def _normal_name(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _numbered(a: str, b: str) -> bool:
    """sentence1/sentence2, text_a/text_b, '#1 String'/'#2 String': one character apart, 1/2 or a/b."""
    a, b = _normal_name(a), _normal_name(b)
    diff = [(x, y) for x, y in zip(a, b, strict=False) if x != y]
    return len(a) == len(b) and len(diff) == 1 and diff[0] in (("1", "2"), ("a", "b"))


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def _overlap(first: list[str], second: list[str]) -> float:
    """Mean share of the smaller text's words found in the other text of the row."""
    pairs = zip(map(_words, first), map(_words, second), strict=True)
    shares = [len(a & b) / max(1, min(len(a), len(b))) for a, b in pairs]
    return statistics.fmean(shares) if shares else 0.0


def _pair(cols: dict[str, list[Any]], texts: list[str], header: bool) -> tuple[str, str, str] | None:
    """(first, second, why) when two text columns are a sentence pair: by name (numbered, or a known
    first/second such as premise/hypothesis; not the column0, column1, ... init gives a file without a
    header), else by content (texts of similar length that share words row by row far more than with
    other rows' texts)."""
    longest = max((_mean_len(cols[c]) for c in texts), default=0.0)
    named: list[tuple[str, str, str]] = []
    # `texts` is in file order: the first of a numbered pair comes first
    for i, a in enumerate(texts if header else []):
        for b in texts[i + 1 :]:
            na, nb = _normal_name(a), _normal_name(b)
            if _numbered(a, b):
                named.append((a, b, "numbered names, as GLUE's sentence1/sentence2"))
            elif (na, nb) in PAIR_NAMES or (nb, na) in PAIR_NAMES:
                first, second = (a, b) if (na, nb) in PAIR_NAMES else (b, a)
                named.append((first, second, f"named {first!r} and {second!r}"))
    # a numbered pair of short codes (STS-B's source1/source2 beside sentence1/sentence2) is not the text
    named = [p for p in named if max(_mean_len(cols[p[0]]), _mean_len(cols[p[1]])) >= 0.5 * longest]
    if named:
        return max(named, key=lambda p: _mean_len(cols[p[0]]) + _mean_len(cols[p[1]]))
    two = sorted(sorted(texts, key=lambda c: -_mean_len(cols[c]))[:2], key=texts.index)
    if len(two) < 2:
        return None
    a, b = ([str(x) for x in cols[c][:2000]] for c in two)
    short, long_ = sorted((_mean_len(a), _mean_len(b)))
    wordy = all(statistics.median(len(x.split()) for x in v) >= 3 for v in (a, b))
    same, other = _overlap(a, b), _overlap(a, b[len(b) // 2 :] + b[: len(b) // 2])
    if wordy and short >= 0.5 * long_ and same >= 0.3 and same >= 1.5 * other:
        return (
            two[0],
            two[1],
            f"by content: texts of similar length sharing {same:.0%} of their words row by row "
            f"({other:.0%} with other rows)",
        )
    return None


def _choose_texts(s: Sniffed, cols: dict[str, list[Any]], labels: list[str]) -> dict[str, Any]:
    """The text column (the longest texts) or a text pair, said in `s.notes`.

    Raises:
        UserError: no column of text.
    """
    texts = [c for c in cols if c not in labels and not all(_is_number(v) for v in cols[c][:200])]
    if not texts:
        raise UserError(
            f"{s.path}: cannot tell the text column among {list(cols)}; write the config by hand "
            "(data.text_column, data.label_column)"
        )
    pair = _pair(cols, texts, s.settings.get("header", True))
    if pair is not None:
        first, second, why = pair
        chosen = {"text_column": first, "text_pair_column": second}
        s.notes.append(
            f"texts: columns {first!r} and {second!r} as a sentence pair ({why}): the model reads both "
            "in one row; remove data.text_pair_column to use one text"
        )
    else:
        chosen = {"text_column": max(texts, key=lambda c: _mean_len(cols[c]))}
        s.notes.append(
            f"text: column {chosen['text_column']!r} (the longest texts, "
            f"{_mean_len(cols[chosen['text_column']]):.0f} characters on average); change data.text_column"
        )
    unused = [c for c in texts if c not in chosen.values()]
    if unused:
        s.notes.append(f"not used: text column(s) {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    return chosen


def _label_kind(s: Sniffed, label: str) -> dict[str, Any]:
    """The problem type a label column says, and why: several labels per cell (multi-label), real
    numbers (regression), else classes."""
    values = s.columns[label]
    delimiter = _delimiter(values)
    parts = _label_parts(values, delimiter) if delimiter else set()
    if delimiter and len(parts) <= 200 and _mean_len(list(parts)) < 40:
        how = "lists" if delimiter == "list" else f"labels joined by {delimiter!r}"
        s.notes.append(f"labels: column {label!r} holds {how}, {len(parts)} labels: several per text, multi-label")
        return {"label_column": label, "problem_type": MULTI} | (
            {} if delimiter == "list" else {"label_delimiter": delimiter}
        )
    distinct = set(map(str, values))
    if all(_is_number(v) for v in values):
        numbers = [float(v) for v in values]
        if any(not x.is_integer() for x in numbers):
            s.notes.append(
                f"labels: column {label!r} holds {len(distinct)} distinct numbers from {min(numbers):g} "
                f"to {max(numbers):g}, not all whole: a score, regression (one output, MSE)"
            )
            return {"label_column": label, "problem_type": REGRESSION}
        hint = " (whole numbers: classes; for a score set model.problem_type=regression)" if len(distinct) > 2 else ""
        s.notes.append(
            f"labels: column {label!r}, {len(distinct)} classes{hint}, one per text: single-label; "
            "change data.label_column"
        )
        return {"label_column": label}
    s.notes.append(
        f"labels: column {label!r}, {len(distinct)} classes, one per text: single-label; change data.label_column"
    )
    return {"label_column": label}


def choose_columns(s: Sniffed) -> dict[str, Any]:
    """The text, pair and label columns (or one 0/1 column per label) and the problem type, with the
    reasons in `s.notes`.

    Raises:
        UserError: no column to learn from, or no label column, naming the candidates.
    """
    cols = s.columns
    n = len(next(iter(cols.values())))
    label = next((c for c in cols if c.strip().lower().lstrip("#").strip() in LABEL_NAMES), None)
    flags = _flag_columns(cols)
    if label is None and len(flags) >= 2:  # SemEval E-c, Jigsaw, GoEmotions' raw files: a 0/1 column per label
        chosen = _choose_texts(s, cols, flags)
        per_text = statistics.fmean(
            sum(str(cols[c][i]).strip().lower() in ("1", "1.0", "true") for c in flags) for i in range(n)
        )
        s.notes.append(
            f"labels: {len(flags)} columns hold only 0/1, one per label {flags[:12]}"
            f"{' ...' if len(flags) > 12 else ''}: multi-label, {per_text:.1f} labels per text "
            "(data.label_columns)"
        )
        ones = [c for c, v in cols.items() if v and {str(x).strip().lower() for x in v} <= {"1", "1.0", "true"}]
        if ones:
            s.notes.append(f"left out: column(s) {ones} hold 1 in every row (nothing to learn)")
        return chosen | {"label_columns": flags, "problem_type": MULTI}
    if label is None:  # labels: few distinct values (or few distinct parts of joined values)
        few = [c for c in cols if 2 <= len(_label_parts(cols[c], _delimiter(cols[c]))) <= max(2, min(200, n // 5))]
        label = min(few, key=lambda c: _mean_len(cols[c]), default=None)
    if label is None:  # else the one column of real numbers (a score under a name of its own)
        reals = [c for c, v in cols.items() if all(map(_is_number, v)) and any(not float(x).is_integer() for x in v)]
        label = reals[0] if len(reals) == 1 else None
    if label is None:
        texts = [c for c in cols if not all(_is_number(v) for v in cols[c][:200])]
        raise UserError(
            f"{s.path}: cannot tell the {'label' if texts else 'text'} column among {list(cols)}; "
            "write the config by hand (data.text_column, data.label_column)"
        )
    chosen = _choose_texts(s, cols, [label])
    chosen |= _label_kind(s, label)
    others = [c for c in flags if c != label]
    if len(others) >= 2:
        s.notes.append(
            f"columns {others[:12]} also hold only 0/1: for one label per column set data.label_columns "
            "and model.problem_type=multi_label_classification"
        )
    return chosen


def sniff_folders(path: Path) -> Sniffed:
    """One sub-folder per label, one file per document (the first 5,000 characters of each)."""
    sub = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    texts = {
        n: [f.read_text(errors="replace")[:5000] for f in sorted((path / n).glob("*")) if f.is_file()] for n in sub
    }
    columns = {"text": [t for v in texts.values() for t in v], "label": [n for n, v in texts.items() for _ in v]}
    return Sniffed(path, "folder", columns, notes=[f"one folder per label: {sub}; one file per document"])


# files beside the data that describe it rather than hold texts
DOC_STEMS = ("readme", "license", "licence", "source", "copying", "notice", "changelog", "citation")
DOC_SUFFIXES = (".md", ".yaml", ".yml", ".py", ".sh", ".html", ".pdf", ".bib", ".cfg", ".ini")


def label_file_groups(folder: Path) -> list[dict[str, Path]]:
    """Groups of text files, one per label, that `data.label_files` reads: files sharing a name and
    differing by extension (rt-polarity.pos, rt-polarity.neg: labels pos, neg), else files sharing an
    extension and differing by name (positive.txt, negative.txt: labels positive, negative)."""
    files = [
        p
        for p in sorted(folder.iterdir())
        if p.is_file()
        and not p.name.startswith(".")
        and not p.stem.lower().startswith(DOC_STEMS)
        and p.suffix.lower() not in DOC_SUFFIXES + TABLES
    ]
    by_stem: dict[str, list[Path]] = {}
    by_suffix: dict[str, list[Path]] = {}
    for p in files:
        by_stem.setdefault(p.stem, []).append(p)
        by_suffix.setdefault(p.suffix.lower(), []).append(p)
    groups = [{p.suffix.lstrip("."): p for p in g} for g in by_stem.values() if len(g) > 1 and all(p.suffix for p in g)]
    if not groups:
        groups = [{p.stem: p for p in g} for g in by_suffix.values() if len(g) > 1]
    return [g for g in groups if all(g) and len(g) <= 200]


def sniff_label_files(folder: Path, group: dict[str, Path]) -> Sniffed:
    """One text file per label, one text per line (blank lines skipped), as `data.label_files` reads it.

    Raises:
        UserError: a label file that is not text (a spreadsheet, an archive, a binary file).
    """
    texts: dict[str, list[str]] = {}
    encodings: set[str] = set()
    for label, p in group.items():
        check_format(p)
        raw = p.read_bytes()[: 64 << 20]
        if not raw.isascii():  # ASCII reads the same in every encoding below
            encodings.add(_encoding(raw).replace("utf-8-sig", "utf-8"))
        texts[label] = [x.strip() for x in raw.decode(_encoding(raw), errors="replace").splitlines() if x.strip()]
    columns = {"text": [t for v in texts.values() for t in v], "label": [n for n, v in texts.items() for _ in v]}
    settings: dict[str, Any] = {"label_files": {label: p.name for label, p in group.items()}}
    if encodings == {"latin-1"}:
        settings["encoding"] = "latin-1"
    elif len(encodings) > 1:  # no one encoding reads them all: odd bytes become U+FFFD
        settings["encoding_errors"] = "replace"
    elif any(p.read_bytes()[:3] == b"\xef\xbb\xbf" for p in group.values()):
        settings["encoding"] = "utf-8-sig"  # a BOM is not text (and utf-8-sig reads files without one too)
    counts = ", ".join(f"{label} {len(v)}" for label, v in texts.items())
    named = "extensions" if all(p.suffix.lstrip(".") == label for label, p in group.items()) else "names"
    notes = [
        f"one text file per label, one text per line (data.label_files; labels: the file {named}): {counts} "
        f"lines; encoding {settings.get('encoding', 'utf-8')}{' (errors replaced)' if len(encodings) > 1 else ''}"
    ]
    return Sniffed(folder, "label_files", columns, settings, notes)


def _names_file(folder: Path, labels: set[str]) -> Path | None:
    """A text file beside the data naming the labels by line, when the labels are ids 0..n-1 into it."""
    if not labels or not all(x.isdigit() for x in labels):
        return None
    for p in sorted(folder.glob("*.txt")):
        lines = [x for x in p.read_text(errors="replace").splitlines() if x.strip()]
        if 1 < len(lines) <= 1000 and max(int(x) for x in labels) < len(lines) and all(len(x) < 60 for x in lines):
            return p
    return None


def _split_of(stem: str) -> str | None:
    stem = stem.lower()
    split = next((k for k, words in SPLIT_WORDS.items() if any(stem.startswith(w) for w in words)), None)
    return "train" if split is None and stem.startswith("train") else split


def _split_files(folder: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for p in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in TABLES):
        split = _split_of(p.stem)
        if split is not None:
            found.setdefault(split, p)
    return found


def _label_files_layout(folder: Path, groups: list[dict[str, Path]]) -> tuple[Sniffed, dict[str, Any]]:
    """Sniff the one set of text files per label of a folder (several sets: a UserError)."""
    if len(groups) > 1:
        names = [sorted(p.name for p in g.values()) for g in groups]
        raise UserError(
            f"{folder}: several sets of one-text-file-per-label files {names}; run finetune init on a "
            "folder holding one set"
        )
    s = sniff_label_files(folder, groups[0])
    return s, {"data_dir": str(folder), **s.settings}


def _train_table(path: Path, folder_groups: list[dict[str, Path]]) -> tuple[Sniffed, dict[str, Any]]:
    """Sniff a train file: records, a table, or (a file that is no table) one of a folder's text files per label.

    Raises:
        UserError: an unreadable format, or a file that is neither a table nor a text file per label.
    """
    fmt = check_format(path)
    if fmt is not None or path.suffix.lower() in RECORDS:
        s = sniff_records(path, fmt)
    else:
        try:
            s = sniff_table(path)
        except UserError:
            mine = [g for g in folder_groups if path in g.values()]
            if not mine:
                raise
            s, data = _label_files_layout(path.parent, mine)
            s.notes.insert(0, f"{path.name} is no table: one of the text files per label beside it")
            return s, data
    return s, {"data_dir": str(path.parent), "train_file": path.name, **s.settings}


def sniff_data(data_path: Path) -> tuple[Sniffed, dict[str, Any], dict[str, Path]]:
    """What is in a file or folder: the sniffed texts and labels (columns chosen, problem type said),
    the data.* keys that read it, and its split files.

    Raises:
        UserError: unreadable or ambiguous data, or a folder with no layout `finetune train` reads.
    """
    if data_path.is_dir() and any(p.is_dir() and not p.name.startswith(".") for p in data_path.iterdir()):
        s = sniff_folders(data_path)
        return s, {"data_dir": str(data_path.parent), "train_file": data_path.name, "encoding_errors": "replace"}, {}
    folder = data_path if data_path.is_dir() else data_path.parent
    # a set of files that differ by a split name (train/dev/test) is splits, never labels
    groups = [
        g
        for g in label_file_groups(folder)
        if not any(re.search(r"(^|[^a-z])(train|dev|test|valid|validation|val)([^a-z]|$)", x.lower()) for x in g)
    ]
    splits = _split_files(data_path) if data_path.is_dir() else {"train": data_path}
    if "train" not in splits:
        if groups:
            s, data = _label_files_layout(data_path, groups)
            return s, data, {}
        others = sorted(p for p in data_path.iterdir() if p.is_file() and _split_of(p.stem) == "train")
        for p in others:  # train.xlsx: say what it is rather than that there is no train file
            check_format(p)
        raise UserError(
            f"{data_path}: no train* file (csv/tsv/jsonl/json/parquet), no label sub-folders and no text "
            "file per label (such as rt-polarity.pos, rt-polarity.neg)"
        )
    s, data = _train_table(splits["train"], groups)
    if "label_files" in data:
        return s, data, {}
    if data_path.is_dir():
        data["data_dir"] = str(data_path)
    for split, p in splits.items():
        if split != "train":
            check_format(p)
            data[f"{split}_file"] = p.name
            s.notes.append(f"{split}: {p.name}")
    chosen = choose_columns(s)
    data |= chosen
    if "label_column" in chosen:
        values = s.columns[chosen["label_column"]]
        names = _names_file(
            folder, _label_parts(values, _delimiter(values) if chosen.get("problem_type") == MULTI else None)
        )
        if names is not None:
            data["labels_file"] = str(names)
            s.notes.append(f"label names: {names.name} (line number = label id)")
    return s, data, splits
