"""`finetune export --onnx FINAL_DIR OUT_DIR`: final/ as an ONNX model, checked with ONNX Runtime.

The export is transformers' own (`transformers.exporters.OnnxExporter`: `torch.export` then
`torch.onnx.export`, with transformers' patches for its models), with the batch and sequence axes
of every input dynamic. OUT_DIR is self-contained: model.onnx (+ model.onnx.data), export.json,
final/'s config.json and tokenizer. Before OUT_DIR is written the exported files are run with
ONNX Runtime on texts of several lengths, one at a time and padded together, and their logits are
compared with PyTorch's on final/: a difference above the tolerance is an error, and the numbers
go to OUT_DIR/onnx_check.json.

With `--quantize int8` the checked fp32 graph is then quantized by ONNX Runtime's `quantize_dynamic` (int8
weights per channel, activations quantized on the fly) and replaces model.onnx; onnx_check.json's `int8` gives the
headline metric of both graphs on the run's validation set (predictions.jsonl beside final/) and a
warning flag when int8 loses more than half a point, which `describe_check` prints with what to do instead
(`INT8_ADVICE`). Per channel is kept against per tensor, the head's matrix products left in fp32, the
embedding tables left in fp32 and static QDQ quantization calibrated on training texts
(scripts/bench_int8.py, docs/USAGE.md): none lost less accuracy on both a weak and the demo's model.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from finetune.config.tasks import MULTI, PROBLEM_TYPES, SINGLE, lower_is_better
from finetune.core.errors import UserError
from finetune.deploy.final import check_final, load_final
from finetune.deploy.predict import OnnxClassifier, label_names, label_thresholds, model_logits, problem_type
from finetune.evaluation.metrics import compute_metrics

ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
CHECK_FILE = "onnx_check.json"
QUANTIZE = ("int8",)
# the most the int8 model may lose on the run's validation set, in the headline metric, before a warning
INT8_LOSS_WARNING = 0.005
# what the warning says to do: no other int8 setting lost less on both models measured (scripts/bench_int8.py),
# so the way back to fp32's accuracy is the fp32 graph
INT8_ADVICE = (
    "int8 changes the predictions the model is least sure of, so what it loses varies from model to model; for "
    "fp32's accuracy export again without --quantize (fp32 ONNX: PyTorch's predictions, at about half int8's "
    "texts/s); no other int8 setting measured lost less (docs/USAGE.md)"
)
# texts of several lengths (1 to ~70 words): the check runs each alone and all of them padded together
CHECK_TEXTS = [
    "fine",
    "a fine film",
    "dull and far too long for what it is",
    "the performances are strong , but the script never decides what kind of film it wants to be , and the last "
    "half hour drags",
    "it is the kind of movie that makes you want to call your friends the moment it ends , not to warn them away "
    "but to tell them that something this odd , this funny and this sad can still come out of a studio ; the "
    "cast is game , the music is wonderful , and even the slow middle act earns its place by the final scene .",
]


def check_out_dir(out: Path, force: bool) -> None:
    """Raises:
    UserError: OUT_DIR exists (and is not empty) without --force, or is a file.
    """
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not an output directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"{out} exists and is not empty: choose another OUT_DIR or pass --force to replace it")


def import_onnx() -> Any:
    """onnxruntime, after checking the export's packages are installed.

    Raises:
        UserError: onnx, onnxscript or onnxruntime is missing.
    """
    missing = []
    for name in ONNX_PACKAGES:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UserError(
            f"finetune export --onnx needs {', '.join(missing)}: pip install onnx onnxscript onnxruntime "
            "(requirements.txt pins them)"
        )
    import onnxruntime

    return onnxruntime


def encode(tokenizer: Any, texts: list[str], names: list[str], framework: str = "pt") -> dict[str, Any]:
    """The model's inputs `names` for `texts`, padded, cut at the tokenizer's model_max_length (final/'s max_length)."""
    enc = tokenizer(texts, padding=True, truncation=True, return_tensors=framework)
    return {k: enc[k] for k in names}


def input_names(tokenizer: Any, model: Any) -> list[str]:
    """The inputs the exported graph takes: what the tokenizer gives and the model's forward accepts."""
    import inspect

    accepted = inspect.signature(model.forward).parameters
    enc = tokenizer(["a"], return_tensors="pt")
    return [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc and k in accepted]


def export_program(model: Any, sample: dict[str, Any]) -> Any:
    """transformers' ONNX export of `model` with dynamic batch and sequence axes."""
    from torch.export import Dim
    from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter

    dims = {name: {0: Dim.DYNAMIC, 1: Dim.DYNAMIC} for name in sample}
    return OnnxExporter().export(model, dict(sample), config=OnnxConfig(dynamic_shapes=dims))


def compare(directory: Path, model: Any, names: list[str], texts: list[str]) -> dict[str, Any]:
    """Logits of ONNX Runtime on directory/model.onnx (with directory's tokenizer) against PyTorch's, for each
    text alone and all texts padded together."""
    import numpy as np
    import onnxruntime
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)  # OUT_DIR's own tokenizer: it must be self-contained
    session = onnxruntime.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    graph_inputs = [i.name for i in session.get_inputs()]
    batches = [[t] for t in texts] + [texts]
    rows = []
    for batch in batches:
        enc = encode(tokenizer, batch, names, "np")
        onnx_logits = session.run(["logits"], {k: enc[k].astype(np.int64) for k in graph_inputs})[0]
        with torch.no_grad():
            torch_logits = model(**{k: torch.from_numpy(enc[k]) for k in names}).logits.float().numpy()
        rows.append(
            {
                "batch": len(batch),
                "tokens": int(enc["input_ids"].shape[1]),
                "max_abs_diff": float(np.abs(onnx_logits - torch_logits).max()),
            }
        )
    return {"inputs": graph_inputs, "checks": rows, "max_abs_diff": max(r["max_abs_diff"] for r in rows)}


