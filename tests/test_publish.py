"""Publishing final/: the Hub model card it carries, and `finetune export --onnx` checked with ONNX Runtime.

The card is checked against the run's own files (eval.json, the data files' bytes, memory.json);
the ONNX export against PyTorch on final/'s weights, with onnxruntime run here on the exported files
and real texts of several lengths (SST-2 and GoEmotions): a single-label run's final/, and tiny
random multi-label (BERT) and decoder (Llama) classifiers saved as final/ would be.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from huggingface_hub import ModelCard, metadata_load

from finetune.cli import main as cli_main
from finetune.deploy.card import CONFUSION_PNG

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _texts(path: Path, column: int, skip_header: bool) -> list[str]:
    """Real texts of several lengths: the shortest, some in between and the longest two of the first 300 rows."""
    lines = path.read_text(encoding="utf-8").splitlines()[1 if skip_header else 0 :][:300]
    texts = sorted({line.split("\t")[column] for line in lines}, key=len)
    return [texts[0], texts[1], texts[len(texts) // 3], texts[len(texts) // 2], texts[-2], texts[-1]]


# ----------------------------------------------------------------------------------------------
# The model card.


def test_model_card_matches_eval_json_data_and_memory(tiny_run: Path, data_dir: Path) -> None:
    final = tiny_run / "final"
    meta = metadata_load(final / "README.md")  # the front matter as the Hub reads it (yaml.safe_load)
    # huggingface_hub's offline checks: the model-index parses into EvalResults and writes back the same
    card = ModelCard.load(final / "README.md")
    assert card.data.to_dict() == meta and str(card) == (final / "README.md").read_text()
    assert {(r.dataset_split, r.metric_type) for r in card.data.eval_results} == {
        ("validation", "accuracy"),
        ("validation", "f1"),
    }
    ev = json.loads((tiny_run / "eval.json").read_text())
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-classification"
    assert meta["datasets"] == ["sst2"] and "base_model" not in meta  # tiny-debug is built from scratch
    (result,) = meta["model-index"][0]["results"]  # validation only: tiny-debug has no test split
    assert result["dataset"]["split"] == "validation"
    values = {(m["type"], (m.get("args") or {}).get("average")): m["value"] for m in result["metrics"]}
    assert values == {("accuracy", None): ev["accuracy"], ("f1", "macro"): ev["macro_f1"]}  # exactly eval.json's
    assert sorted(meta["metrics"]) == ["accuracy", "f1"]
    text = (final / "README.md").read_text()
    # the data files with the sha256 of their bytes
    for split, name in (("train", "train.tsv"), ("validation", "dev.tsv")):
        digest = hashlib.sha256((data_dir / "sst2" / name).read_bytes()).hexdigest()
        assert f"| {split} | `{name}` | `{digest}` |" in text
    # the confusion matrix as an image, the labels, the config (it reloads as the run's own)
    png = final / CONFUSION_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    assert f"![confusion matrix]({CONFUSION_PNG})" in text
    assert "| 0 | negative |" in text and "| 1 | positive |" in text and "single-label" in text
    config_block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(config_block) == yaml.safe_load((tiny_run / "config.yaml").read_text())
    # peak memory from the final memory summary, written although the run had no checkpoints
    memory = json.loads((tiny_run / "memory.json").read_text())
    assert not (tiny_run / "checkpoints").exists() and (tiny_run / "memory.md").is_file()
    rows = [json.loads(x) for x in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert memory["run_peak_bytes"] >= max(r["peak_memory_bytes"] for r in rows if "peak_memory_bytes" in r) > 0
    assert f"{memory['run_peak_bytes'] / 2**20:,.1f} MiB" in text and "precision: `fp32`" in text
    # and with the MemTracker breakdown of a sampled window, though no checkpoint asked for one
    assert memory["breakdown_method"].startswith("MemTracker on optimizer step ")
    parts = memory["parameters_bytes"] + memory["optimizer_state_bytes"] + memory["activations_bytes"]
    assert memory["peak_bytes"] >= parts
    assert memory["activations_bytes"] > 0 and "| activations |" in (tiny_run / "memory.md").read_text()


# ----------------------------------------------------------------------------------------------
# ONNX.


def _save_final(directory: Path, model: torch.nn.Module, tokenizer: Any, max_length: int = 64) -> Path:
    model.save_pretrained(directory)
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(directory)
    return directory


def _tiny_finals(root: Path) -> dict[str, Path]:
    """A multi-label BERT and a Llama classifier (random tiny weights), saved as final/ would be."""
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
    )

    from finetune.model.load import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm-l6"))
    torch.manual_seed(0)
    names = ["admiration", "anger", "joy"]
    sizes = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
        "vocab_size": tok.vocab_size,
        "num_labels": 3,
        "id2label": dict(enumerate(names)),
        "label2id": {n: i for i, n in enumerate(names)},
    }
    multi = BertForSequenceClassification(BertConfig(**sizes, problem_type="multi_label_classification"))
    llama = LlamaForSequenceClassification(
        LlamaConfig(**sizes, num_key_value_heads=1, head_dim=16, pad_token_id=tok.pad_token_id)
    )
    return {"multi_label": _save_final(root / "multi", multi, tok), "decoder": _save_final(root / "llama", llama, tok)}


def _onnx_vs_torch(final: Path, out: Path, texts: list[str]) -> float:
    """Independently of the export's own check: onnxruntime on OUT_DIR's files (its own tokenizer) against
    transformers on final/, each text alone and all padded together; the largest logit difference."""
    import onnxruntime
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(out)
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    worst, lengths = 0.0, set()
    for batch in [[t] for t in texts] + [texts]:
        enc = tok(batch, padding=True, truncation=True, return_tensors="np")
        lengths.add(enc["input_ids"].shape[1])
        got = session.run(None, {k: enc[k] for k in names})[0]
        with torch.no_grad():
            want = model(**{k: torch.from_numpy(enc[k]) for k in names}).logits.numpy()
        assert got.shape == want.shape == (len(batch), model.config.num_labels)
        worst = max(worst, float(np.abs(got - want).max()))
    assert len(lengths) >= 4  # several sequence lengths through one graph (dynamic axes)
    return worst


@pytest.mark.slow
def test_onnx_export_matches_pytorch(
    tiny_run: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finals = {"single_label": tiny_run / "final", **_tiny_finals(tmp_path)}
    sst2 = _texts(data_dir / "sst2" / "dev.tsv", 0, True)
    emotions = _texts(data_dir / "goemotions" / "dev.tsv", 0, False)
    for kind, final in finals.items():
        out = tmp_path / f"onnx-{kind}"
        assert cli_main(["export", "--onnx", str(final), str(out)]) == 0, kind
        assert "max |logit difference|" in capsys.readouterr().err
        assert {"model.onnx", "config.json", "tokenizer.json", "onnx_check.json"} <= {p.name for p in out.iterdir()}
        assert json.loads((out / "onnx_check.json").read_text())["max_abs_diff"] <= 1e-4
        assert json.loads((out / "config.json").read_text()) == json.loads((final / "config.json").read_text())
        worst = _onnx_vs_torch(final, out, emotions if kind == "multi_label" else sst2)
        assert worst <= 1e-4, (kind, worst)


@pytest.mark.parametrize(
    "case, needle",
    [
        ("missing", "does not exist"),
        ("not_final", "is not an exported model directory"),
        ("out_exists", "exists and is not empty"),
        ("no_format", "choose the export format"),
        ("onnx_missing", "needs onnxscript"),
    ],
)
def test_export_bad_arguments_are_one_line(
    tiny_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    needle: str,
) -> None:
    final, out = tiny_run / "final", tmp_path / "out"
    argv = ["export", "--onnx", str(final), str(out)]
    if case == "missing":
        argv[2] = str(tmp_path / "nowhere")
    elif case == "not_final":
        argv[2] = str(tiny_run)  # the run directory, not its final/
    elif case == "out_exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "no_format":
        argv.remove("--onnx")
    else:
        monkeypatch.setitem(sys.modules, "onnxscript", None)  # import fails as if not installed
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    assert case == "out_exists" and (out / "keep.txt").read_text() == "mine" or not out.exists()
