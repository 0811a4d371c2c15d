"""How well `finetune audit` finds flipped labels, and what training without the rows it flags gives back.

Per data set, noise rate and seed: a copy of the training file with that share of labels flipped uniformly at
random to another class (seeded), then side by side
- `finetune audit` on the shipped config pointed at the noisy copy (MiniLM; `audit.*` defaults: 5 folds, one
  epoch a fold on these sizes, cleanlab's low_self_confidence): precision and recall of the flagged rows against
  the flipped ones;
- the cheap baseline: cleanlab on out-of-sample probabilities of TF-IDF (1-2 grams) + logistic regression, 5
  stratified folds, the audit's filter (`audit.filter_by`'s default);
- the test accuracy of the shipped config trained on the noisy copy, on the noisy copy minus the flagged rows
  (`data.exclude_rows`), and on the clean file (once a seed).

Data: AG News (the 8,000-row balanced sample, scored on the 7,600-row test set) and the demo's SST-2 slice (the
first 16,000 training rows, scored on the 872 dev sentences). Everything lands in --work (default
/tmp/bench_audit); a rerun reuses finished audits and runs, so an interrupted bench continues.

    .venv/bin/python scripts/bench_audit.py [--datasets agnews sst2] [--noise 0 0.1 0.2] [--seeds 0 1 2]
        [--tfidf-only] [--variant KEY=VALUE ...] [--work DIR] [--summarize] [--record docs/results/audit.jsonl]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import ROOT, append_jsonl, markdown_table, record_fields, train_run

from finetune.config.schema import AuditConfig  # importable once benchlib has put the repository on sys.path

DATA = Path(os.environ.get("FINETUNE_DATA_DIR") or ROOT.parent / "shared" / "data")
SETS: dict[str, dict[str, Any]] = {
    "agnews": {
        "name": "AG News 8,000",
        "config": ROOT / "configs" / "agnews-minilm.yaml",
        "file": DATA / "ag_news" / "train_8k.csv",
        "delimiter": ",",
        "text": "content",
        "label": "label",
        "rows": None,
        "metric": ("test", "accuracy"),
    },
    "sst2": {
        "name": "SST-2 demo slice (16,000)",
        "config": ROOT / "configs" / "sst2-minilm.yaml",
        "file": DATA / "sst2" / "train.tsv",
        "delimiter": "\t",
        "text": "sentence",
        "label": "label",
        "rows": 16_000,
        "metric": (None, "accuracy"),
    },
    # a new user's path: `finetune init` on a folder of train.csv (2,000 SST-2 training sentences after the demo's
    # slice, labels flipped) and test.csv (the 872 dev sentences), then audit and train with the config it wrote
    "sst2-init": {
        "name": "SST-2 2,000 through `finetune init`",
        "config": None,
        "file": DATA / "sst2" / "train.tsv",
        "delimiter": "\t",
        "text": "sentence",
        "label": "label",
        "rows": (20_000, 22_000),
        "test": DATA / "sst2" / "dev.tsv",
        "metric": ("test", "accuracy"),
    },
}
FILTER = AuditConfig().filter_by  # the baseline ranks with the audit's own rule
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "FINETUNE_DATA_DIR": str(DATA)}


def read_rows(spec: dict[str, Any]) -> tuple[list[str], list[dict[str, str]]]:
    """The header and rows of the training file (the first `rows` of them), as the shipped config reads it."""
    quoting = csv.QUOTE_NONE if spec["delimiter"] == "\t" else csv.QUOTE_MINIMAL
    with open(spec["file"], newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=spec["delimiter"], quoting=quoting)
        rows = list(reader)
        header = list(reader.fieldnames or [])
    if isinstance(spec["rows"], tuple):
        return header, rows[spec["rows"][0] : spec["rows"][1]]
    return header, rows[: spec["rows"]] if spec["rows"] else rows


def noisy_copy(spec: dict[str, Any], rate: float, seed: int, out: Path, clean: bool = False) -> set[int]:
    """Write the training file with round(rate x rows) labels flipped to another class drawn uniformly (none with
    `clean`); the flipped rows (0-based data rows)."""
    header, rows = read_rows(spec)
    if clean:
        rate = 0.0
    classes = sorted({r[spec["label"]] for r in rows})
    rng = np.random.default_rng(seed)
    flipped = set(rng.choice(len(rows), size=round(rate * len(rows)), replace=False).tolist())
    for i in sorted(flipped):
        others = [c for c in classes if c != rows[i][spec["label"]]]
        rows[i] = {**rows[i], spec["label"]: others[int(rng.integers(len(others)))]}
    tsv = out.suffix == ".tsv"
    quoting = csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, header, delimiter="\t" if tsv else ",", quoting=quoting, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return flipped


def scores(flagged: set[int], flipped: set[int]) -> dict[str, float]:
    hit = len(flagged & flipped)
    p = hit / len(flagged) if flagged else 0.0
    r = hit / len(flipped) if flipped else 0.0
    return {"flagged": len(flagged), "precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0}


def tfidf_flagged(path: Path, spec: dict[str, Any], seed: int) -> set[int]:
    """cleanlab's label issues on 5-fold out-of-sample TF-IDF + logistic regression probabilities."""
    from cleanlab.filter import find_label_issues
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline

    _, rows = read_rows({**spec, "file": path, "rows": None, "delimiter": "\t" if path.suffix == ".tsv" else ","})
    texts = [r[spec["text"]] for r in rows]
    classes = sorted({r[spec["label"]] for r in rows})
    y = np.asarray([classes.index(r[spec["label"]]) for r in rows])
    model = make_pipeline(
        TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True), LogisticRegression(max_iter=2000, C=10.0)
    )
    probs = cross_val_predict(
        model, texts, y, cv=StratifiedKFold(5, shuffle=True, random_state=seed), method="predict_proba"
    )
    return set(np.flatnonzero(find_label_issues(y, probs, filter_by=FILTER)).tolist())


