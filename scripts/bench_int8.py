"""int8 ONNX variants side by side on one model: the fp32 export (`finetune export --onnx`, once) quantized five
ways by ONNX Runtime, each scored on the SST-2 dev sentences (`--dev`) against the fp32 graph and timed in the same
run.

Variants (QInt8 weights throughout):
- `dynamic per channel`: `quantize_dynamic(per_channel=True)`, a weight scale per output column (what
  `finetune export --quantize int8` does);
- `dynamic per tensor`: `quantize_dynamic` with one scale per matrix (ONNX Runtime's own default);
- `dynamic per channel + fp32 head`: per channel, with the head's matrix products (the classifier, and the pooler
  where the model has one: `head_nodes`) excluded (`nodes_to_exclude`), so the logits come from fp32 weights
  and fp32 activations;
- `dynamic per channel + fp32 embeddings`: per channel, the matrix products only (`op_types_to_quantize`): by
  default quantize_dynamic also stores the embedding tables (Gather) in int8;
- `static QDQ per channel`: `quantize_static` in QDQ format, activations QUInt8 with ranges calibrated (MinMax)
  on `--calibration` training sentences, the matrix products with a weight quantized (as the dynamic variants).

Per variant: dev accuracy with a 95% bootstrap interval, the loss against fp32 ONNX in points with a paired
bootstrap interval (the same resampled sentences scored by both), the labels that differ from fp32's, how far
the logits move (per text the largest |difference| from fp32's, averaged over the texts), and texts/s through
ONNX Runtime (2 intra-op threads, spinning off as `finetune predict` runs it, batches of 64 of the dev
sentences sorted by length, tokenization not timed) beside fp32 ONNX's and PyTorch's on final/ (same threads,
same batches). Runtimes alternate within each of `--rounds` rounds so load drift on a shared CPU hits all
alike; a runtime's texts/s is the median over the rounds.

    .venv/bin/python scripts/bench_int8.py --model RUN/final [--name "demo model"] [--record FILE]
    .venv/bin/python scripts/bench_int8.py --model RUN/final --dev ../shared/data/sst2/test_senteval.tsv  # 1,821 more

Prints a markdown table and writes JSON to --out; `--record FILE` appends one record per variant (loss vs fp32).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import ROOT, markdown_table, record_fields

from finetune.config.tasks import SINGLE  # importable once benchlib has put the repository on sys.path
from finetune.deploy.export import export_onnx
from finetune.deploy.final import load_final
from finetune.deploy.predict import OnnxClassifier, model_logits

VARIANTS = (
    "dynamic per channel",
    "dynamic per tensor",
    "dynamic per channel + fp32 head",
    "dynamic per channel + fp32 embeddings",
    "static QDQ per channel",
)
HEAD_SCOPE = "pooler"  # a module of the base model that belongs to the head (BERT's pooler: dense + tanh on [CLS])
RESAMPLES = 2000


def read_tsv(path: Path) -> tuple[list[str], list[int]]:
    """SST-2's sentences and labels: tabs, no quoting (the text has `"` characters), a header `sentence label`
    in train.tsv and dev.tsv, none in test_senteval.tsv."""
    with path.open(encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    rows = rows[1:] if rows and rows[0] == ["sentence", "label"] else rows
    return [r[0] for r in rows], [int(r[1]) for r in rows]


def head_nodes(onnx_file: Path) -> list[str]:
    """The matrix products of the classification head: MatMul/Gemm nodes outside the base model (the top-level
    module that holds most of them) or inside a `pooler`, read off the exporter's module scopes
    (`pkg.torch.onnx.name_scopes`)."""
    import onnx

    graph = onnx.load(str(onnx_file), load_external_data=False).graph
    scopes: dict[str, list[str]] = {}
    for node in graph.node:
        if node.op_type in ("MatMul", "Gemm"):
            meta = {p.key: p.value for p in node.metadata_props}
            scopes[node.name] = json.loads(meta.get("pkg.torch.onnx.name_scopes", "[]").replace("'", '"'))
    tops = [s[1] for s in scopes.values() if len(s) > 1]
    if not tops:
        raise SystemExit(f"{onnx_file}: no module scopes on its MatMul/Gemm nodes, cannot find the head")
    base = max(set(tops), key=tops.count)
    head = [n for n, s in scopes.items() if s[1:2] != [base] or any(x.split(".")[-1] == HEAD_SCOPE for x in s)]
    # quantize_dynamic first rewrites a Gemm as `<name>_MatMul` + `<name>_Add`, then matches nodes_to_exclude
    return [m for n in head for m in (n, f"{n}_MatMul")]


def weight_products(onnx_file: Path) -> list[str]:
    """MatMul/Gemm nodes with a constant weight (not attention's activation-by-activation products)."""
    import onnx

    graph = onnx.load(str(onnx_file), load_external_data=False).graph
    constants = {i.name for i in graph.initializer}
    return [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in constants]


class Calibration:
    """quantize_static's CalibrationDataReader: the calibration sentences in batches of 16, as the graph's inputs."""

    def __init__(self, tokenizer: Any, texts: list[str], names: list[str]) -> None:
        encoded = [
            tokenizer(texts[i : i + 16], padding=True, truncation=True, return_tensors="np")
            for i in range(0, len(texts), 16)
        ]
        self.batches = [{k: enc[k].astype(np.int64) for k in names} for enc in encoded]
        self.next = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        self.next += 1
        return self.batches[self.next - 1] if self.next <= len(self.batches) else None

    def rewind(self) -> None:
        self.next = 0


def quantize(variant: str, fp32: Path, out: Path, tokenizer: Any, calibration: list[str]) -> float:
    """out/ as fp32/ with model.onnx quantized as `variant`; the seconds the quantization took."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(fp32, out, ignore=shutil.ignore_patterns("model.onnx*"))
    src, dst = fp32 / "model.onnx", out / "model.onnx"
    started = time.perf_counter()
    if variant.startswith("dynamic"):
        exclude = head_nodes(src) if variant.endswith("fp32 head") else None
        if exclude:
            print(f"{variant}: nodes left in fp32: {', '.join(exclude)}", flush=True)
        quantize_dynamic(
            src,
            dst,
            weight_type=QuantType.QInt8,
            per_channel="per channel" in variant,
            nodes_to_exclude=exclude,
            # only the matrix products: the embedding tables (Gather) stay fp32
            op_types_to_quantize=["MatMul"] if variant.endswith("fp32 embeddings") else None,
        )
    else:
        session_inputs = OnnxClassifier(fp32, threads=1).inputs
        quantize_static(
            src,
            dst,
            Calibration(tokenizer, calibration, session_inputs),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            nodes_to_quantize=weight_products(src),
            calibrate_method=CalibrationMethod.MinMax,
        )
    return time.perf_counter() - started


def paired_loss(right32: np.ndarray, right8: np.ndarray, seed: int) -> list[float]:
    """95% percentile interval of fp32 accuracy - int8 accuracy (points) over resamples of the same sentences."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(right32), (RESAMPLES, len(right32)))
    diffs = 100 * (right32[idx].mean(1) - right8[idx].mean(1))
    return [float(x) for x in np.percentile(diffs, [2.5, 97.5])]


def batches(tokenizer: Any, texts: list[str], size: int) -> list[dict[str, np.ndarray]]:
    """The texts tokenized as prediction does (cut at final/'s max_length), sorted by length, in batches."""
    lengths = [len(x) for x in tokenizer(texts, truncation=True)["input_ids"]]
    order = sorted(range(len(texts)), key=lengths.__getitem__)
    chunks = [[texts[i] for i in order[s : s + size]] for s in range(0, len(texts), size)]
    return [dict(tokenizer(c, padding=True, truncation=True, return_tensors="np")) for c in chunks]


def runners(final: Path, dirs: dict[str, Path], threads: int) -> Iterator[tuple[str, Callable[[dict], Any]]]:
    """(name, run one batch) for PyTorch on final/ and ONNX Runtime on each directory, `threads` threads each."""
    import torch

    torch.set_num_threads(threads)
    _, model = load_final(final)

    def pytorch(batch: dict[str, np.ndarray]) -> Any:
        with torch.no_grad():
            return model(**{k: torch.from_numpy(v) for k, v in batch.items()}).logits

    yield "pytorch", pytorch
    for name, directory in dirs.items():
        session = OnnxClassifier(directory, threads=threads).session
        inputs = [i.name for i in session.get_inputs()]
        yield name, lambda b, s=session, names=inputs: s.run(["logits"], {k: b[k].astype(np.int64) for k in names})


def throughput(run: dict[str, Callable[[dict], Any]], data: list[dict], rounds: int) -> dict[str, float]:
    """texts/s of each runner over `data`: the median of `rounds` passes, the runners' order rotating per round."""
    texts = sum(len(b["input_ids"]) for b in data)
    for fn in run.values():  # warm-up: ONNX Runtime plans its kernels on the first shapes it sees
        fn(data[-1])
    seconds: dict[str, list[float]] = {name: [] for name in run}
    names = list(run)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            started = time.perf_counter()
            for b in data:
                run[name](b)
            seconds[name].append(time.perf_counter() - started)
    return {name: texts / statistics.median(s) for name, s in seconds.items()}


def score(directory: Path, tokenizer: Any, texts: list[str], gold: np.ndarray, threads: int) -> dict[str, Any]:
    """Logits and predictions of directory/model.onnx on `texts`, its accuracy with a bootstrap interval."""
    from finetune.evaluation.metrics import bootstrap_ci

    logits = model_logits(tokenizer, OnnxClassifier(directory, threads=threads), texts, on_texts=lambda n: None)
    pred = logits.argmax(1)
    ci = bootstrap_ci(SINGLE, gold, logits, logits.shape[1], resamples=RESAMPLES)["accuracy_ci"]
    return {"logits": logits, "pred": pred, "accuracy": float((pred == gold).mean()), "accuracy_ci": ci}


def compare(s: dict[str, Any], base: dict[str, Any], gold: np.ndarray, seed: int) -> dict[str, Any]:
    """A variant's scores against fp32's on the same sentences: accuracy lost (points, with a paired interval),
    labels that differ, and how far its logits move (per text the largest |difference|, averaged)."""
    flips = int((s["pred"] != base["pred"]).sum())
    same = s is base
    return {
        "accuracy": s["accuracy"],
        "accuracy_ci": s["accuracy_ci"],
        "loss_points": 100 * (base["accuracy"] - s["accuracy"]),
        "loss_points_ci": None if same else paired_loss(base["pred"] == gold, s["pred"] == gold, seed),
        "flips": flips,
        "agreement": 1 - flips / len(gold),
        "mean_logit_diff": float(np.abs(s["logits"] - base["logits"]).max(1).mean()),
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    """The markdown table of the variants' results."""
    rows = []
    for name, r in results.items():
        ci = "-" if r["loss_points_ci"] is None else "[{:.2f}, {:.2f}]".format(*r["loss_points_ci"])
        rows.append(
            [
                name,
                "{:.4f} [{:.4f}, {:.4f}]".format(r["accuracy"], *r["accuracy_ci"]),
                f"{r['loss_points']:.2f} {ci}",
                f"{r['flips']} ({100 * r['agreement']:.1f}%)",
                f"{r['mean_logit_diff']:.3f}",
                f"{r['texts_per_s']:.0f}",
                f"{r['vs_fp32_onnx']:.2f}",
                f"{r['vs_pytorch']:.2f}",
            ]
        )
    header = ["model", "accuracy [95% CI]", "loss vs fp32 (points) [paired 95% CI]", "flips vs fp32 (agreement)"]
    header += ["mean max abs logit diff vs fp32", "texts/s", "x fp32 ONNX", "x PyTorch"]
    return markdown_table(header, rows)


def arguments() -> argparse.Namespace:
    data = Path(os.environ.get("FINETUNE_DATA_DIR") or ROOT.parent / "shared" / "data") / "sst2"
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a run's final/")
    parser.add_argument("--name", default=None, help="the model's name in records (default: --model)")
    parser.add_argument("--dev", default=str(data / "dev.tsv"))
    parser.add_argument("--train", default=str(data / "train.tsv"), help="calibration sentences are drawn here")
    parser.add_argument("--calibration", type=int, default=200)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default="/tmp/bench_int8")
    parser.add_argument("--out", default="bench_int8.json")
    parser.add_argument("--record", default=None, help="append one record per variant to this .jsonl")
    args = parser.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants {unknown}: choose among {list(VARIANTS)}")
    return args


def main() -> None:
    args = arguments()
    final, work = Path(args.model).resolve(), Path(args.work)
    texts, labels = read_tsv(Path(args.dev))
    gold = np.asarray(labels)
    train, _ = read_tsv(Path(args.train))
    rng = np.random.default_rng(args.seed)
    calibration = [train[i] for i in rng.choice(len(train), args.calibration, replace=False)]
    fp32 = work / "fp32"
    export_onnx(final, fp32, force=True)
    tokenizer, _ = load_final(final)
    dirs = {"fp32": fp32}
    made: dict[str, float] = {}
    for i, variant in enumerate(args.variants.split(",")):
        dirs[variant] = work / f"int8-{i}"
        made[variant] = quantize(variant, fp32, dirs[variant], tokenizer, calibration)
        print(f"{variant}: quantized in {made[variant]:.1f} s", flush=True)
    scores = {name: score(d, tokenizer, texts, gold, args.threads) for name, d in dirs.items()}
    data = batches(tokenizer, texts, args.batch_size)
    speed = throughput(dict(runners(final, dirs, args.threads)), data, args.rounds)
    results = {
        name: compare(scores[name], scores["fp32"], gold, args.seed)
        | {
            "texts_per_s": speed[name],
            "vs_fp32_onnx": speed[name] / speed["fp32"],
            "vs_pytorch": speed[name] / speed["pytorch"],
            "quantize_seconds": made.get(name),
        }
        for name in dirs
    }
    print(f"{args.name or final}: PyTorch {speed['pytorch']:.0f} texts/s, {len(texts)} sentences of {args.dev}")
    print(table(results))
    Path(args.out).write_text(json.dumps({"args": vars(args), "pytorch_texts_per_s": speed["pytorch"], **results}))
    if args.record:
        with Path(args.record).open("a", encoding="utf-8") as f:
            for name in list(dirs)[1:]:
                split = Path(args.dev).stem  # dev, or test_senteval
                f.write(json.dumps(record(args.name or str(final), split, name, results[name], results["fp32"])) + "\n")


def record(model: str, split: str, variant: str, r: dict[str, Any], fp32: dict[str, Any]) -> dict[str, Any]:
    """A docs/results record: the variant's accuracy loss on `split` vs fp32 ONNX, its accuracy, flips, speed."""
    what = (
        f"SST-2 {split}, {model} (fp32 ONNX {fp32['accuracy']:.4f}): int8 {variant}, accuracy {r['accuracy']:.4f}, "
        f"{r['flips']} labels differ from fp32, logits moved {r['mean_logit_diff']:.3f} a text (mean largest), "
        f"{r['vs_fp32_onnx']:.2f}x fp32 ONNX's texts/s, {r['vs_pytorch']:.2f}x PyTorch's"
    )
    interval = [round(x, 2) for x in r["loss_points_ci"]]
    fields = record_fields(
        "prediction", what, f"{split} accuracy loss vs fp32 (points)", round(r["loss_points"], 2), interval, [42]
    )
    return fields | {
        "accuracy": r["accuracy"],
        "flips": r["flips"],
        "mean_logit_diff": round(r["mean_logit_diff"], 4),
        "texts_per_s": round(r["texts_per_s"], 1),
    }


if __name__ == "__main__":
    main()
