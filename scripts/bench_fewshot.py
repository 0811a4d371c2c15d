"""A handful of labels a class: `finetune init` + `finetune train` as a user runs them, against SetFit, on the
same random splits of real data, side by side in one run.

Each split draws `--shots` training rows a class (seeded, SetFit's protocol) from a data set's training file; both
systems train on it with the same local encoder folder, and both label the full test set (prediction is not
timed: `wall_s` is init + train for ours, model load + training for SetFit). Ours: `finetune init` on the split's
CSV with `--model`, then `finetune train --config` the written file unedited, then `finetune predict` on the test
texts. SetFit 1.2.0 (the bench's own extra, `pip install -e '.[bench]'`): `SetFitModel.from_pretrained(folder)`,
batch 16, 20 pair iterations, its defaults otherwise (a logistic-regression head).

    .venv/bin/python scripts/bench_fewshot.py --data agnews sst2 trec sms --shots 8 --splits 5 \\
        --models minilm-l6 --work /tmp/bf           # results in /tmp/bf/results.jsonl, a job at a time
    .venv/bin/python scripts/bench_fewshot.py --work /tmp/bf --summarize [--record]   # the table (and records)

A finished job is not run again (its line in results.jsonl), so a stopped bench continues where it was.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib

ROOT = benchlib.ROOT
DATA = Path(os.environ.get("FINETUNE_DATA_DIR") or ROOT.parent / "shared" / "data")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "FINETUNE_DATA_DIR": str(DATA)}
AG_NAMES = ["World", "Sports", "Business", "Sci/Tech"]
SMS_TEST_SHARE = 0.2  # SMS Spam has no split: a seeded stratified fifth of the distinct messages is the test set
SETFIT = {"batch_size": 16, "num_iterations": 20}


def _tsv(path: Path, header: bool) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return rows[1:] if header else rows


def _agnews(name: str) -> list[tuple[str, str]]:
    with open(DATA / "ag_news" / name, newline="", encoding="utf-8") as f:
        return [(r["content"], AG_NAMES[int(r["label"]) - 1]) for r in csv.DictReader(f)]


def _trec(name: str) -> list[tuple[str, str]]:
    lines = (DATA / "trec" / name).read_text(encoding="latin-1").splitlines()  # one 0xF0 byte (SOURCE.md)
    return [(line.split(" ", 1)[1].strip(), line.split(":", 1)[0]) for line in lines if line.strip()]


def _sms() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    rows = [(r[1], r[0]) for r in _tsv(DATA / "sms_spam" / "SMSSpamCollection", header=False) if len(r) == 2]
    distinct = list(dict.fromkeys(rows))  # duplicates kept out of both sides
    rng = random.Random(0)
    test: list[tuple[str, str]] = []
    for label in sorted({y for _, y in distinct}):
        group = [r for r in distinct if r[1] == label]
        test += rng.sample(group, round(SMS_TEST_SHARE * len(group)))
    held = set(test)
    return [r for r in distinct if r not in held], test


def load(name: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train pool, test set) of `name` as (text, label name) rows."""
    if name == "sst2":
        names = {"0": "negative", "1": "positive"}
        train = [(r[0].strip(), names[r[1]]) for r in _tsv(DATA / "sst2" / "train.tsv", header=True)]
        return train, [(r[0].strip(), names[r[1]]) for r in _tsv(DATA / "sst2" / "test_senteval.tsv", header=False)]
    if name == "agnews":
        return _agnews("train_8k.csv"), _agnews("test.csv")
    if name == "trec":
        return _trec("train_5500.label"), _trec("TREC_10.label")
    if name == "sms":
        return _sms()
    raise SystemExit(f"unknown data set {name!r}: agnews, sst2, trec, sms")


def draw(pool: list[tuple[str, str]], shots: int, split: int) -> list[tuple[str, str]]:
    """`shots` distinct rows a class, seeded by the split number (the same rows for both systems)."""
    rng = random.Random(split)
    by: dict[str, list[str]] = {}
    for text, label in dict.fromkeys(pool):
        by.setdefault(label, []).append(text)
    rows = [(t, label) for label in sorted(by) for t in rng.sample(by[label], shots)]
    rng.shuffle(rows)
    return rows


def write_csv(path: Path, rows: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["text", "label"])
        w.writerows(rows)


def cli(args: list[str]) -> None:
    """`finetune ARGS` offline from the project root.

    Raises:
        SystemExit: the command failed (its stderr's tail).
    """
    proc = subprocess.run(
        [sys.executable, "-m", "finetune.cli", *args], cwd=ROOT, env=ENV, text=True, capture_output=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"finetune {' '.join(args)} failed: {proc.stderr[-3000:]}")


def ours(
    rows: list[tuple[str, str]], test: list[tuple[str, str]], model: str, folder: Path, overrides: list[str]
) -> tuple[float, float]:
    """(test accuracy, seconds of init + train) of `finetune init --model MODEL` then `finetune train` (with
    `overrides`: a variant's dotted keys on the command line, the config as written otherwise)."""
    write_csv(folder / "train.csv", rows)
    write_csv(folder / "test.csv", test)
    config = folder / "init.yaml"
    start = time.perf_counter()
    cli(["init", str(folder / "train.csv"), "-o", str(config), "--model", model, "--force"])
    cli(["train", "--config", str(config), f"run.output_dir={folder / 'run'}", "run.overwrite=true", *overrides])
    wall = time.perf_counter() - start
    out = folder / "predictions.jsonl"
    cli(
        [
            "predict",
            "--model",
            str(folder / "run" / "final"),
            "--input",
            str(folder / "test.csv"),
            "--output",
            str(out),
            "--overwrite",
        ]
    )
    got = [json.loads(line)["label"] for line in out.read_text().splitlines()]
    return sum(g == y for g, (_, y) in zip(got, test, strict=True)) / len(test), wall


