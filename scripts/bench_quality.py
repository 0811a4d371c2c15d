"""Model quality from the shipped configs, next to the published anchors: GoEmotions, STS-B, SST-2, MRPC, TREC, AG News.

Every run is the real `python finetune/train.py --config configs/<task>.yaml` (overrides only for the
output directory, the seed and, where asked, the candidate under test), so the numbers are what a user
gets from the README. For each run: the headline metric with final/'s bootstrap interval (eval.json),
STS-B's Pearson after the first 60 optimizer steps (an evaluation every 60 steps), and the wall time.
`--rules RUN_DIR` compares multi-label decision rules on a finished run's predictions.jsonl: rules are
chosen on validation and scored on test, never tuned on test.

    .venv/bin/python scripts/bench_quality.py [--tasks stsb goemotions sst2-full mrpc demo] [--seeds 42 43 44]
        [--set key=value ...] [--out FILE]
    .venv/bin/python scripts/bench_quality.py --rules runs/goemotions-minilm
    .venv/bin/python scripts/bench_quality.py --encoders docs/results/quality-encoders.jsonl

Prints markdown tables (median over seeds, then each seed) and writes JSON to --out; `--record FILE` also
appends one JSON line per run to FILE, and `--encoders FILE` prints MiniLM and MPNet side by side from it
(each `<task>` row next to its `<task>-mpnet` row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import yaml
from bench_imbalance import run
from benchlib import ROOT, pair_f1, record_fields
from sklearn.metrics import f1_score

from finetune.core.fileio import read_jsonl  # importable once benchlib has put the repository on sys.path

# Sun et al. 2019, "How to Fine-Tune BERT for Text Classification?": BERT-base with in-task pre-training, test
# error 3.2 on TREC-6 and 4.8 on AG News trained on all 120,000 rows (the configs here train on 8,000)
TREC_ANCHOR = "BERT-base + in-task pre-training 0.968 (Sun et al. 2019)"
AG_ANCHOR = "BERT-base + in-task pre-training 0.952 on all 120k rows (Sun et al. 2019)"
# task -> (config, headline key in eval.json (or test.<key>), goal, published anchor)
TASKS = {
    "goemotions": ("configs/goemotions-minilm.yaml", "test.macro_f1", 0.42, "BERT-base 0.46 (Demszky et al. 2020)"),
    "stsb": ("configs/stsb-minilm.yaml", "spearman", 0.86, "distilbert-base-nli-stsb 0.852 Spearman"),
    "sst2-full": ("configs/sst2-minilm-full.yaml", "accuracy", 0.905, "distilbert-sst2 0.911"),
    "mrpc": ("configs/mrpc-minilm.yaml", "f1", 0.88, "MiniLM-L12 89.5 accuracy"),
    "demo": ("configs/sst2-minilm.yaml", "accuracy", 0.88, "demo with the checkpoint's pooler 0.8784"),
    "trec": ("configs/trec-minilm.yaml", "test.accuracy", None, TREC_ANCHOR),
    "agnews": ("configs/agnews-minilm.yaml", "test.accuracy", None, AG_ANCHOR),
    # all-mpnet-base-v2 (`make mpnet`), with its own goals
    "sst2-mpnet": ("configs/sst2-mpnet.yaml", "accuracy", 0.92, "distilbert-sst2 0.911"),
    "mrpc-mpnet": ("configs/mrpc-mpnet.yaml", "f1", 0.89, "MiniLM-L12 89.5 accuracy"),
    "stsb-mpnet": ("configs/stsb-mpnet.yaml", "spearman", 0.88, "distilbert-base-nli-stsb 0.852 Spearman"),
    "trec-mpnet": ("configs/trec-mpnet.yaml", "test.accuracy", None, TREC_ANCHOR),
    "agnews-mpnet": ("configs/agnews-mpnet.yaml", "test.accuracy", None, AG_ANCHOR),
}
EXTRA = {"stsb": ["train.eval_every_steps=60"]}  # the Pearson after 60 steps
# how docs/RESULTS.md names each task's row
WHAT = {
    "demo": "`configs/sst2-minilm.yaml`: the demo, 16,000 SST-2 rows, MiniLM",
    "mrpc": "`configs/mrpc-minilm.yaml`: MRPC, MiniLM",
    "stsb": "`configs/stsb-minilm.yaml`: STS-B, MiniLM",
    "trec": "`configs/trec-minilm.yaml`: TREC-6, MiniLM",
    "agnews": "`configs/agnews-minilm.yaml`: AG News, 8,000 rows, MiniLM",
    "sst2-mpnet": "`configs/sst2-mpnet.yaml`: the demo's rows, MPNet",
    "mrpc-mpnet": "`configs/mrpc-mpnet.yaml`: MRPC, MPNet",
    "stsb-mpnet": "`configs/stsb-mpnet.yaml`: STS-B, MPNet",
    "trec-mpnet": "`configs/trec-mpnet.yaml`: TREC-6, MPNet",
    "agnews-mpnet": "`configs/agnews-mpnet.yaml`: AG News, 8,000 rows, MPNet",
}


def keep_evals(config: str) -> list[str]:
    """The config's own evaluation interval where final/ is its best checkpoint (`run` turns evaluations off)."""
    raw = yaml.safe_load((ROOT / config).read_text())
    every = (raw.get("train") or {}).get("eval_every_steps")
    best = (raw.get("checkpoint") or {}).get("export") == "best"
    return [f"train.eval_every_steps={every}"] if every and best else []


