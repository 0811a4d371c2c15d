"""`finetune predict` and `finetune evaluate` on an exported tiny model (the session-scoped `tiny_run` fixture)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import write_tiny_config

from finetune.cli import main as cli_main

TEXTS = ["a wonderful , moving film", "dull and lifeless", "it 's fine", "the worst movie of the year , really"]


def _labels(run: Path) -> list[str]:
    return json.loads((run / "labels.json").read_text())


@pytest.mark.slow
def test_predict_txt_to_jsonl(tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(TEXTS) + "\n\n")  # blank lines are not texts
    out = tmp_path / "out" / "pred.jsonl"
    assert cli_main(["predict", "--model", str(tiny_run / "final"), "--input", str(inp), "--output", str(out)]) == 0
    assert "wrote 4 predictions" in capsys.readouterr().err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    names = _labels(tiny_run)
    assert [r["text"] for r in rows] == TEXTS  # input order kept
    for r in rows:
        assert r["label"] in names and set(r["probabilities"]) == set(names)
        assert sum(r["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
        assert r["score"] == pytest.approx(max(r["probabilities"].values()))
        assert r["label"] == max(r["probabilities"], key=r["probabilities"].get)

    # the same labels and scores as transformers.pipeline on the exported directory
    from transformers import pipeline

    clf = pipeline("text-classification", model=str(tiny_run / "final"), device="cpu")
    for r, p in zip(rows, clf(TEXTS), strict=True):
        assert r["label"] == p["label"] and r["score"] == pytest.approx(p["score"], abs=1e-5)


def test_predict_csv_and_jsonl_inputs_to_csv(tiny_run: Path, tmp_path: Path) -> None:
    inp = tmp_path / "in.csv"
    with inp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "review"])
        for i, t in enumerate(TEXTS):
            w.writerow([i, t])
    out = tmp_path / "pred.csv"
    assert (
        cli_main(
            [
                "predict",
                "--model",
                str(tiny_run / "final"),
                "--input",
                str(inp),
                "--output",
                str(out),
                "--text-column",
                "review",
            ]
        )
        == 0
    )
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    names = _labels(tiny_run)
    assert list(rows[0]) == ["text", "label", "score", *[f"prob_{n}" for n in names]]
    assert [r["text"] for r in rows] == TEXTS
    assert all(r["label"] in names for r in rows)

    # .jsonl input with the same texts gives the same labels
    inp2 = tmp_path / "in.jsonl"
    inp2.write_text("".join(json.dumps({"review": t}) + "\n" for t in TEXTS))
    out2 = tmp_path / "pred2.jsonl"
    assert (
        cli_main(
            [
                "predict",
                "--model",
                str(tiny_run / "final"),
                "--input",
                str(inp2),
                "--output",
                str(out2),
                "--text-column",
                "review",
            ]
        )
        == 0
    )
    assert [json.loads(x)["label"] for x in out2.read_text().splitlines()] == [r["label"] for r in rows]


def test_predict_long_text_is_truncated_to_the_model(tiny_run: Path, tmp_path: Path) -> None:
    # the tiny model has 128 positions; a 400-word text must not index past them
    inp = tmp_path / "long.txt"
    inp.write_text(" ".join(["great"] * 400) + "\nshort\n")
    out = tmp_path / "long.jsonl"
    assert cli_main(["predict", "--model", str(tiny_run / "final"), "--input", str(inp), "--output", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 2


def test_evaluate_matches_the_runs_eval_json(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny_run.parent / "tiny.yaml"  # the config the run was trained with
    capsys.readouterr()
    assert cli_main(["evaluate", "--model", str(tiny_run / "final"), "--config", str(cfg)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"validation"}
    ev = json.loads((tiny_run / "eval.json").read_text())
    v = result["validation"]
    assert v["num_samples"] == ev["num_samples"] == 64
    assert v["confusion_matrix"] == ev["confusion_matrix"]
    assert v["accuracy"] == pytest.approx(ev["accuracy"]) and v["macro_f1"] == pytest.approx(ev["macro_f1"])


def test_evaluate_with_a_test_split(tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a config with a test split: validation and test both reported (here the same dev rows)
    cfg = write_tiny_config(tmp_path, {"data.max_eval_samples": 40})
    capsys.readouterr()
    argv = ["evaluate", "--model", str(tiny_run / "final"), "--config", str(cfg), "data.test_file=sst2/dev.tsv"]
    assert cli_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"validation", "test"}
    assert result["test"]["num_samples"] == 40
    assert result["test"]["confusion_matrix"] == result["validation"]["confusion_matrix"]  # same 40 dev rows


@pytest.mark.parametrize(
    "argv_tail,needle",
    [
        (
            ["predict", "--model", "{tmp}/nomodel", "--input", "{tmp}/in.txt", "--output", "{tmp}/o.jsonl"],
            "not an exported model directory",
        ),
        (
            ["predict", "--model", "{final}", "--input", "{tmp}/missing.txt", "--output", "{tmp}/o.jsonl"],
            "does not exist",
        ),
        (
            ["predict", "--model", "{final}", "--input", "{tmp}/in.txt", "--output", "{tmp}/o.xlsx"],
            "cannot infer its format",
        ),
        (["predict", "--model", "{final}", "--input", "{tmp}/in.csv", "--output", "{tmp}/o.csv"], "no column 'text'"),
        (
            [
                "predict",
                "--model",
                "{final}",
                "--input",
                "{tmp}/in.txt",
                "--output",
                "{tmp}/o.jsonl",
                "--batch-size",
                "0",
            ],
            "--batch-size",
        ),
        (["predict", "--model", "{final}", "--input", "{tmp}/in.json", "--output", "{tmp}/o.jsonl"], "must be a list"),
    ],
)
def test_cli_errors_are_one_line(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv_tail: list[str], needle: str
) -> None:
    (tmp_path / "in.txt").write_text("hello\n")
    (tmp_path / "in.csv").write_text("review\nhello\n")
    (tmp_path / "in.json").write_text('{"text": "hello"}')
    argv = [a.format(tmp=tmp_path, final=tiny_run / "final") for a in argv_tail]
    capsys.readouterr()
    assert cli_main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_cli_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([]) == 2
    assert "usage: finetune" in capsys.readouterr().err
    assert cli_main(["--help"]) == 0  # asked for: usage on stdout, success
    assert "usage: finetune" in capsys.readouterr().out
    assert cli_main(["frobnicate"]) == 2


def test_plan_refuses_zero_processes(capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import TINY

    assert cli_main(["plan", "--config", str(TINY), "--num-processes", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == "error: --num-processes must be at least 1"


def test_predict_texts_feeds_text_pairs(tiny_run: Path) -> None:
    # `finetune evaluate` on a data.text_pair_column config: each text goes in with its pair, as in training
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.deploy.predict import predict_texts

    tok = AutoTokenizer.from_pretrained(tiny_run / "final")
    model = AutoModelForSequenceClassification.from_pretrained(tiny_run / "final").eval()
    pairs = ["a second sentence", "and another one", "short", "the pair of the last text , longer"]
    with_pairs = predict_texts(tok, model, TEXTS, batch_size=3, pairs=pairs)
    alone = predict_texts(tok, model, TEXTS, batch_size=3)
    for text, pair, row, single in zip(TEXTS, pairs, with_pairs, alone, strict=True):
        with torch.no_grad():
            expected = model(**tok(text, pair, return_tensors="pt")).logits.softmax(-1)[0].tolist()
        assert list(row["probabilities"].values()) == pytest.approx(expected, abs=1e-5)
        assert list(single["probabilities"].values()) != pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("damage", ["weights_truncated", "tokenizer_gone", "tokenizer_json_gone", "config_gone"])
def test_incomplete_final_is_one_line_naming_the_file(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """predict, evaluate and export on a damaged final/: one line naming the file, exit 2. Before, truncated
    weights gave a SafetensorError traceback and a final/ without its tokenizer files predicted with another
    tokenizer, exit 0."""
    import shutil

    final = tmp_path / "final"
    shutil.copytree(tiny_run / "final", final)
    weights = final / "model.safetensors"
    named = {
        "weights_truncated": weights,
        "tokenizer_gone": final / "tokenizer_config.json",
        "tokenizer_json_gone": final / "tokenizer.json",
        "config_gone": final / "config.json",
    }[damage]
    if damage == "weights_truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "tokenizer_gone":
        for p in final.glob("tokenizer*"):
            p.unlink()
    else:
        named.unlink()
    (tmp_path / "in.txt").write_text("hello\n")
    commands = {
        "predict": [
            "predict",
            "--model",
            str(final),
            "--input",
            str(tmp_path / "in.txt"),
            "--output",
            str(tmp_path / "o.jsonl"),
        ],
        "evaluate": ["evaluate", "--model", str(final), "--config", str(write_tiny_config(tmp_path))],
        "export": ["export", "--onnx", str(final), str(tmp_path / "onnx")],
    }
    capsys.readouterr()
    for name, argv in commands.items():
        assert cli_main(argv) == 2, name
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: ") and str(named) in err[0], (name, err)
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "onnx").exists()


def test_predict_progress_is_plain_lines_in_a_log(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """stderr not a terminal: predict's batches as plain lines (here one per batch), no carriage returns."""
    monkeypatch.setenv("TQDM_MININTERVAL", "0")
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "o.jsonl"
    argv = [
        "predict",
        "--model",
        str(tiny_run / "final"),
        "--input",
        str(inp),
        "--output",
        str(out),
        "--batch-size",
        "1",
    ]
    capsys.readouterr()
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line.split(" |")[0] for line in err.splitlines() if line.startswith("predict ")]
    assert lines == ["predict 0/4", "predict 1/4", "predict 2/4", "predict 3/4", "predict 4/4"], err
