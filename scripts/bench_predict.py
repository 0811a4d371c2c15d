"""Bulk prediction, side by side: `finetune predict` (PyTorch, ONNX fp32, ONNX int8) against
`transformers.pipeline` on the same exported model, texts and threads.

The texts are the first N sentences of SST-2's training split (one per line, a .txt input); every method
runs in a child process of its own, timed end to end (start, imports, model load, reading, prediction,
writing) with the child's own peak RSS (`os.wait4`). The pipeline reads the texts into a list and runs
`pipeline("text-classification", batch_size=B, truncation=True)` over it, writing one label per line.
Accuracy is each method's on SST-2's dev set (872 sentences), separately. The ONNX models are made once
with `finetune export --onnx` (and `--quantize int8`) into --work. Every child gets the same intra-op
threads (OMP_NUM_THREADS and torch.set_num_threads; ONNX Runtime's from torch).

    flock /tmp/cpu.lock .venv/bin/python scripts/bench_predict.py --model RUN/final [--texts 50000] \\
        [--small 5000] [--threads 2] [--batch-size 64] [--work /tmp/bench_predict] [--out bench_predict.json]
    .venv/bin/python scripts/bench_predict.py --model RUN/final --quantize-settings   # int8 settings' dev accuracy

Prints a markdown table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib

ROOT = benchlib.ROOT
FINETUNE = Path(sys.executable).parent / "finetune"

PIPELINE = """
import json, sys, torch
from transformers import pipeline
model, inp, out, batch, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
texts = [x for x in open(inp, encoding="utf-8").read().splitlines() if x.strip()]
clf = pipeline("text-classification", model=model, device="cpu", batch_size=batch, truncation=True)
with open(out, "w") as f:
    for r in clf(texts):
        f.write(json.dumps({"label": r["label"], "score": r["score"]}) + "\\n")
"""


def child(cmd: list[str], threads: int) -> dict[str, Any]:
    """Run `cmd`; its wall time and its own peak RSS (MB). A failure ends the script with its stderr."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-3000:]}")
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


def command(method: str, models: dict[str, Path], inp: Path, out: Path, args: argparse.Namespace) -> list[str]:
    if method == "pipeline":
        return [sys.executable, "-c", PIPELINE, str(models["pytorch"]), str(inp), str(out), str(args.batch_size)] + [
            str(args.threads)
        ]
    method, _, workers = method.partition("-w")  # pytorch-w2: two --workers
    backend = "pytorch" if method == "pytorch" else "onnx"
    return [
        str(FINETUNE),
        "predict",
        "--model",
        str(models[method]),
        "--input",
        str(inp),
        "--output",
        str(out),
        "--backend",
        backend,
        "--batch-size",
        str(args.batch_size),
        "--overwrite",
        "--workers",
        workers or "1",
    ]


def labels_of(out: Path) -> list[str]:
    return [json.loads(x)["label"] for x in out.read_text().splitlines()]


QUANTIZE_SETTINGS = {
    "per-tensor": {},
    "per-channel": {"per_channel": True},
    "reduce_range": {"reduce_range": True},
    "per-channel + reduce_range": {"per_channel": True, "reduce_range": True},
}


