"""`finetune predict` streaming: chunks of very different lengths come out in input order with the
predictions of one whole-input pass, every input and output format, a stopped run continued by the same
command (and refused when its input changed), an existing output kept without --overwrite."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from finetune.cli import main as cli_main
from finetune.core.errors import UserError
from finetune.deploy import predict
from finetune.deploy.final import load_final

# one word next to ~120 words: sorted by length inside a chunk, the batches mix far apart from the input order
TEXTS = [
    ("a fine film" if i % 3 else " ".join(["the slow middle act drags , yet the cast is game"] * (1 + i % 11)))
    + f" {i}"
    for i in range(23)
]


def _argv(final: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return ["predict", "--model", str(final), "--input", str(inp), "--output", str(out), *extra]


def _read(out: Path) -> list[dict]:
    if out.suffix == ".jsonl":
        return [json.loads(x) for x in out.read_text().splitlines()]
    if out.suffix == ".csv":
        with out.open(newline="") as f:
            return list(csv.DictReader(f))
    return pq.read_table(out).to_pylist()


def _write_input(path: Path) -> None:
    if path.suffix == ".txt":
        path.write_text("\n".join(TEXTS) + "\n")
    elif path.suffix == ".tsv":
        path.write_text("id\treview\n" + "".join(f"{i}\t{t}\n" for i, t in enumerate(TEXTS)))
    else:
        pq.write_table(pa.table({"id": list(range(len(TEXTS))), "review": TEXTS}), path)


@pytest.mark.parametrize("src,dst", [(".txt", ".jsonl"), (".tsv", ".csv"), (".parquet", ".parquet")])
def test_streamed_chunks_keep_input_order(tiny_run: Path, tmp_path: Path, src: str, dst: str) -> None:
    final = tiny_run / "final"
    inp, out = tmp_path / f"in{src}", tmp_path / f"out{dst}"
    _write_input(inp)
    column = [] if src == ".txt" else ["--text-column", "review"]
    assert cli_main(_argv(final, inp, out, "--chunk-size", "5", "--batch-size", "3", *column)) == 0
    rows = _read(out)
    assert [r["text"] for r in rows] == TEXTS
    tok, model = load_final(final)
    whole = predict.predict_texts(tok, model, TEXTS, batch_size=64)  # one pass, other batches
    for row, ref in zip(rows, whole, strict=True):
        assert row["label"] == ref["label"]
        for name, p in ref["probabilities"].items():
            assert float(row[f"prob_{name}"] if dst != ".jsonl" else row["probabilities"][name]) == pytest.approx(
                p, abs=1e-5
            )
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no parts or temporary files left


def test_a_stopped_run_continues_after_its_last_chunk(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    final = tiny_run / "final"
    inp = tmp_path / "in.txt"
    _write_input(inp)
    reference = tmp_path / "ref.jsonl"
    assert cli_main(_argv(final, inp, reference, "--chunk-size", "4")) == 0

    out = tmp_path / "out.jsonl"
    real, calls = predict.predict_texts, []

    def stop_at_third_chunk(*args: object, **kwargs: object) -> list[dict]:
        calls.append(args[2])
        if len(calls) == 3:
            raise KeyboardInterrupt  # a kill in the third chunk
        return real(*args, **kwargs)

    monkeypatch.setattr(predict, "predict_texts", stop_at_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        cli_main(_argv(final, inp, out, "--chunk-size", "4"))
    assert not out.exists()  # nothing that looks complete
    capsys.readouterr()
    calls_after: list[list[str]] = []
    monkeypatch.setattr(predict, "predict_texts", lambda *a, **k: calls_after.append(a[2]) or real(*a, **k))
    assert cli_main(_argv(final, inp, out, "--chunk-size", "4")) == 0
    assert "continuing" in capsys.readouterr().err
    assert calls_after[0] == TEXTS[8:12]  # chunks 0 and 1 were not predicted again
    assert out.read_text() == reference.read_text()

    # an output that exists is kept without --overwrite
    assert cli_main(_argv(final, inp, out, "--chunk-size", "4")) == 2
    assert out.read_text() == reference.read_text()


def test_a_changed_input_is_not_continued(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    final = tiny_run / "final"
    inp, out = tmp_path / "in.txt", tmp_path / "out.csv"
    _write_input(inp)
    real = predict.predict_texts
    seen: list[int] = []

    def stop_at_second_chunk(*args: object, **kwargs: object) -> list[dict]:
        seen.append(1)
        if len(seen) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(predict, "predict_texts", stop_at_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        cli_main(_argv(final, inp, out, "--chunk-size", "4"))
    monkeypatch.setattr(predict, "predict_texts", real)
    inp.write_text("\n".join(TEXTS[::-1]) + "\n")
    capsys.readouterr()
    assert cli_main(_argv(final, inp, out, "--chunk-size", "4")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot continue" in err[0] and "input_mtime_ns" in err[0], err
    assert cli_main(_argv(final, inp, out, "--chunk-size", "4", "--overwrite")) == 0
    assert [r["text"] for r in _read(out)] == TEXTS[::-1]


@pytest.mark.slow
def test_two_workers_merge_in_input_order(tiny_run: Path, tmp_path: Path) -> None:
    final = tiny_run / "final"
    inp = tmp_path / "in.txt"
    _write_input(inp)
    one, two = tmp_path / "one.csv", tmp_path / "two.csv"
    assert cli_main(_argv(final, inp, one, "--chunk-size", "3")) == 0
    assert cli_main(_argv(final, inp, two, "--chunk-size", "3", "--workers", "2")) == 0
    a, b = _read(one), _read(two)
    assert [r["text"] for r in b] == TEXTS
    assert [r["label"] for r in a] == [r["label"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert float(x["prob_positive"]) == pytest.approx(float(y["prob_positive"]), abs=1e-6)


@pytest.mark.parametrize(
    "case,needle",
    [
        ("empty", "has no texts"),
        ("unreadable", "cannot read --input"),
        ("no_column", "no column 'review'"),
        ("output_exists", "exists: pass --overwrite"),
        ("output_format", "cannot infer its format"),
        ("input_format", "cannot infer its format"),
        ("onnx_without_tokenizer", "has no tokenizer"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, needle: str
) -> None:
    model, inp, out, extra = tiny_run / "final", tmp_path / "in.txt", tmp_path / "out.jsonl", []
    inp.write_text("hello\n")
    if case == "empty":
        inp.write_text("\n\n")
    elif case == "unreadable":
        inp.write_bytes(b"\xff\xfe\x00bad")
    elif case == "no_column":
        inp = tmp_path / "in.parquet"
        pq.write_table(pa.table({"text": ["hello"]}), inp)
        extra = ["--text-column", "review"]
    elif case == "output_exists":
        out.write_text("kept\n")
    elif case == "output_format":
        out = tmp_path / "out.xlsx"
    elif case == "input_format":
        inp = tmp_path / "in.docx"
        inp.write_text("hello")
    else:
        model = tmp_path / "onnx"
        model.mkdir()
        (model / "model.onnx").write_bytes(b"")
        extra = ["--backend", "onnx"]
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert cli_main(_argv(model, inp, out, *extra)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, parts or temporary files


# ----------------------------------------------------------------------------------------------
# Prediction reads an input as training read the run's data files: the keys final/ records.

# each file is valid only with its run's keys: a csv whose quotes are text, a tsv with quoted tabs and
# doubled quotes, a csv split at semicolons
READ_CASES = {
    "csv_quotes_are_text": (
        {"data.format": "csv", "data.quoting": "none", "data.delimiter": ...},
        'text,label\n"quoted" start,1\nshe said "hi" twice,0\n"open only,1\n',
    ),
    "tsv_quote_aware": (
        {"data.format": "tsv", "data.quoting": "minimal", "data.delimiter": ...},
        'text\tlabel\n"a tab\there"\t1\n"say ""hi"" now"\t0\nplain words\t1\n',
    ),
    "csv_semicolons": (
        {"data.format": "csv", "data.quoting": "none", "data.delimiter": ";"},
        'text;label\n"quoted" start, and a comma;1\nno quotes, two commas, here;0\n',
    ),
}


def _python_csv_texts(path: Path, keys: dict) -> list[str]:
    """The text column as Python's csv module reads the file with the run's keys (an independent reader)."""
    delimiter = (
        keys["data.delimiter"] if keys["data.delimiter"] is not ... else {"csv": ",", "tsv": "\t"}[path.suffix[1:]]
    )
    quoting = csv.QUOTE_NONE if keys["data.quoting"] == "none" else csv.QUOTE_MINIMAL
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter=delimiter, quoting=quoting))
    return [r[rows[0].index("text")] for r in rows[1:]]


def _run_with_keys(tmp_path: Path, case: str) -> tuple[Path, dict, Path]:
    """The case's data file, its run's keys, and a model directory whose config.json holds what final/ records."""
    from conftest import write_tiny_config

    from finetune.config.files import load_config
    from finetune.deploy.final import prediction_config

    keys, content = READ_CASES[case]
    path = tmp_path / f"train.{keys['data.format']}"
    path.write_text(content, encoding="utf-8")
    updates = {"data.data_dir": str(tmp_path), "data.train_file": path.name, "data.validation_file": ...}
    updates |= {"data.text_column": "text", **keys}
    cfg = load_config(write_tiny_config(tmp_path, updates))
    model = tmp_path / "final"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(prediction_config(cfg, ["negative", "positive"], None)))
    return path, keys, model


@pytest.mark.parametrize("case", sorted(READ_CASES))
def test_training_and_prediction_read_a_file_alike(tmp_path: Path, case: str) -> None:
    from finetune.config.files import load_config
    from finetune.data.reading import read_file

    path, keys, model = _run_with_keys(tmp_path, case)
    expected = _python_csv_texts(path, keys)
    trained = read_file(load_config(tmp_path / "tiny.yaml"), path)["text"][:]
    options = predict.input_options(path, model)
    columns = predict.Columns.of({"text": ""}, path, "text", None)
    predicted = [t for rows in predict._chunks(path, 2, options) for t in columns.texts(rows, path, 0)[0]]
    assert trained == expected and predicted == expected
    # a model directory that records no reading (an older final/) reads the file otherwise: the keys decide
    usual = predict.input_options(path, tmp_path / "older")
    assert usual != options
    try:
        other = [t for rows in predict._chunks(path, 2, usual) for t in columns.texts(rows, path, 0)[0]]
    except UserError:
        other = None
    assert other != expected


def test_prediction_reads_the_input_with_the_runs_keys(tiny_run: Path, tmp_path: Path) -> None:
    import shutil

    recorded = json.loads((tiny_run / "final" / "config.json").read_text())["data_reading"]
    assert recorded["formats"] == ["tsv"] and recorded["quoting"] == "none"  # configs/tiny-debug.yaml's keys
    # the tiny model as if trained on ;-separated csv files whose quotes are text
    final = tmp_path / "final"
    shutil.copytree(tiny_run / "final", final)
    config = json.loads((final / "config.json").read_text())
    config["data_reading"] |= {"formats": ["csv"], "delimiter": ";", "quoting": "none"}
    (final / "config.json").write_text(json.dumps(config))
    _, content = READ_CASES["csv_semicolons"]
    inp, out = tmp_path / "in.csv", tmp_path / "out.jsonl"
    inp.write_text(content)
    assert cli_main(_argv(final, inp, out)) == 0
    keys = {"data.delimiter": ";", "data.quoting": "none"}
    assert [r["text"] for r in _read(out)] == _python_csv_texts(inp, keys)
    # the input of a format the run did not read (.tsv here) is read as tsv files usually are
    tsv, out2 = tmp_path / "in.tsv", tmp_path / "out2.jsonl"
    tsv.write_text('text\n"quoted" tsv text\n')
    assert cli_main(_argv(final, tsv, out2)) == 0
    assert [r["text"] for r in _read(out2)] == ['"quoted" tsv text']


# ----------------------------------------------------------------------------------------------
# Output row i is input row i: a row with no text gets an empty row in its place.

BLANK_MIDDLE = {
    ".txt": ("a fine film\n\nthe slow middle act drags\n\n", ["a fine film", "", "the slow middle act drags"]),
    ".csv": ("text\na fine film\n\nthe slow middle act drags\n", ["a fine film", "", "the slow middle act drags"]),
    ".jsonl": (
        '{"text": "a fine film"}\n{"text": "  "}\n{"text": "the slow middle act drags"}\n',
        ["a fine film", "  ", "the slow middle act drags"],
    ),
}


@pytest.mark.parametrize("src,dst", [(".txt", ".jsonl"), (".csv", ".csv"), (".jsonl", ".parquet")])
def test_a_blank_row_keeps_its_place(tiny_run: Path, tmp_path: Path, src: str, dst: str) -> None:
    content, texts = BLANK_MIDDLE[src]  # the .txt's blank last line ends the file: no row
    inp, out = tmp_path / f"in{src}", tmp_path / f"out{dst}"
    inp.write_text(content)
    assert cli_main(_argv(tiny_run / "final", inp, out, "--chunk-size", "2")) == 0
    rows = _read(out)
    assert [r["text"] for r in rows] == texts
    empty = None if dst != ".csv" else ""  # null in .jsonl and .parquet, empty cells in .csv
    assert rows[1]["label"] == rows[1]["score"] == empty
    assert all(v == empty for k, v in rows[1].items() if k.startswith("prob"))
    assert rows[0]["label"] in ("negative", "positive") and rows[2]["label"] in ("negative", "positive")


def test_a_resumed_run_keeps_blank_rows_in_place(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final, inp, out = tiny_run / "final", tmp_path / "in.txt", tmp_path / "out.jsonl"
    lines = ["one fine film", "", "two dull acts", "", "three"]
    inp.write_text("\n".join(lines) + "\n")
    real, calls = predict.predict_texts, []

    def stop_at_second_call(*args: object, **kwargs: object) -> list[dict]:
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(predict, "predict_texts", stop_at_second_call)
    with pytest.raises(KeyboardInterrupt):
        cli_main(_argv(final, inp, out, "--chunk-size", "2"))
    assert calls == [["one fine film"], ["two dull acts"]]  # blank rows never reach the model
    monkeypatch.setattr(predict, "predict_texts", real)
    assert cli_main(_argv(final, inp, out, "--chunk-size", "2")) == 0
    rows = _read(out)
    assert [r["text"] for r in rows] == lines
    assert [r["label"] is None for r in rows] == [False, True, False, True, False]


@pytest.mark.parametrize(
    "case,needle",
    [
        ("onnx_damaged", "ONNX Runtime cannot load"),
        ("output_below_a_file", "is not a folder"),
        ("output_under_proc", "cannot write in /proc"),
        ("nul_bytes", "a NUL byte on line 2"),
        ("undecodable", "byte 0xff on line 3 is not UTF-8"),
    ],
)
def test_what_cannot_be_read_or_written_is_one_line(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, needle: str
) -> None:
    """Before, an onnxruntime or OSError traceback (exit 1), or a binary file's bytes predicted as text. The
    output and input are refused before the model loads: their cases name a model that is not there."""
    import shutil

    model, inp, out, extra = tmp_path / "no-model", tmp_path / "in.txt", tmp_path / "out.jsonl", []
    inp.write_text("hello\nworld\n")
    if case == "onnx_damaged":
        model = tmp_path / "onnx"
        model.mkdir()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_run / "final" / name, model / name)
        (model / "model.onnx").write_bytes(b"\x08\x07not a protobuf")
        extra = ["--backend", "onnx"]
    elif case == "output_below_a_file":
        out = inp / "preds" / "out.jsonl"
    elif case == "output_under_proc":
        out = Path("/proc/no-such-folder/out.jsonl")
    elif case == "nul_bytes":
        inp.write_bytes(b"hello\n\x00\x01\x02binary\n")
    else:
        inp = tmp_path / "in.csv"
        inp.write_bytes(b"text\nhello\ncaf\xff\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert cli_main(_argv(model, inp, out, *extra)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    if case in ("nul_bytes", "undecodable"):
        assert str(inp) in err[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == before