def cli(args: list[str]) -> None:
    """`finetune ARGS` offline from the project root; its last line of stderr printed."""
    cmd = [sys.executable, "-m", "finetune.cli", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-3000:]}")
    print(proc.stderr.strip().splitlines()[-1], file=sys.stderr, flush=True)


def init_config(spec: dict[str, Any], path: Path, folder: Path) -> Path:
    """`finetune init` on a folder of train.csv (the noisy copy) and test.csv: the config it writes."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, folder / "train.csv")
    _, rows = read_rows({**spec, "file": spec["test"], "rows": None})
    with open(folder / "test.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, [spec["text"], spec["label"]], lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    out = folder.parent / "init.yaml"
    if not out.is_file():
        cli(["init", str(folder), "-o", str(out)])
    return out


def audit(config: Path, path: Path, out: Path) -> tuple[set[int], float]:
    """`finetune audit` on `config` with `path` as its training file: the flagged rows and the audit's seconds (a
    finished audit run again only ranks its folds' saved predictions again)."""
    cli(["audit", "--config", str(config), f"data.train_file={path}", f"run.output_dir={out}"])
    seconds = sum(json.loads((out / "audit.json").read_text())["fold_seconds"].values())
    with open(out / "label_issues.csv", newline="", encoding="utf-8") as f:
        return {int(r["row"]) for r in csv.DictReader(f)}, seconds


def accuracy(
    spec: dict[str, Any], config: Path, path: Path, run_dir: Path, extra: list[str]
) -> tuple[float, list[float]]:
    """Test accuracy (and interval) of `config` trained on `path`; a finished run is read again."""
    done = run_dir / "eval.json"
    if not done.is_file():
        train_run(config, [f"data.train_file={path}", *extra], run_dir)
    ev = json.loads(done.read_text())
    split, key = spec["metric"]
    ev = ev[split] if split else ev
    return ev[key], ev[f"{key}_ci"]


def one(name: str, rate: float, seed: int, work: Path, tfidf_only: bool, variant: list[str]) -> dict[str, Any]:
    """One data set, noise rate and seed. With `variant` (training overrides), only the trainings on the noisy
    and the clean labels, with those overrides, in run directories of their own (the training-under-noise rows)."""
    spec = SETS[name]
    cell = work / name / f"noise{int(round(100 * rate)):02d}-seed{seed}"
    init = spec["config"] is None
    path = cell / ("train.tsv" if spec["delimiter"] == "\t" and not init else "train.csv")
    flipped = noisy_copy(spec, rate, seed, path)
    start = time.perf_counter()
    result: dict[str, Any] = {"dataset": name, "noise": rate, "seed": seed, "flipped": len(flipped)}
    config = init_config(spec, path, cell / "data") if init else spec["config"]
    tag = "-".join(v.replace("=", "") for v in variant)
    clean = work / name / (f"clean-seed{seed}" + (f"-{tag}" if tag else ""))
    clean_path = work / name / f"clean-seed{seed}{path.suffix}"
    noisy_copy(spec, 0.0, seed, clean_path, clean=True)  # the same rows, their own labels
    run_args = [f"run.seed={42 + seed}", *variant]
    if variant:
        result["variant"] = variant
        result["clean"] = accuracy(spec, config, clean_path, clean, run_args)
        result["noisy"] = accuracy(spec, config, path, cell / f"train-noisy-{tag}", run_args)
        return result
    result["tfidf"] = scores(tfidf_flagged(path, spec, seed), flipped)
    result["tfidf_seconds"] = time.perf_counter() - start
    if tfidf_only:
        return result
    flagged, seconds = audit(config, path, cell / "audit")
    result["audit"] = scores(flagged, flipped)
    result["audit_seconds"] = seconds
    result["clean"] = accuracy(spec, config, clean_path, clean, run_args)
    # no flipped label: the noisy copy is the clean file, and so is its run
    result["noisy"] = accuracy(spec, config, path, cell / "train-noisy", run_args) if flipped else result["clean"]
    exclude = [f"data.exclude_rows={cell / 'audit' / 'label_issues.csv'}"]
    result["cleaned"] = accuracy(spec, config, path, cell / "train-cleaned", run_args + exclude)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--noise", nargs="+", type=float, default=[0.0, 0.1, 0.2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_audit"))
    parser.add_argument("--tfidf-only", action="store_true", help="the baseline alone (seconds, not hours)")
    parser.add_argument("--record", type=Path, default=None, help="append the results to this records file")
    parser.add_argument(
        "--variant",
        nargs="+",
        default=[],
        help="training overrides (e.g. train.label_smoothing=0.1): only the noisy and clean trainings, with them",
    )
    parser.add_argument(
        "--summarize", action="store_true", help="run nothing: the table (and --record) from --work's results.jsonl"
    )
    args = parser.parse_args()
    saved = args.work / "results.jsonl"
    if args.summarize:  # a cell measured again replaces its earlier result
        lines = [json.loads(line) for line in saved.read_text().splitlines() if line.strip()]
        results = list({(*_key(r), r["seed"]): r for r in lines}.values())
    else:
        results = []
        for name in args.datasets:
            for rate in args.noise:
                for seed in args.seeds:
                    r = one(name, rate, seed, args.work, args.tfidf_only, args.variant)
                    results.append(r)
                    print(json.dumps(r), flush=True)
                    append_jsonl(saved, [r])  # each result as it comes: a long bench survives an interruption
    print(table(results))
    if args.record:
        append_jsonl(args.record, records(results))


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def _key(r: dict[str, Any]) -> tuple[str, float, str]:
    return r["dataset"], r["noise"], " ".join(r.get("variant", []))