def quantize_settings(fp32: Path, work: Path, dev: list[str], gold: list[str], threads: int) -> dict[str, float]:
    """SST-2 dev accuracy of fp32 and of `quantize_dynamic` (QInt8 weights) under each of QUANTIZE_SETTINGS, in
    this process, through finetune.deploy.predict's ONNX Runtime path."""
    import shutil

    import numpy as np
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoTokenizer

    from finetune.deploy.predict import OnnxClassifier, model_logits

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(fp32)
    y = np.asarray([{"negative": 0, "positive": 1}[g] for g in gold])

    def accuracy(directory: Path) -> float:
        logits = model_logits(tok, OnnxClassifier(directory), dev, on_texts=lambda n: None)
        return float((logits.argmax(1) == y).mean())

    out = {"fp32": accuracy(fp32)}
    for name, kwargs in QUANTIZE_SETTINGS.items():
        d = work / f"quantize-{name.replace(' ', '')}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(fp32, d, ignore=shutil.ignore_patterns("model.onnx*"))
        quantize_dynamic(fp32 / "model.onnx", d / "model.onnx", weight_type=QuantType.QInt8, **kwargs)
        out[name] = accuracy(d)
        print(f"int8 {name}: SST-2 dev accuracy {out[name]:.4f} (fp32 {out['fp32']:.4f})", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a run's final/ (the demo: runs/sst2-minilm/final)")
    parser.add_argument("--texts", type=int, default=50_000)
    parser.add_argument("--small", type=int, default=5_000, help="finetune predict's peak RSS also at this many")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--work", default="/tmp/bench_predict")
    parser.add_argument(
        "--methods", default="pytorch,onnx-fp32,onnx-int8,pipeline", help="also pytorch-w2 (--workers 2)"
    )
    parser.add_argument("--out", default="bench_predict.json")
    parser.add_argument(
        "--quantize-settings", action="store_true", help="only: dev accuracy of four int8 settings of the fp32 export"
    )
    args = parser.parse_args()

    data = Path(os.environ.get("FINETUNE_DATA_DIR") or ROOT.parent / "shared" / "data") / "sst2"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    train = [x.split("\t")[0] for x in (data / "train.tsv").read_text(encoding="utf-8").splitlines()[1:] if x.strip()]
    dev_rows = [x.split("\t") for x in (data / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:] if x.strip()]
    gold = [{"0": "negative", "1": "positive"}[r[1]] for r in dev_rows]
    inputs = {"big": work / "texts.txt", "small": work / "texts_small.txt", "dev": work / "dev.txt"}
    inputs["big"].write_text("\n".join(train[: args.texts]) + "\n")
    inputs["small"].write_text("\n".join(train[: args.small]) + "\n")
    inputs["dev"].write_text("\n".join(r[0] for r in dev_rows) + "\n")

    final = Path(args.model).resolve()
    models = {"pytorch": final, "onnx-fp32": work / "onnx-fp32", "onnx-int8": work / "onnx-int8"}
    methods = args.methods.split(",")
    if args.quantize_settings:
        if not (models["onnx-fp32"] / "model.onnx").is_file():
            child([str(FINETUNE), "export", "--onnx", str(final), str(models["onnx-fp32"]), "--force"], args.threads)
        dev = [r[0] for r in dev_rows]
        result = quantize_settings(models["onnx-fp32"], work, dev, gold, args.threads)
        Path(args.out).write_text(json.dumps({"args": vars(args), "quantize_settings": result}, indent=2))
        return
    for name, extra in (("onnx-fp32", []), ("onnx-int8", ["--quantize", "int8"])):
        if name in methods and not (models[name] / "model.onnx").is_file():
            child([str(FINETUNE), "export", "--onnx", str(final), str(models[name]), "--force", *extra], args.threads)
    check = models["onnx-int8"] / "onnx_check.json"
    int8_check = json.loads(check.read_text()).get("int8") if check.is_file() else None

    results: dict[str, Any] = {}
    for method in methods:
        r: dict[str, Any] = {}
        for size in ("dev", "big"):
            out = work / f"{method}-{size}.jsonl"
            r[size] = child(command(method, models, inputs[size], out, args), args.threads)
            if size == "dev":
                pred = labels_of(out)
                r["dev_accuracy"] = sum(p == g for p, g in zip(pred, gold, strict=True)) / len(gold)
            else:
                assert len(labels_of(out)) == args.texts
        if method == "pytorch" and args.small:
            small_out = work / "pytorch-small.jsonl"
            r["small"] = child(command(method, models, inputs["small"], small_out, args), args.threads)
        r["texts_per_s"] = args.texts / r["big"]["wall_s"]
        results[method] = r
        print(f"{method}: {r['texts_per_s']:.0f} texts/s, {r['big']['peak_rss_mb']:.0f} MB", file=sys.stderr)

    base = results.get("pipeline", {}).get("texts_per_s")
    torch_rate = results.get("pytorch", {}).get("texts_per_s")
    rows = []
    for method, r in results.items():
        rows.append(
            [
                method if method == "pipeline" else f"finetune predict ({method})",
                f"{r['texts_per_s']:.0f}",
                f"{r['texts_per_s'] / base:.2f}x" if base else "-",
                f"{r['texts_per_s'] / torch_rate:.2f}x" if torch_rate else "-",
                f"{r['big']['peak_rss_mb']:.0f}",
                f"{r['dev_accuracy']:.4f}",
            ]
        )
    print(
        benchlib.markdown_table(
            [
                "method",
                f"texts/s ({args.texts:,} texts)",
                "vs pipeline",
                "vs finetune PyTorch",
                "peak RSS MB",
                "SST-2 dev accuracy",
            ],
            rows,
        )
    )
    if "small" in results.get("pytorch", {}):
        small, big = results["pytorch"]["small"]["peak_rss_mb"], results["pytorch"]["big"]["peak_rss_mb"]
        print(
            f"\nfinetune predict (pytorch) peak RSS: {small:.0f} MB at {args.small:,} texts, {big:.0f} MB at "
            f"{args.texts:,} ({100 * (big / small - 1):+.1f}%)"
        )
    summary = {"args": vars(args), "results": results, "int8_check": int8_check}
    Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
