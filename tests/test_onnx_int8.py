"""`finetune export --onnx --quantize int8` and `finetune predict --backend onnx` on a tiny run trained well above
chance: an int8 graph (integer matrix products), its validation metric next to fp32's in onnx_check.json, the fp32
metric equal to eval.json's (the same weights), int8's accuracy and labels within a bound of fp32's, and predictions
through ONNX Runtime; a directory of the other backend's kind is one line."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from conftest import write_tiny_config

from finetune.cli import main as cli_main

TEXTS = ["a wonderful , moving film", "dull and lifeless", "it 's fine", "the worst movie of the year , really"]

# TREC's six question classes (ABBR DESC ENTY HUM LOC NUM; chance 1/6, the largest class 23% of the 128
# validation questions), learnt by the tiny BERT from scratch in 192 steps (3 epochs of 1,024 questions, 2.7 s here):
# 62.5% accuracy, so int8 and fp32 are compared on predictions that mean something. (The `tiny_run` fixture's
# SST-2 model predicts one class for every text: 52%, its chance.)
TREC = {
    "data.train_file": "trec/train_5500.label",
    "data.validation_file": ...,
    "data.format": "text",
    "data.encoding": "latin-1",
    "data.line_regex": r"^(?P<label>[A-Z]+):\S+ (?P<text>.+)$",
    "data.text_column": "text",
    "data.label_column": "label",
    "data.label_map": ...,
    "data.quoting": ...,
    "data.validation_split": 0.1,
    "data.max_length": 32,
    "data.max_train_samples": 1024,
    "data.max_eval_samples": 128,
    "train.epochs": 3,
    "train.micro_batch_size": 16,
    "train.gradient_accumulation_steps": 1,
    "train.learning_rate": 3e-3,
}


@pytest.fixture(scope="module")
def trec_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """A tiny BERT trained on TREC questions (`TREC`); its run directory (final/, eval.json, predictions.jsonl)."""
    from finetune.train import main

    directory = tmp_path_factory.mktemp("trec_run")
    assert main(["--config", str(write_tiny_config(directory, TREC))]) == 0
    return directory / "run"


@pytest.mark.slow
def test_int8_export_parity_and_onnx_predict(
    trec_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "int8"
    capsys.readouterr()
    assert cli_main(["export", "--onnx", str(trec_run / "final"), str(out), "--quantize", "int8"]) == 0
    err = capsys.readouterr().err
    assert "int8 on validation (128 texts): accuracy" in err
    ops = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops, ops
    assert not (out / "model.int8.onnx").exists()
    int8 = json.loads((out / "onnx_check.json").read_text())["int8"]
    v = int8["validation"]
    assert v["fp32"] == pytest.approx(json.loads((trec_run / "eval.json").read_text())["accuracy"], abs=1e-9)
    assert int8["int8_loss"] == pytest.approx(v["fp32"] - v["int8"])
    assert int8["warning"] == (int8["int8_loss"] > 0.005)
    assert ("warning:" in err) == int8["warning"]
    assert v["texts"] == 128 and v["fp32"] >= 0.5  # well above chance (1/6), or the bounds below mean little

    # the validation questions through the int8 graph, against the fp32 model's labels in predictions.jsonl
    fp32 = [json.loads(x) for x in (trec_run / "predictions.jsonl").read_text().splitlines()]
    fp32 = [r for r in fp32 if r["split"] == "validation"]
    inp, pred = tmp_path / "in.txt", tmp_path / "pred.jsonl"
    inp.write_text("\n".join([*TEXTS, *(r["text"] for r in fp32)]) + "\n")
    assert (
        cli_main(["predict", "--model", str(out), "--input", str(inp), "--output", str(pred), "--backend", "onnx"]) == 0
    )
    rows = [json.loads(x) for x in pred.read_text().splitlines()]
    assert [r["text"] for r in rows] == [*TEXTS, *(r["text"] for r in fp32)]
    assert all(sum(r["probabilities"].values()) == pytest.approx(1.0, abs=1e-5) for r in rows)
    agreement = sum(r["label"] == f["prediction"] for r, f in zip(rows[len(TEXTS) :], fp32, strict=True)) / len(fp32)
    # Measured on this model: int8 as accurate as fp32 (80 of 128) and 127 of 128 labels the same; int8 moves the
    # logits by at most 0.035 (probabilities by 0.008), so a label flips only where fp32's two top classes are
    # that close (one scale per matrix instead of per channel: 2 flips, one question lost). 3 points (3
    # questions) and 95% (6 flips) leave room for other CPUs' int8 kernels (AVX2 without VNNI saturates u8 x s8
    # products) and ONNX Runtime versions; an int8 model that really loses accuracy falls outside both.
    assert v["int8"] >= v["fp32"] - 0.03 and agreement >= 0.95, (v, agreement)

    # the other backend's directory: one line, exit 2, nothing written
    capsys.readouterr()
    for model, backend in ((out, "pytorch"), (trec_run / "final", "onnx")):
        bad = tmp_path / f"bad-{backend}.jsonl"
        argv = ["predict", "--model", str(model), "--input", str(inp), "--output", str(bad), "--backend", backend]
        assert cli_main(argv) == 2
        err_lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err_lines) == 1 and "--backend" in err_lines[0], err_lines
        assert not bad.exists()


def test_int8_warning_says_what_to_do() -> None:
    """describe_check on hand-made checks: a loss over the limit is a warning line that names the fp32 export;
    a loss within it is the plain line."""
    from finetune.deploy.export import describe_check

    check = {"inputs": ["input_ids"], "max_abs_diff": 1e-6, "checks": [{}, {}], "tolerance": 1e-4}
    v = {"metric": "accuracy", "fp32": 0.8050, "int8": 0.7993, "texts": 872}
    lines = describe_check(check | {"int8": {"validation": v, "int8_loss": 0.0057, "warning": True}}, "out")
    warning = lines.splitlines()[-1]
    assert warning.startswith("warning: int8 on validation (872 texts): accuracy 0.7993 against fp32 0.8050")
    assert "a loss of 0.57 points (more than 0.5)" in warning and "export again without --quantize" in warning
    v = v | {"int8": 0.8016}
    lines = describe_check(check | {"int8": {"validation": v, "int8_loss": 0.0034, "warning": False}}, "out")
    assert lines.splitlines()[-1] == "int8 on validation (872 texts): accuracy 0.8016 against fp32 0.8050"
