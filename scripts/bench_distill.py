"""What `finetune distill` buys: MiniLM trained on its labels alone against MiniLM distilled from an MPNet teacher.

Per data set: the MPNet teacher trained once with its shipped config (configs/*-mpnet.yaml), then per seed
- MiniLM on the labels alone: the shipped configs/*-minilm.yaml, as `finetune train` runs it;
- MiniLM distilled: `finetune distill --teacher <the teacher's final/>` with the same MiniLM config (distill.*
  defaults: distill.loss=mse, alpha 0; the recorded rows without a try's name ran with kl, temperature 2, alpha 0.5),
  plus the unlabeled texts the data set has;
each run's evaluation metrics with their bootstrap intervals and its wall time. Then, once per data set (seed 0's
models), `finetune predict` texts/s (a child process timed end to end: start-up, load, reading, prediction, writing)
of the teacher (PyTorch), the distilled student (PyTorch) and the distilled student as int8 ONNX
(`finetune export --onnx --quantize int8`), on the evaluation texts repeated to --predict-rows. The teacher's
logits are computed by the first seed's distillation (its wall time includes them); later seeds start from a copy of
that cache.

Data: the demo's SST-2 slice (the first 16,000 training rows, scored on the 872 dev sentences; unlabeled: the other
51,349 training sentences, labels dropped, written to a TSV in --work); MRPC (3,668 pairs, dev F1 and accuracy;
no unlabeled pairs); AG News (the 8,000-row sample, scored on the 7,600-row test set; nothing unlabeled beyond
train_8k). Everything lands in --work (default /tmp/bench_distill); a rerun reuses finished runs, exports and
timings, so an interrupted bench continues.

A try (`--variant NAME --set key=value ...`): the student runs of --kinds again with the overrides, into their own
folders (`<kind>-seed<N>-<NAME>`, a distillation starting from the shipped run's teacher cache), recorded as their own
rows; the teacher and the prediction speeds are the shipped recipe's and are not run or recorded again.

    .venv/bin/python scripts/bench_distill.py [--datasets sst2 mrpc agnews] [--seeds 0 1 2] [--predict-rows 5000]
        [--work DIR] [--summarize] [--record docs/results/distill.jsonl]
        [--variant NAME --set key=value ... [--kinds labels distilled]]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import ROOT, append_jsonl, markdown_table, pair_f1, record_fields

from finetune.core.fileio import TEACHER_DIR

DATA = Path(os.environ.get("FINETUNE_DATA_DIR") or ROOT.parent / "shared" / "data")
SST2_SLICE = 16_000  # configs/sst2-*.yaml's data.max_train_samples
SETS: dict[str, dict[str, Any]] = {
    "sst2": {
        "name": "SST-2 demo slice (16,000)",
        "teacher": ROOT / "configs" / "sst2-mpnet.yaml",
        "student": ROOT / "configs" / "sst2-minilm.yaml",
        "metrics": [(None, "accuracy")],
        "predict": (DATA / "sst2" / "dev.tsv", "sentence", None),
    },
    "mrpc": {
        "name": "MRPC",
        "teacher": ROOT / "configs" / "mrpc-mpnet.yaml",
        "student": ROOT / "configs" / "mrpc-minilm.yaml",
        "metrics": [(None, "f1"), (None, "accuracy")],
        "predict": (DATA / "mrpc" / "dev.tsv", "#1 String", "#2 String"),
    },
    "agnews": {
        "name": "AG News 8,000",
        "teacher": ROOT / "configs" / "agnews-mpnet.yaml",
        "student": ROOT / "configs" / "agnews-minilm.yaml",
        "metrics": [("test", "accuracy")],
        "predict": (DATA / "ag_news" / "test.csv", "content", None),
    },
}
KINDS = {"teacher": "MPNet teacher", "labels": "MiniLM on the labels", "distilled": "MiniLM distilled"}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "FINETUNE_DATA_DIR": str(DATA)}


def cli(args: list[str]) -> float:
    """`finetune ARGS` offline from the project root (this checkout's package); its wall time in seconds.

    Raises:
        SystemExit: the command failed (its stderr's tail).
    """
    cmd = [sys.executable, "-m", "finetune.cli", *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    lines = proc.stderr.strip().splitlines()
    if lines:
        print(lines[-1], file=sys.stderr, flush=True)
    return wall


def unlabeled_file(name: str, work: Path) -> Path | None:
    """The data set's unlabeled texts as a file the student's config reads (None: it has none): for SST-2 the
    training sentences after the demo's slice, their labels dropped."""
    if name != "sst2":
        return None
    out = work / "sst2" / "unlabeled.tsv"
    if not out.is_file():
        lines = (DATA / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text("sentence\n" + "".join(line.split("\t")[0] + "\n" for line in lines[1 + SST2_SLICE :]))
        tmp.replace(out)
    return out


def run(
    kind: str,
    spec: dict[str, Any],
    run_dir: Path,
    seed: int | None,
    teacher: Path | None,
    extra: Path | None,
    overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One training run (a finished one is read again): its eval.json (with a pair task's F1) and wall time."""
    done = run_dir / "bench.json"
    if done.is_file():
        result = json.loads(done.read_text())
    else:
        config = spec["teacher"] if kind == "teacher" else spec["student"]
        common = ["--config", str(config), f"run.output_dir={run_dir}", "run.overwrite=true"]
        common += [f"run.seed={42 + seed}"] if seed is not None else []
        common += list(overrides)
        if kind == "distilled":
            assert teacher is not None
            args = ["distill", "--teacher", str(teacher), *common]
            args += [f"distill.unlabeled_file={extra}"] if extra is not None else []
        else:
            args = ["train", *common]
        wall = cli(args)
        result = {"eval": json.loads((run_dir / "eval.json").read_text()), "wall_s": wall}
    if (None, "f1") in spec["metrics"] and "f1" not in result["eval"]:
        result["eval"]["f1"], result["eval"]["f1_ci"] = pair_f1(run_dir)
    done.write_text(json.dumps(result))
    return result


def share_teacher_cache(first: Path, run_dir: Path) -> None:
    """Start a later seed's distillation with the first seed's teacher logits: the same teacher over the same
    texts (the cache checks both and computes afresh where either differs), so only the first seed's wall time
    includes computing them."""
    source = first / TEACHER_DIR
    if source.is_dir() and not run_dir.exists():
        shutil.copytree(source, run_dir / TEACHER_DIR)


def predict_input(spec: dict[str, Any], rows: int, work: Path) -> Path:
    """The evaluation file's data lines repeated to `rows` texts, in its own format (the header once)."""
    source = spec["predict"][0]
    out = work / f"predict-input{source.suffix}"
    if not out.is_file():
        header, *lines = source.read_text(encoding="utf-8").splitlines()
        lines = [x for x in lines if x.strip()]
        repeated = (lines * (rows // len(lines) + 1))[:rows]
        out.write_text("\n".join([header, *repeated]) + "\n", encoding="utf-8")
    return out


def texts_per_s(model: Path, backend: str, spec: dict[str, Any], rows: int, work: Path, tag: str) -> float:
    """`finetune predict` of `rows` texts with `model`: texts per second of the whole command (kept in --work)."""
    done = work / f"predict-{tag}.json"
    if done.is_file():
        return json.loads(done.read_text())["texts_per_s"]
    _, text, pair = spec["predict"]
    args = ["predict", "--model", str(model), "--input", str(predict_input(spec, rows, work)), "--backend", backend]
    args += ["--output", str(work / f"predict-{tag}.jsonl"), "--overwrite", "--text-column", text]
    args += ["--pair-column", pair] if pair else []
    rate = rows / cli(args)
    done.write_text(json.dumps({"texts_per_s": rate}))
    return rate


def one(name: str, seeds: list[int], work: Path, rows: int, try_: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every run and timing of one data set: one result per run, then one for the prediction speeds. With a try
    (`{"variant", "overrides", "kinds"}`) only its student runs."""
    spec, cell = SETS[name], work / name
    extra = unlabeled_file(name, work)
    teacher = run("teacher", spec, cell / "teacher", None, None, None)
    final = cell / "teacher" / "final"
    results = [] if try_ else [{"dataset": name, "kind": "teacher", "seed": None, **teacher}]
    tag, overrides = (f"-{try_['variant']}", tuple(try_["overrides"])) if try_ else ("", ())
    for seed in seeds:
        for kind in try_["kinds"] if try_ else ("labels", "distilled"):
            run_dir = cell / f"{kind}-seed{seed}{tag}"
            if kind == "distilled" and run_dir != cell / f"distilled-seed{seeds[0]}":
                share_teacher_cache(cell / f"distilled-seed{seeds[0]}", run_dir)
            got = run(kind, spec, run_dir, seed, final, extra, overrides)
            variant = {"variant": try_["variant"], "overrides": try_["overrides"]} if try_ else {}
            results.append({"dataset": name, "kind": kind, "seed": seed, **variant, **got})
    if try_:
        return results
    student = cell / f"distilled-seed{seeds[0]}" / "final"
    onnx = cell / "student-int8"
    if not (onnx / "model.onnx").is_file():
        cli(["export", "--onnx", "--quantize", "int8", str(student), str(onnx), "--force"])
    speed = {
        "teacher (PyTorch)": texts_per_s(final, "pytorch", spec, rows, cell, "teacher"),
        "student (PyTorch)": texts_per_s(student, "pytorch", spec, rows, cell, "student"),
        "student (int8 ONNX)": texts_per_s(onnx, "onnx", spec, rows, cell, "student-int8"),
    }
    results.append({"dataset": name, "kind": "predict", "seed": seeds[0], "rows": rows, "texts_per_s": speed})
    return results


def _metric(r: dict[str, Any], split: str | None, key: str) -> tuple[float, list[float] | None]:
    ev = r["eval"][split] if split else r["eval"]
    return ev[key], ev.get(f"{key}_ci")


def _label(split: str | None, key: str) -> str:
    return f"{split}.{key}" if split else key


def groups(results: list[dict[str, Any]]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """The training results by data set and kind, in first-seen order (prediction speeds apart)."""
    trained = [r for r in results if r["kind"] != "predict"]
    keys = dict.fromkeys((r["dataset"], who(r)) for r in trained)
    return [(n, k, [r for r in trained if (r["dataset"], who(r)) == (n, k)]) for n, k in keys]


def who(r: dict[str, Any]) -> str:
    """A result's model column: its kind, and a try's name and overrides."""
    base = KINDS[r["kind"]]
    return f"{base} ({r['variant']}: {' '.join(r['overrides'])})" if r.get("variant") else base


def _middle(group: list[dict[str, Any]], split: str | None, key: str) -> dict[str, Any]:
    """The run whose value is the median (of two, the higher): its interval stands for the row."""
    ranked = sorted(group, key=lambda r: _metric(r, split, key)[0])
    return ranked[len(ranked) // 2]


def table(results: list[dict[str, Any]]) -> str:
    """One row per data set and kind (medians over seeds, the middle run's interval), then the predict speeds."""
    rows = []
    for name, kind, group in groups(results):
        for split, key in SETS[name]["metrics"]:
            values = [_metric(r, split, key)[0] for r in group]
            ci = _metric(_middle(group, split, key), split, key)[1]
            interval = f"{ci[0]:.4f} - {ci[1]:.4f}" if ci else "-"
            walls = float(np.median([r["wall_s"] for r in group]))
            rows.append([SETS[name]["name"], kind, len(group), _label(split, key), float(np.median(values)),
                         interval, ", ".join(f"{v:.4f}" for v in values), f"{walls:.0f}"])  # fmt: skip
    header = ["data", "model", "seeds", "metric", "median", "95% interval", "runs", "wall s"]
    speeds = [
        [SETS[r["dataset"]]["name"], who, f"{rate:.0f}", r["rows"]]
        for r in results
        if r["kind"] == "predict"
        for who, rate in r["texts_per_s"].items()
    ]
    speed_table = markdown_table(["data", "`finetune predict`", "texts/s", "texts"], speeds) if speeds else ""
    return markdown_table(header, rows) + ("\n\n" + speed_table if speeds else "")


def records(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records for docs/results: per data set, kind and metric the median over seeds with every seed's value and the
    middle run's interval; the wall times; the prediction speeds."""
    out = []
    for name, kind, group in groups(results):
        seeds = [r["seed"] for r in group if r["seed"] is not None]
        what = f"{SETS[name]['name']}: {kind}"
        for split, key in SETS[name]["metrics"]:
            values = [_metric(r, split, key)[0] for r in group]
            ci = _metric(_middle(group, split, key), split, key)[1]
            out.append(
                record_fields("distill", what, _label(split, key), float(np.median(values)), ci, seeds)
                | {"runs": values}
            )
        walls = [r["wall_s"] for r in group]
        out.append(record_fields("distill", what, "wall s", float(np.median(walls)), None, seeds) | {"runs": walls})
    for r in results:
        if r["kind"] == "predict":
            for who, rate in r["texts_per_s"].items():
                what = f"{SETS[r['dataset']]['name']}: `finetune predict` {who}, {r['rows']:,} texts"
                out.append(record_fields("distill", what, "texts/s", rate, None, [r["seed"]]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--predict-rows", type=int, default=5000, help="texts each `finetune predict` timing labels")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_distill"))
    parser.add_argument("--record", type=Path, default=None, help="append the results to this records file")
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="run nothing: the table (and --record) from --work's results.jsonl (a try's: results-NAME.jsonl)",
    )
    parser.add_argument("--variant", default=None, help="a name for --set's overrides: a try's runs, kept apart")
    parser.add_argument("--set", nargs="*", default=[], help="dotted overrides of a try's student runs")
    parser.add_argument("--kinds", nargs="+", default=["labels", "distilled"], choices=["labels", "distilled"])
    args = parser.parse_args()
    if bool(args.variant) != bool(args.set):
        parser.error("--variant and --set go together")
    try_ = {"variant": args.variant, "overrides": args.set, "kinds": args.kinds} if args.variant else None
    saved = args.work / (f"results-{args.variant}.jsonl" if args.variant else "results.jsonl")
    if args.summarize:
        results = [json.loads(line) for line in saved.read_text().splitlines() if line.strip()]
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        saved.unlink(missing_ok=True)  # the runs themselves are kept in --work and read again
        results = []
        for name in args.datasets:
            for r in one(name, args.seeds, args.work, args.predict_rows, try_):
                results.append(r)
                append_jsonl(saved, [r])
    print(table(results))
    if args.record:
        rows = records(results)
        measured = re.sub(r" --summarize| --record \S+", "", rows[0]["command"])  # the command that ran them
        append_jsonl(args.record, [r | {"command": measured} for r in rows])


if __name__ == "__main__":
    main()
