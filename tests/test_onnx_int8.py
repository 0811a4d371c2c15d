"""`finetune export --onnx --quantize int8` and `finetune predict --backend onnx` on the session's tiny run:
an int8 graph (integer matrix products), its validation metric next to fp32's in onnx_check.json, the fp32
metric equal to eval.json's (the same weights), and predictions through ONNX Runtime; a directory of the
other backend's kind is one line."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from finetune.cli import main as cli_main

TEXTS = ["a wonderful , moving film", "dull and lifeless", "it 's fine", "the worst movie of the year , really"]


@pytest.mark.slow
def test_int8_export_parity_and_onnx_predict(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "int8"
    capsys.readouterr()
    assert cli_main(["export", "--onnx", str(tiny_run / "final"), str(out), "--quantize", "int8"]) == 0
    err = capsys.readouterr().err
    assert "int8 on validation (64 texts): accuracy" in err
    ops = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops, ops
    assert not (out / "model.int8.onnx").exists()
    int8 = json.loads((out / "onnx_check.json").read_text())["int8"]
    v = int8["validation"]
    assert v["fp32"] == pytest.approx(json.loads((tiny_run / "eval.json").read_text())["accuracy"], abs=1e-9)
    assert int8["int8_loss"] == pytest.approx(v["fp32"] - v["int8"])
    assert int8["warning"] == (int8["int8_loss"] > 0.005)
    assert ("warning:" in err) == int8["warning"]

    inp, pred = tmp_path / "in.txt", tmp_path / "pred.jsonl"
    inp.write_text("\n".join(TEXTS) + "\n")
    assert (
        cli_main(["predict", "--model", str(out), "--input", str(inp), "--output", str(pred), "--backend", "onnx"]) == 0
    )
    rows = [json.loads(x) for x in pred.read_text().splitlines()]
    assert [r["text"] for r in rows] == TEXTS
    assert all(sum(r["probabilities"].values()) == pytest.approx(1.0, abs=1e-5) for r in rows)

    # the other backend's directory: one line, exit 2, nothing written
    capsys.readouterr()
    for model, backend in ((out, "pytorch"), (tiny_run / "final", "onnx")):
        bad = tmp_path / f"bad-{backend}.jsonl"
        argv = ["predict", "--model", str(model), "--input", str(inp), "--output", str(bad), "--backend", backend]
        assert cli_main(argv) == 2
        err_lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err_lines) == 1 and "--backend" in err_lines[0], err_lines
        assert not bad.exists()