def headline(final: dict, key: str) -> tuple[float, list[float] | None]:
    node = final
    *parents, last = key.split(".")
    for p in parents:
        node = node[p]
    if last == "f1" and "f1" not in node:  # a pair task's F1: the positive class's
        per = node["per_class"]
        positive = list(per)[-1]
        return per[positive]["f1"], None
    return node[last], node.get(f"{last}_ci")


def first_eval(run_dir: Path, step: int) -> float | None:
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        if row.get("step") == step and "eval_pearson" in row:
            return row["eval_pearson"]
    return None


def bench(
    tasks: list[str], seeds: list[int], settings: list[str], work: Path, out: Path, record: Path | None = None
) -> dict:
    results: dict[str, list[dict]] = {t: [] for t in tasks}
    for seed in seeds:
        for task in tasks:
            config, key, _, _ = TASKS[task]
            run_dir = work / f"{task}-s{seed}"
            overrides = [f"run.seed={seed}", "log.plots=false", *settings]
            final, wall = run(config, overrides + keep_evals(config) + EXTRA.get(task, []), run_dir)
            value, ci = headline(final, key)
            if key == "f1" and ci is None:
                ci = pair_f1(run_dir)[1]
            row = {"seed": seed, key: value, "ci": ci, "wall_s": wall}
            if task == "stsb":
                row["pearson_at_60"] = first_eval(run_dir, 60)
            results[task].append(row)
            print(f"{task} seed {seed}: {key} {value:.4f} {ci} {wall:.0f} s {row.get('pearson_at_60', '')}", flush=True)
            out.write_text(json.dumps({"settings": settings, "results": results}, indent=2))
            if record is not None:
                line = {"task": task, "seed": seed, "metric": key, "value": value, "ci": ci, "wall_s": round(wall, 1)}
                line |= {"settings": settings, "source": "bench_quality.py"}
                what = WHAT.get(task, f"`{config}`") + (f" ({' '.join(settings)})" if settings else "")
                line |= record_fields("accuracy", what, key, value, ci, [seed])
                with record.open("a") as f:
                    f.write(json.dumps(line) + "\n")
    return results


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| task (config) | metric | median | goal | anchor | wall s (median) | per seed: value [95% CI], s |",
        "|---|---|---|---|---|---|---|",
    ]
    for task, rows in results.items():
        if not rows:
            continue
        config, key, goal, anchor = TASKS[task]
        med = statistics.median(r[key] for r in rows)
        per = "; ".join(
            f"{r[key]:.4f}" + (f" [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r["ci"] else "") + f", {r['wall_s']:.0f}"
            for r in rows
        )
        if task == "stsb":
            per += "; Pearson after 60 steps: " + ", ".join(f"{r['pearson_at_60']:.3f}" for r in rows)
        wall = statistics.median(r["wall_s"] for r in rows)
        lines.append(f"| {task} (`{config}`) | {key} | {med:.4f} | {goal or '-'} | {anchor} | {wall:.0f} | {per} |")
    return "\n".join(lines)


def _cell(rows: list[dict]) -> str:
    if not rows:
        return "not run"
    med = statistics.median(r["value"] for r in rows)
    per = "; ".join(
        f"s{r['seed']} {r['value']:.4f}"
        + (f" [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r["ci"] else "")
        + f" {r['wall_s']:.0f} s"
        for r in sorted(rows, key=lambda r: r["seed"])
    )
    return f"**{med:.4f}** (median of {len(rows)}; {per})"


# MiniLM's config -> MPNet's config for the same data and split (the demo slice: sst2-minilm against sst2-mpnet)
PAIRS = {
    "demo": "sst2-mpnet",
    "mrpc": "mrpc-mpnet",
    "stsb": "stsb-mpnet",
    "trec": "trec-mpnet",
    "agnews": "agnews-mpnet",
}


def encoders(record: Path) -> str:
    """MiniLM's and MPNet's runs of each task side by side, from a --record file: the median over seeds,
    each seed's value, interval and wall time, and the difference of the medians."""
    runs = [r for r in read_jsonl(record) if not r.get("settings")]  # candidates under test are not the configs
    lines = [
        "| tasks | metric | MiniLM (all-MiniLM-L6-v2) | MPNet (all-mpnet-base-v2) | MPNet - MiniLM | goal | anchor |",
        "|---|---|---|---|---|---|---|",
    ]
    for small_task, big_task in PAIRS.items():
        small = [r for r in runs if r["task"] == small_task]
        big = [r for r in runs if r["task"] == big_task]
        _, key, goal, anchor = TASKS[big_task]
        diff = "-"
        if small and big:
            diff = f"{statistics.median(r['value'] for r in big) - statistics.median(r['value'] for r in small):+.4f}"
        cells = [f"{small_task} / {big_task}", key, _cell(small), _cell(big), diff, str(goal or "-"), anchor]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Multi-label decision rules, from a run's predictions.jsonl (validation chooses, test scores).

GRID = np.round(np.arange(0.05, 0.951, 0.05), 2)


def _arrays(rows: list[dict], names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    y = np.array([[n in r["gold"] for n in names] for r in rows], dtype=bool)
    p = np.array([[r["probabilities"][n] for n in names] for r in rows])
    return y, p


def _per_label(y: np.ndarray, p: np.ndarray) -> np.ndarray:
    return np.array(
        [
            GRID[int(np.argmax([f1_score(y[:, j], p[:, j] >= t, zero_division=0) for t in GRID]))]
            for j in range(y.shape[1])
        ]
    )


def _with_top(p: np.ndarray, pred: np.ndarray) -> np.ndarray:
    out = pred.copy()
    out[np.arange(len(p)), p.argmax(1)] = True
    return out


def rules(run_dir: Path) -> str:
    rows = [json.loads(x) for x in (run_dir / "predictions.jsonl").read_text().splitlines()]
    names = list(rows[0]["probabilities"])
    yv, pv = _arrays([r for r in rows if r["split"] == "validation"], names)
    yt, pt = _arrays([r for r in rows if r["split"] == "test"], names)
    per = _per_label(yv, pv)
    best_global = GRID[int(np.argmax([f1_score(yv, pv >= t, average="macro", zero_division=0) for t in GRID]))]
    candidates = {
        "0.5 everywhere": lambda p: p >= 0.5,
        "per-label thresholds (tuned on validation)": lambda p: p >= per[None, :],
        f"one global threshold ({best_global:.2f}, tuned on validation)": lambda p: p >= best_global,
        "per-label thresholds + at least the top label": lambda p: _with_top(p, p >= per[None, :]),
        f"global {best_global:.2f} + at least the top label": lambda p: _with_top(p, p >= best_global),
    }
    lines = [
        "| decision rule | validation macro-F1 | validation micro-F1 | test macro-F1 | test micro-F1 | "
        f"test labels per text (gold {yt.sum(1).mean():.2f}) |",
        "|---|---|---|---|---|---|",
    ]
    for name, rule in candidates.items():
        v, t = rule(pv), rule(pt)
        lines.append(
            f"| {name} | {f1_score(yv, v, average='macro', zero_division=0):.4f} | "
            f"{f1_score(yv, v, average='micro', zero_division=0):.4f} | "
            f"{f1_score(yt, t, average='macro', zero_division=0):.4f} | "
            f"{f1_score(yt, t, average='micro', zero_division=0):.4f} | {t.sum(1).mean():.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--set", nargs="*", default=[], help="overrides for every run (a candidate under test)")
    parser.add_argument("--rules", type=Path, default=None, help="a finished multi-label run directory")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_quality"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_quality.json"))
    parser.add_argument("--record", type=Path, default=None, help="append one JSON line per run to this file")
    parser.add_argument("--encoders", type=Path, default=None, help="print MiniLM and MPNet side by side from a record")
    args = parser.parse_args()
    if args.rules is not None:
        print(rules(args.rules))
        return
    if args.encoders is not None:
        print(encoders(args.encoders))
        return
    start = time.perf_counter()
    results = bench(args.tasks, args.seeds, args.set, args.work, args.out, args.record)
    print(
        f"\n{table(results)}\n\ncommand: scripts/bench_quality.py --tasks {' '.join(args.tasks)} --seeds "
        f"{' '.join(map(str, args.seeds))}"
        + (f" --set {' '.join(args.set)}" if args.set else "")
        + f"; total {time.perf_counter() - start:.0f} s; root {ROOT}"
    )


if __name__ == "__main__":
    main()
