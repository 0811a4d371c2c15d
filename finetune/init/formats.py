"""What a file is, when `finetune init` cannot read it: spreadsheets, archives, documents and binary
formats, told by their first bytes and then by their extension, each with what to do instead.

Kept apart from sniff.py (which sniffs what it can read) because these are tables of facts about
other programs' formats, not decisions about a dataset.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from finetune.core.errors import UserError

_SPREADSHEET = "save it as CSV (Excel or LibreOffice: File > Save As > CSV UTF-8) and run finetune init on the .csv"
_ARCHIVE = "extract it and run finetune init on the file or folder inside"
_DOCUMENT = (
    "put its texts in a csv/tsv file (a text and its label per row) or in a folder per label and run "
    "finetune init on that"
)
_BINARY = (
    "write it out as csv, jsonl or parquet (pandas: df.to_csv('data.csv', index=False)) and run finetune init on that"
)
# a format `finetune init` cannot read, by extension: what it is, what to do instead
UNSUPPORTED: dict[str, tuple[str, str]] = {
    "xlsx": ("an Excel workbook", _SPREADSHEET),
    "xlsm": ("an Excel workbook", _SPREADSHEET),
    "xls": ("an Excel 97-2003 workbook", _SPREADSHEET),
    "ods": ("an OpenDocument spreadsheet", _SPREADSHEET),
    "numbers": ("an Apple Numbers spreadsheet", _SPREADSHEET),
    "zip": ("a zip archive", _ARCHIVE),
    "tar": ("a tar archive", _ARCHIVE),
    "tgz": ("a compressed tar archive", _ARCHIVE),
    "gz": ("gzip-compressed", "decompress it (gunzip) and run finetune init on the file inside"),
    "bz2": ("bzip2-compressed", "decompress it (bunzip2) and run finetune init on the file inside"),
    "xz": ("xz-compressed", "decompress it (unxz) and run finetune init on the file inside"),
    "zst": ("zstd-compressed", "decompress it (unzstd) and run finetune init on the file inside"),
    "7z": ("a 7-Zip archive", _ARCHIVE),
    "rar": ("a RAR archive", _ARCHIVE),
    "pdf": ("a PDF document", _DOCUMENT),
    "docx": ("a Word document", _DOCUMENT),
    "doc": ("a Word 97-2003 document", _DOCUMENT),
    "odt": ("an OpenDocument text", _DOCUMENT),
    "rtf": ("an RTF document", _DOCUMENT),
    "pptx": ("a PowerPoint presentation", _DOCUMENT),
    "pkl": ("a Python pickle", _BINARY),
    "pickle": ("a Python pickle", _BINARY),
    "npy": ("a NumPy array", _BINARY),
    "npz": ("a NumPy archive", _BINARY),
    "h5": ("an HDF5 file", _BINARY),
    "hdf5": ("an HDF5 file", _BINARY),
    "feather": ("an Arrow/Feather file", _BINARY),
    "arrow": ("an Arrow/Feather file", _BINARY),
    "sqlite": ("an SQLite database", _BINARY),
    "db": ("a database file", _BINARY),
}
# first bytes -> the format (PK is any zip container: xlsx, ods and docx are told apart by their members)
MAGIC = (
    (b"PK\x03\x04", "zip"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "xls"),
    (b"%PDF", "pdf"),
    (b"\x1f\x8b", "gz"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"7z\xbc\xaf\x27\x1c", "7z"),
    (b"Rar!\x1a\x07", "rar"),
    (b"\x28\xb5\x2f\xfd", "zst"),
    (b"SQLite format 3\x00", "sqlite"),
    (b"ARROW1", "arrow"),
    (b"\x89HDF", "h5"),
    (b"\x93NUMPY", "npy"),
    (b"{\\rtf", "rtf"),
    (b"PAR1", "parquet"),
)


def _zip_kind(path: Path) -> str:
    """What a zip container holds: an Excel or OpenDocument spreadsheet, a Word document, or files."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            mime = z.read("mimetype").decode(errors="replace") if "mimetype" in names else ""
    except (zipfile.BadZipFile, OSError, KeyError):
        return "zip"
    for prefix, kind in (("xl/", "xlsx"), ("word/", "docx"), ("ppt/", "pptx")):
        if any(n.startswith(prefix) for n in names):
            return kind
    return "ods" if "spreadsheet" in mime else "odt" if "opendocument.text" in mime else "zip"


def check_format(path: Path) -> str | None:
    """Refuse a file `finetune init` cannot read, by its first bytes, then by its extension when it is
    not text; return "parquet" for a parquet file under another name, else None (read by extension).

    Raises:
        UserError: a spreadsheet, archive, document, UTF-16 or other binary file, with what to do instead.
    """
    with path.open("rb") as f:
        head = f.read(4096)
    ext = path.suffix.lower().lstrip(".")
    kind = next((k for magic, k in MAGIC if head.startswith(magic)), None)
    if kind is None and re.match(rb"BZh[1-9]1AY&SY", head):
        kind = "bz2"
    if kind == "parquet":
        return "parquet"
    if kind == "zip":
        kind = _zip_kind(path)
    elif kind == "xls" and ext == "doc":  # one container format (OLE2) for all Office 97-2003 files
        kind = "doc"
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UserError(
            f'{path.name} is UTF-16 text (Excel\'s "Unicode Text"): convert it to UTF-8 (iconv -f '
            f"UTF-16 -t UTF-8 {path.name} > data.tsv, or save as CSV UTF-8) and run finetune init on that"
        )
    if kind is None and b"\x00" in head:  # not text: its name is the only hint left
        if ext not in UNSUPPORTED:
            raise UserError(
                f"{path.name} is a binary file, not text; finetune init reads csv, tsv, txt, jsonl, json "
                "and parquet files, a folder per label, or a text file per label"
            )
        kind = ext
    if kind is not None:
        what, todo = UNSUPPORTED[kind]
        raise UserError(f"{path.name} is {what} ({kind}), which finetune init cannot read: {todo}")
    return None