def groups(results: list[dict[str, Any]]) -> list[tuple[str, float, str, list[dict[str, Any]]]]:
    """The results by data set, noise rate and training variant ('' for the shipped recipe), in first-seen order."""
    return [(*k, [r for r in results if _key(r) == k]) for k in dict.fromkeys(map(_key, results))]


def table(results: list[dict[str, Any]]) -> str:
    """One row per data set, noise rate and training variant, means over seeds."""
    rows = []
    for name, rate, variant, group in groups(results):
        row: list[Any] = [SETS[name]["name"], f"{100 * rate:.0f}%", variant or "as shipped", len(group)]
        for who in ("audit", "tfidf"):
            got = [g[who] for g in group if who in g]
            row += [_mean([g["precision"] for g in got]), _mean([g["recall"] for g in got])]
            row += [_mean([g["f1"] for g in got]), _mean([g["flagged"] for g in got])]
        for kind in ("noisy", "cleaned", "clean"):
            row.append(_mean([g[kind][0] for g in group if kind in g]))
        rows.append(row)
    header = ["data", "noise", "training", "seeds", "audit P", "audit R", "audit F1", "audit flagged", "tfidf P",
              "tfidf R", "tfidf F1", "tfidf flagged", "acc noisy", "acc cleaned", "acc clean"]  # fmt: skip
    return markdown_table(header, rows)


def records(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records for docs/results: per data set, noise rate, variant and measure, the median over the seeds that
    measured it, with every such seed's value (the cheap baseline may have run on more seeds than the audit).
    Without flipped labels only the flagged share means something."""
    out = []
    for name, rate, variant, group in groups(results):
        where = f"{SETS[name]['name']}, {100 * rate:.0f}% of labels flipped"
        rows = len(read_rows(SETS[name])[1])
        found: list[tuple[str, str, list[int], list[float], Any]] = []  # what, metric, seeds, values, interval
        for who, label in (("audit", "`finetune audit` (MiniLM)"), ("tfidf", "TF-IDF + LR baseline")):
            got = [g for g in group if who in g]
            seeds = [g["seed"] for g in got]
            for m in ("precision", "recall", "f1") if got and rate > 0 else ():
                found.append((f"{where}: {label}", f"flagged {m}", seeds, [g[who][m] for g in got], None))
            if got:
                share = [g[who]["flagged"] / rows for g in got]
                found.append((f"{where}: {label}", "flagged share", seeds, share, None))
        recipe = f" with `{variant}`" if variant else ""
        for kind, label in (("noisy", "trained on the noisy labels"), ("cleaned", "trained without the flagged rows"),
                            ("clean", "trained on the clean labels")):  # fmt: skip
            got = [g for g in group if kind in g]
            if got:
                split, key = SETS[name]["metric"]
                metric = f"{split}.{key}" if split else key
                ci = got[len(got) // 2][kind][1]
                found.append(
                    (f"{where}: {label}{recipe}", metric, [g["seed"] for g in got], [g[kind][0] for g in got], ci)
                )
        for what, metric, seeds, values, ci in found:
            rec = record_fields("audit", what, metric, float(np.median(values)), ci, seeds) | {"runs": values}
            # the command that measures the row (a --summarize run only reads results back)
            command = [".venv/bin/python", "scripts/bench_audit.py", "--datasets", name, "--noise", f"{rate:g}"]
            command += ["--seeds", *map(str, seeds), *(["--variant", *variant.split()] if variant else [])]
            out.append(rec | {"command": shlex.join(command)})
    return out


if __name__ == "__main__":
    main()