def validation_rows(final: Path) -> tuple[list[str], list[str] | None, list[Any]] | None:
    """The run's validation texts (pairs) and gold labels, from predictions.jsonl beside final/ (None without one)."""
    path = final.parent / "predictions.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    rows = [r for r in rows if r.get("split") == "validation"]
    if not rows:
        return None
    pairs = [r["text_pair"] for r in rows] if "text_pair" in rows[0] else None
    return [r["text"] for r in rows], pairs, [r["gold"] for r in rows]


def onnx_score(directory: Path, tokenizer: Any, rows: tuple[list[str], list[str] | None, list[Any]]) -> float:
    """The headline metric of directory/model.onnx on `rows` (texts, pairs, gold), thresholds from its config."""
    model = OnnxClassifier(directory)
    kind, names = problem_type(model.config), label_names(model.config)
    texts, pairs, gold = rows
    logits = model_logits(tokenizer, model, texts, pairs, on_texts=lambda n: None)
    if kind == SINGLE:
        y = np.asarray([names.index(g) for g in gold])
    elif kind == MULTI:
        y = np.asarray([[float(n in g) for n in names] for g in gold])
    else:
        y = np.asarray(gold, dtype=np.float64)
    metric = PROBLEM_TYPES[kind].headline[0]
    return float(compute_metrics(kind, y, logits, names, label_thresholds(model.config))[metric])