def setfit(
    rows: list[tuple[str, str]], test: list[tuple[str, str]], model: str, seed: int, folder: Path
) -> tuple[float, float]:
    """(test accuracy, seconds of model load + training) of SetFit with its defaults (SETFIT); its checkpoints go
    to `folder` and nothing is reported to experiment trackers (its defaults write ./checkpoints and mlflow.db)."""
    from datasets import Dataset
    from setfit import SetFitModel, Trainer, TrainingArguments

    from finetune.model.sources import resolve_model_path

    start = time.perf_counter()
    fit = SetFitModel.from_pretrained(resolve_model_path(model))
    trainer = Trainer(
        model=fit,
        args=TrainingArguments(seed=seed, output_dir=str(folder), report_to="none", **SETFIT),
        train_dataset=Dataset.from_dict({"text": [t for t, _ in rows], "label": [y for _, y in rows]}),
    )
    trainer.train()
    wall = time.perf_counter() - start
    got = fit.predict([t for t, _ in test], batch_size=64)
    return sum(str(g) == y for g, (_, y) in zip(got, test, strict=True)) / len(test), wall


def job_key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["data"], r["shots"], r["model"], r["system"], r["split"], r.get("variant", ""))


def run_jobs(args: argparse.Namespace) -> None:
    results = args.work / "results.jsonl"
    done = {job_key(json.loads(x)) for x in results.read_text().splitlines()} if results.is_file() else set()
    for name in args.data:
        pool, test = load(name)
        for shots in args.shots:
            for split in range(args.splits):
                rows = draw(pool, shots, split)
                for model in args.models:
                    for system in args.systems:
                        job = {"data": name, "shots": shots, "model": model, "system": system, "split": split}
                        if system == "finetune" and args.variant:
                            job |= {"variant": args.variant, "overrides": args.set}
                        if job_key(job) in done:
                            continue
                        folder = args.work / f"{name}-{shots}-{model}-{split}"
                        if system == "finetune":
                            acc, wall = ours(rows, test, model, folder / f"ours{args.variant}", args.set)
                        else:
                            acc, wall = setfit(rows, test, model, split, folder / "setfit")
                        job |= {"accuracy": round(acc, 4), "wall_s": round(wall, 1), "test_rows": len(test)}
                        print(json.dumps(job), flush=True)
                        benchlib.append_jsonl(results, [job])


def summarize(args: argparse.Namespace) -> None:
    rows = [json.loads(x) for x in (args.work / "results.jsonl").read_text().splitlines()]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        system = r["system"] + (f" {r['variant']}: {' '.join(r['overrides'])}" if r.get("variant") else "")
        groups.setdefault((r["data"], r["shots"], r["model"], system), []).append(r)
    table, records = [], []
    for (name, shots, model, system), g in sorted(groups.items()):
        accs, walls = [r["accuracy"] for r in g], [r["wall_s"] for r in g]
        mean, std = statistics.mean(accs), statistics.pstdev(accs)
        table.append([name, shots, model, system, len(g), f"{mean:.4f}", f"{std:.4f}", f"{statistics.mean(walls):.0f}"])
        seeds = sorted(r["split"] for r in g)
        what = (
            f"{name}, {shots} rows a class, {model}: {system} (mean over {len(g)} splits, std {std:.4f}, "
            f"wall {statistics.mean(walls):.0f} s)"
        )
        variant = g[0].get("variant")
        run = (
            f".venv/bin/python scripts/bench_fewshot.py --data {name} --shots {shots} --splits {len(g)} "
            f"--models {model} --systems {g[0]['system']} --work {args.work}"
            + (f" --variant {variant} --set {' '.join(g[0]['overrides'])}" if variant else "")
            + "   # then --summarize --record"
        )
        records.append(
            benchlib.record_fields("fewshot", what, "test accuracy", round(mean, 4), None, seeds)
            | {"command": run}
            | {
                "std": round(std, 4),
                "wall_s": round(statistics.mean(walls), 1),
                "data": name,
                "shots": shots,
                "model": model,
                "system": system,
                "splits": len(g),
            }
        )
    print(
        benchlib.markdown_table(
            ["data", "rows a class", "model", "system", "splits", "accuracy mean", "std", "wall s"], table
        )
    )
    if args.record:  # a group recorded before, unchanged, is not recorded again
        path = ROOT / "docs" / "results" / "fewshot.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        old = {(r["what"], r["value"]) for r in map(json.loads, lines)}
        benchlib.append_jsonl(path, [r for r in records if (r["what"], r["value"]) not in old])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", default=["agnews", "sst2", "trec", "sms"])
    p.add_argument("--shots", nargs="+", type=int, default=[8])
    p.add_argument("--splits", type=int, default=5)
    p.add_argument("--models", nargs="+", default=["minilm-l6"])
    p.add_argument("--systems", nargs="+", default=["finetune", "setfit"], choices=["finetune", "setfit"])
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_fewshot"))
    p.add_argument("--variant", default="", help="a name for --set's overrides (results kept apart)")
    p.add_argument("--set", nargs="*", default=[], help="dotted overrides for our train command (a try)")
    p.add_argument("--summarize", action="store_true", help="print the table of the work folder's results")
    p.add_argument("--record", action="store_true", help="with --summarize: append docs/results/fewshot.jsonl")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        summarize(args)
    else:
        run_jobs(args)


if __name__ == "__main__":
    main()
