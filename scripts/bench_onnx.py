"""PyTorch vs ONNX Runtime latency of the default model (all-MiniLM-L6-v2 + a 2-label head) on this CPU.

The model is exported with `finetune export --onnx` (export_onnx: transformers' OnnxExporter, dynamic
axes, the parity check), then both runtimes classify the same tokenized SST-2 dev sentences
(max_length 64, as the demo) at batch 1 and batch 32, alternating runtime per batch so machine-load
drift hits both alike; tokenization is not timed. Both use the same number of intra-op threads.
The head is untrained (latency does not depend on the weights' values); the parity check compares
logits on the whole dev set.

    .venv/bin/python scripts/bench_onnx.py [--threads 2] [--batch1 200] [--out bench_onnx.json]

Prints a markdown table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def dev_texts(data_dir: Path) -> list[str]:
    lines = (data_dir / "sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]
    return [line.split("\t")[0] for line in lines if line.strip()]


def main() -> None:
    import os

    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch1", type=int, default=200, help="texts timed one at a time")
    parser.add_argument("--out", default="bench_onnx.json")
    args = parser.parse_args()

    import numpy as np
    import onnxruntime
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.deploy.export import export_onnx
    from finetune.model.load import resolve_model_path

    torch.set_num_threads(args.threads)
    data_dir = Path(os.environ.get("FINETUNE_DATA_DIR") or ROOT.parent / "shared" / "data")
    texts = dev_texts(data_dir)
    work = Path(tempfile.mkdtemp(prefix="bench_onnx_"))
    final = work / "final"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(resolve_model_path("minilm-l6"), num_labels=2)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm-l6"))
    tok.model_max_length = 64
    model.save_pretrained(final)
    tok.save_pretrained(final)
    started = time.perf_counter()
    check = export_onnx(final, work / "onnx")
    export_s = time.perf_counter() - started

    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = args.threads, 1
    # ORT's idle threads spin by default: alternating with PyTorch on a small CPU they starve its threads
    # (measured: PyTorch batch 1 25x slower than alone), so both runtimes wait passively here
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = onnxruntime.InferenceSession(str(work / "onnx" / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def batches(size: int, limit: int | None) -> list[dict]:
        chosen = texts[:limit] if limit else texts
        return [
            tok(chosen[i : i + size], padding=True, truncation=True, return_tensors="np")
            for i in range(0, len(chosen), size)
        ]

    results, worst, agree, total = {}, 0.0, 0, 0
    for size, limit in ((1, args.batch1), (32, None)):
        encs = batches(size, limit)
        times: dict[str, list[float]] = {"pytorch": [], "onnxruntime": []}
        for i, enc in enumerate(encs + encs[:3]):  # the first 3 again: warm-up rounds are dropped below
            feeds = {k: enc[k] for k in names}
            order = ("pytorch", "onnxruntime") if i % 2 else ("onnxruntime", "pytorch")
            out = {}
            for runtime in order:
                t = time.perf_counter()
                if runtime == "pytorch":
                    with torch.no_grad():
                        out[runtime] = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
                else:
                    out[runtime] = session.run(None, feeds)[0]
                times[runtime].append(time.perf_counter() - t)
            if size == 32 and i < len(encs):
                worst = max(worst, float(np.abs(out["pytorch"] - out["onnxruntime"]).max()))
                agree += int((out["pytorch"].argmax(-1) == out["onnxruntime"].argmax(-1)).sum())
                total += len(out["pytorch"])
        timed = {k: v[3:] for k, v in times.items()}  # drop the 3 warm-up batches
        results[f"batch {size}"] = {
            "batches": len(timed["pytorch"]),
            **{f"{k}_median_ms": 1000 * statistics.median(v) for k, v in timed.items()},
            **{f"{k}_p90_ms": 1000 * sorted(v)[int(0.9 * (len(v) - 1))] for k, v in timed.items()},
        }
        r = results[f"batch {size}"]
        r["speedup"] = r["pytorch_median_ms"] / r["onnxruntime_median_ms"]
    report = {
        "threads": args.threads,
        "export_seconds": export_s,
        "export_check": check,
        "results": results,
        "dev_max_abs_logit_diff": worst,
        "dev_argmax_agreement": agree / total,
        "dev_texts": total,
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(
        f"export {export_s:.1f} s; dev set ({total} texts): max |logit diff| {worst:.2e}, "
        f"same argmax {agree / total:.4f}; {args.threads} threads\n"
    )
    print("| batch | batches timed | PyTorch median (p90) ms | ONNX Runtime median (p90) ms | PyTorch / ORT |")
    print("|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name.split()[1]} | {r['batches']} | {r['pytorch_median_ms']:.2f} ({r['pytorch_p90_ms']:.2f}) | "
            f"{r['onnxruntime_median_ms']:.2f} ({r['onnxruntime_p90_ms']:.2f}) | {r['speedup']:.2f}x |"
        )


if __name__ == "__main__":
    main()