def quantize_int8(directory: Path, tokenizer: Any, final: Path) -> dict[str, Any]:
    """directory/model.onnx replaced by its dynamic int8 quantization (ONNX Runtime's `quantize_dynamic`:
    int8 weights with a scale per output channel, activations quantized per batch); returns the int8
    model's headline metric against the fp32 model's on the run's validation set (predictions.jsonl beside
    final/), when there is one."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rows = validation_rows(final)
    from transformers import AutoConfig

    kind = problem_type(AutoConfig.from_pretrained(directory))
    metric = PROBLEM_TYPES[kind].headline[0]
    before = onnx_score(directory, tokenizer, rows) if rows else None
    quantized = directory / "model.int8.onnx"
    # a scale per output column: one scale for a whole matrix rounds its small columns away (docs/ARCHITECTURE.md)
    quantize_dynamic(directory / "model.onnx", quantized, weight_type=QuantType.QInt8, per_channel=True)
    for f in directory.glob("model.onnx*"):  # the fp32 graph and its external weights
        f.unlink()
    quantized.rename(directory / "model.onnx")
    report: dict[str, Any] = {
        "quantize": "int8",
        "method": "onnxruntime.quantization.quantize_dynamic (QInt8 weights, per channel)",
    }
    if rows is None:
        report["validation"] = f"no validation predictions in {final.parent / 'predictions.jsonl'}: not compared"
        return report
    after = onnx_score(directory, tokenizer, rows)
    loss = (after - before) if lower_is_better(metric) else (before - after)
    return report | {
        "validation": {"metric": metric, "fp32": before, "int8": after, "texts": len(rows[0])},
        "int8_loss": loss,
        "warning": loss > INT8_LOSS_WARNING,
    }


def export_onnx(
    final: Path,
    out: Path,
    force: bool = False,
    texts: list[str] | None = None,
    atol: float = 1e-4,
    quantize: str | None = None,
) -> dict[str, Any]:
    """Export final/ to OUT_DIR as ONNX, checked against PyTorch (and quantized to int8 with `quantize`,
    compared with fp32 on the run's validation set); returns the check (onnx_check.json).

    Raises:
        UserError: bad FINAL_DIR / OUT_DIR / quantization, missing packages, or ONNX Runtime's logits differ
            by more than `atol`.
    """
    final, out = Path(final), Path(out)
    if quantize is not None and quantize not in QUANTIZE:
        raise UserError(f"--quantize {quantize!r}: choose one of {', '.join(QUANTIZE)}")
    check_final(final)
    check_out_dir(out, force)
    import_onnx()
    started = time.perf_counter()
    tokenizer, model = load_final(final)
    names = input_names(tokenizer, model)
    texts = texts or CHECK_TEXTS
    exported = export_program(model, encode(tokenizer, texts[1:3] if len(texts) > 2 else texts, names))
    tmp = out.with_name(f".tmp-{out.name}")  # OUT_DIR appears only once the check has passed
    shutil.rmtree(tmp, ignore_errors=True)
    exported.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.copyfile(final / "config.json", tmp / "config.json")  # final/'s keys (label thresholds, windowing)
    check = compare(tmp, model, names, texts) | {"tolerance": atol, "export_seconds": time.perf_counter() - started}
    (tmp / CHECK_FILE).write_text(json.dumps(check, indent=2))
    if check["max_abs_diff"] > atol:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"ONNX Runtime's logits differ from PyTorch's by {check['max_abs_diff']:.2e} (> {atol:g}) "
            f"on {final}: nothing written"
        )
    if quantize:
        check["int8"] = quantize_int8(tmp, tokenizer, final)
        check["int8"]["max_abs_diff_vs_pytorch"] = compare(tmp, model, names, texts)["max_abs_diff"]
        (tmp / CHECK_FILE).write_text(json.dumps(check, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return check


def describe_check(check: dict[str, Any], out: str | Path) -> str:
    """`finetune export`'s account of an export: the graph's inputs and its largest logit difference from PyTorch,
    and with int8 the validation metric of both graphs (a warning line when int8 loses more than half a point,
    with what to do instead)."""
    lines = [
        f"wrote {out}/model.onnx (inputs {', '.join(check['inputs'])}; batch and sequence dynamic); "
        f"ONNX Runtime vs PyTorch: max |logit difference| {check['max_abs_diff']:.2e} over "
        f"{len(check['checks'])} batches (tolerance {check['tolerance']:g})"
    ]
    int8 = check.get("int8")
    if int8 and isinstance(int8["validation"], dict):
        v = int8["validation"]
        line = f"int8 on validation ({v['texts']} texts): {v['metric']} {v['int8']:.4f} against fp32 {v['fp32']:.4f}"
        if int8["warning"]:
            loss, most = 100 * int8["int8_loss"], 100 * INT8_LOSS_WARNING
            line = f"warning: {line}, a loss of {loss:.2f} points (more than {most:g}); {INT8_ADVICE}"
        lines.append(line)
    elif int8:
        lines.append(f"int8: {int8['validation']}")
    return "\n".join(lines)
