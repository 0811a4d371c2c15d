"""Fine-tuning recipes on the SST-2 demo budget, side by side: 3 seeds each.

The demo config (`configs/sst2-minilm.yaml`: all-MiniLM-L6-v2, the first 16,000 SST-2 training rows,
1 epoch, lr 1e-4) as shipped, and with each recipe of the schema alone: layer-wise learning-rate
decay (`train.layer_lr_decay`), a separate head learning rate (`train.head_learning_rate`) and
re-initialising the top layer (`train.reinit_top_layers`). Every run is the real
`python finetune/train.py` with overrides; the variants of one seed run back to back, so drift in the
machine's load hits them alike. Reports SST-2 dev accuracy at the end of training (with final/'s
bootstrap interval) and the wall time of each run. Each run uses one CPU thread (`run.num_threads=1`):
on a machine shared with other work a 2-thread run slowed ~8x here, a 1-thread one far less.

    .venv/bin/python scripts/bench_recipes.py [--seeds 42 43 44] [--only baseline llrd ...] [--out FILE]

Prints a markdown table (median over seeds, then each seed) and writes JSON to --out.

`finetune init`'s recipe against hand configurations on the shipped data sets, one cell a call
so that each run can hold the shared CPU lock on its own:

    .venv/bin/python scripts/bench_recipes.py --row trec --column new [--seed 42] [--results FILE]
    .venv/bin/python scripts/bench_recipes.py --table [--results FILE]
    .venv/bin/python scripts/bench_recipes.py --row ag2k --trajectory [--seed 44] [--results FILE]

A row's data is written once under --work as train/dev/test .jsonl files init reads (TREC's fine labels, an
AG News class-balanced sample, seeded stratified 80/20 splits of SMS Spam and BBC News, MRPC's train/dev and
its labelled test file, an SST-2 sample with the dev set as validation and the SentEval test set as test);
`finetune init` writes the config (column `today`: init as of commit TODAY_COMMIT, run from a `git archive` of
it; `new`: this tree; `new0`: records of this tree's init without checkpoint.best_within_se, not rerunnable;
`mpnet`: this tree with `--model mpnet-base`), which trains unedited but for the output
directory and seed; `hand` is the `today` column's config with the row's HAND overrides. The score is test
accuracy (a split no column trains or selects on), with its bootstrap interval from eval.json; the wall time is the
`finetune/train.py` child's. `--trajectory` trains the new init's config to its epochs bound keeping every
checkpoint, scores each on test, and prints which one each rule for final/ would take (strict best validation
accuracy, lowest validation loss, last, the latest within one standard error) where the recipe's early stopping
would have ended the run.
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
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench_imbalance import run  # the real train.py with overrides, evaluation only at the end
from benchlib import ROOT, record_fields, train_run

VARIANTS = {
    "shipped (lr 1e-4)": [],
    "layer_lr_decay 0.8, lr 2e-4": ["train.layer_lr_decay=0.8", "train.learning_rate=2e-4"],
    "head_learning_rate 1e-3": ["train.head_learning_rate=1e-3"],
    "reinit_top_layers 1": ["train.reinit_top_layers=1"],
}


DATA = Path(os.environ.get("FINETUNE_DATA_DIR", ROOT.parent / "shared" / "data"))
TODAY_COMMIT = "c4f1520"  # the baseline: finetune init's table recipe there (epochs by rows, lr 1e-4)
ROWS = ("trec50", "ag2k", "ag8k", "sms", "bbc", "mrpc", "sst2-4k")
# how docs/RESULTS.md names each row and column
ROW_NAMES = {
    "trec50": "TREC, 50 fine labels",
    "ag2k": "AG News, 2,000 rows",
    "ag8k": "AG News, 8,000 rows",
    "sms": "SMS Spam",
    "bbc": "BBC News",
    "mrpc": "MRPC (test)",
    "sst2-4k": "SST-2, 4,000 rows",
}
COLUMNS = ("today", "new0", "new", "hand", "mpnet")  # mpnet: this tree's init with --model mpnet-base
# new0: records of the new init without checkpoint.best_within_se (final/ the strictly best validation
# accuracy); kept in the record and the table, not runnable from this tree
RUNNABLE = tuple(c for c in COLUMNS if c != "new0")
# the best hand configuration found per row: overrides of the `today` column's init config
HAND: dict[str, list[str]] = {
    "trec50": ["train.epochs=10"],
    "ag2k": ["train.epochs=5"],
    "ag8k": ["train.epochs=3"],
    "sms": ["train.epochs=3"],
    "bbc": ["data.max_length=256", "train.epochs=3"],
    "mrpc": ["train.epochs=5", "train.learning_rate=5e-5"],
    "sst2-4k": ["train.epochs=3"],
}


def _split(rows: list[dict[str, Any]], test_share: float, seed: int = 0) -> tuple[list, list]:
    """A seeded split stratified by label: (train, test)."""
    by: dict[str, list] = defaultdict(list)
    for r in rows:
        by[r["label"]].append(r)
    train, test = [], []
    rng = random.Random(seed)
    for label in sorted(by):
        group = by[label]
        rng.shuffle(group)
        k = round(len(group) * test_share)
        test += group[:k]
        train += group[k:]
    rng.shuffle(train)
    return train, test


def _tsv(path: Path, names: tuple[str, ...], label: int, texts: list[int], skip: int = 1) -> list[dict[str, Any]]:
    """Rows of a tab-separated file read with no quoting (MRPC, SST-2): text columns `texts` named `names`."""
    lines = path.read_text(encoding="utf-8-sig").splitlines()[skip:]
    return [
        {**{n: f[i].strip() for n, i in zip(names, texts, strict=True)}, "label": f[label].strip()}
        for f in (line.split("\t") for line in lines)
        if len(f) > max(label, *texts)
    ]


def row_data(row: str) -> dict[str, list[dict[str, Any]]]:
    """The splits of a row: train, and dev (validation) and test where the row has them."""
    if row == "trec50":
        read = lambda f: [  # noqa: E731
            {"text": line.split(" ", 1)[1], "label": line.split(" ", 1)[0]}
            for line in (DATA / "trec" / f).read_text(encoding="latin-1").splitlines()
            if line.strip()
        ]
        return {"train": read("train_5500.label"), "test": read("TREC_10.label")}
    if row.startswith("ag"):
        names = (DATA / "ag_news" / "classes.txt").read_text().splitlines()
        read = lambda f: [  # noqa: E731
            {"text": r["content"], "label": names[int(r["label"]) - 1]}
            for r in csv.DictReader((DATA / "ag_news" / f).open(encoding="utf-8"))
        ]
        train = read("train_8k.csv")
        if row == "ag2k":
            train, _ = _split(train, 0.75)  # 500 a class
        return {"train": train, "test": read("test.csv")}
    if row == "sms":
        rows = [
            {"text": t, "label": lab}
            for lab, t in (x.split("\t", 1) for x in (DATA / "sms_spam" / "SMSSpamCollection").read_text().splitlines())
        ]
        train, test = _split(rows, 0.2)
        return {"train": train, "test": test}
    if row == "bbc":
        rows = [
            {"text": f.read_bytes().decode("utf-8", errors="replace"), "label": d.name}
            for d in sorted((DATA / "bbc_news").iterdir())
            if d.is_dir()
            for f in sorted(d.iterdir())
        ]
        train, test = _split(rows, 0.2)
        return {"train": train, "test": test}
    if row == "mrpc":
        pair = lambda f: _tsv(DATA / "mrpc" / f, ("sentence1", "sentence2"), 0, [3, 4])  # noqa: E731
        return {"train": pair("train.tsv"), "dev": pair("dev.tsv"), "test": pair("msr_paraphrase_test.txt")}
    if row == "sst2-4k":
        train = _tsv(DATA / "sst2" / "train.tsv", ("text",), 1, [0])
        random.Random(0).shuffle(train)
        return {
            "train": train[:4000],
            "dev": _tsv(DATA / "sst2" / "dev.tsv", ("text",), 1, [0]),
            "test": _tsv(DATA / "sst2" / "test_senteval.tsv", ("text",), 1, [0], skip=0),
        }
    raise SystemExit(f"unknown row {row}; rows: {ROWS}")


def prepare(row: str, work: Path) -> Path:
    """The row's folder of train/dev/test .jsonl files (written once)."""
    folder = work / "data" / row
    if not (folder / "train.jsonl").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for split, rows in row_data(row).items():
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def init(folder: Path, out: Path, today: bool, work: Path, model: str | None = None) -> str:
    """`finetune init FOLDER -o OUT [--model MODEL]` with this tree's init, or with TODAY_COMMIT's (from a git
    archive); its notes."""
    src = ROOT
    if today:
        src = work / f"init-{TODAY_COMMIT}"
        if not (src / "finetune").exists():
            src.mkdir(parents=True, exist_ok=True)
            archive = subprocess.run(
                ["git", "archive", TODAY_COMMIT, "finetune"], cwd=ROOT, capture_output=True, check=True
            )
            subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    code = (
        f"import sys\nsys.path.insert(0, {str(src)!r})\n"
        "try:\n from finetune.init.write import init_config\n"  # TODAY_COMMIT's tree holds it in another module
        "except ImportError:\n from finetune.init.sniff import init_config\n"
        f"print('\\n'.join(init_config(__import__('pathlib').Path({str(folder)!r}), "
        f"__import__('pathlib').Path({str(out)!r}), force=True{f', model={model!r}' if model else ''})))"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def cell(row: str, column: str, seed: int, work: Path, results: Path) -> dict[str, Any]:
    """One run of one row and column; appended to `results` (JSON lines)."""
    folder = prepare(row, work)
    cfg = work / "configs" / f"{row}-{column}.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    notes = init(folder, cfg, column not in ("new", "mpnet"), work, "mpnet-base" if column == "mpnet" else None)
    extra = HAND[row] if column == "hand" else []
    r = train_run(cfg, [f"run.seed={seed}", *extra], work / "runs" / f"{row}-{column}-{seed}")
    test = r.eval["test"]
    steps = max((m["step"] for m in r.metrics()), default=0)
    out = {
        "row": row,
        "column": column,
        "seed": seed,
        "accuracy": test["accuracy"],
        "accuracy_ci": test.get("accuracy_ci"),
        "macro_f1": test.get("macro_f1"),
        "wall_s": r.wall_s,
        "steps": steps,
        "exported_step": r.eval.get("step"),
        "overrides": extra,
        "notes": notes,
    }
    names = {"today": f"init as of {TODAY_COMMIT}", "new": "finetune init", "mpnet": "finetune init --model mpnet-base"}
    what = f"{ROW_NAMES[row]}: " + names.get(column, f"hand ({' '.join(extra)})")
    out |= record_fields("init", what, "test.accuracy", out["accuracy"], out["accuracy_ci"], [seed])
    with results.open("a") as f:
        f.write(json.dumps(out) + "\n")
    print(f"{row} {column} seed {seed}: test accuracy {out['accuracy']:.4f} {out['accuracy_ci']} {r.wall_s:.0f} s")
    return out


def checkpoint_test_accuracy(run_dir: Path, folder: Path) -> list[dict[str, Any]]:
    """Each checkpoint of `run_dir`: its own validation accuracy, loss and rows, and its weights' test accuracy
    (loaded into final/'s model; final/'s folded temperature is overwritten, argmax would not change anyway)."""
    import yaml
    from safetensors.torch import load_file

    from finetune.deploy.final import load_final
    from finetune.deploy.predict import model_logits
    from finetune.training.checkpoint import list_checkpoints, read_progress

    tokenizer, model = load_final(run_dir / "final")
    names = [model.config.id2label[i] for i in range(model.config.num_labels)]
    test = [json.loads(x) for x in (folder / "test.jsonl").read_text().splitlines()]
    texts, pairs = [r.get("text", r.get("sentence1")) for r in test], [r.get("sentence2") for r in test]
    max_length = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["max_length"]
    points = []
    for path in list_checkpoints(run_dir):
        model.load_state_dict(load_file(str(path / "model.safetensors")))
        logits = model_logits(tokenizer, model, texts, pairs if pairs[0] is not None else None, max_length=max_length)
        predicted = [names[i] for i in logits.argmax(1).tolist()]
        ev = read_progress(path).eval
        points.append(
            {
                "step": read_progress(path).step,
                "val_accuracy": ev.get("accuracy"),
                "val_loss": ev.get("loss"),
                "val_rows": ev.get("num_samples"),
                "test_accuracy": statistics.fmean(p == str(r["label"]) for p, r in zip(predicted, test, strict=True)),
            }
        )
    return points


def picks(points: list[dict[str, Any]], patience: int) -> dict[str, dict[str, Any]]:
    """The checkpoint each export rule takes, early stopping as the recipe writes it (stop after `patience`
    evaluations without a strictly higher validation accuracy): the strict best accuracy (earliest on ties), the
    lowest validation loss, the last, and the latest within one binomial standard error of the best accuracy."""
    best, bad, seen = -1.0, 0, []
    for p in points:
        seen.append(p)
        best, bad = (p["val_accuracy"], 0) if p["val_accuracy"] > best else (best, bad + 1)
        if bad >= patience:
            break
    top = max(p["val_accuracy"] for p in seen)
    error = (top * (1 - top) / seen[0]["val_rows"]) ** 0.5
    return {
        "strict best accuracy": next(p for p in seen if p["val_accuracy"] == top),
        "lowest loss": min(seen, key=lambda p: p["val_loss"]),
        "last": seen[-1],
        "within 1 SE of the best": [p for p in seen if p["val_accuracy"] >= top - error][-1],
    }


def trajectory(row: str, seed: int, work: Path, results: Path) -> dict[str, Any]:
    """The new init's config of `row` trained to its epochs bound with every checkpoint kept and no early
    stopping or budget, each checkpoint's test accuracy, and what each export rule (`picks`) would take in the
    run the recipe stops early; appended to `results`."""
    folder = prepare(row, work)
    cfg = work / "configs" / f"{row}-new.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    init(folder, cfg, False, work)
    patience = yaml_patience(cfg)
    keep = ["checkpoint.keep_last=1000", "train.early_stopping_patience=1000", "train.max_minutes=null"]
    r = train_run(cfg, [f"run.seed={seed}", *keep], work / "runs" / f"{row}-trajectory-{seed}")
    points = checkpoint_test_accuracy(r.run_dir, folder)
    chosen = {rule: p["step"] for rule, p in picks(points, patience).items()}
    out = {"row": row, "seed": seed, "patience": patience, "points": points, "picks": chosen, "wall_s": r.wall_s}
    what = (
        f"{ROW_NAMES[row]}: finetune init's config to its epochs bound, every checkpoint scored on test "
        "(the one the one-standard-error rule takes)"
    )
    taken = next(p["test_accuracy"] for p in points if p["step"] == chosen["within 1 SE of the best"])
    out |= record_fields("init", what, "test.accuracy", taken, None, [seed])
    with results.open("a") as f:
        f.write(json.dumps(out) + "\n")
    test = {p["step"]: p["test_accuracy"] for p in points}
    print(f"{row} seed {seed}: " + "; ".join(f"{k} step {s} test {test[s]:.4f}" for k, s in chosen.items()))
    return out


def yaml_patience(cfg: Path) -> int:
    """The early-stopping patience an init config writes."""
    import yaml

    return int(yaml.safe_load(cfg.read_text())["train"]["early_stopping_patience"])


def table(results: Path) -> str:
    """The markdown table: per row and column, median test accuracy [interval of the median run], wall s; the
    `mpnet` column (init --model mpnet-base) only when one of its cells ran."""
    cells: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for line in results.read_text().splitlines():
        c = json.loads(line)
        cells[(c["row"], c["column"])].append(c)
    columns = [c for c in COLUMNS if c != "mpnet" or any(k[1] == c for k in cells)]
    heads = {"today": f"init at {TODAY_COMMIT}", "new0": "new init, strict best", "new": "new init"}
    heads |= {"hand": "best hand", "mpnet": "init --model mpnet-base"}
    lines = [
        "| data | " + " | ".join(f"{heads[c]}: acc [95% CI], s" for c in columns) + " | seeds |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    for row in ROWS:
        parts, seeds = [], set()
        for column in columns:
            runs = sorted(cells.get((row, column), []), key=lambda c: c["accuracy"])
            if not runs:
                parts.append("not run")
                continue
            mid = runs[len(runs) // 2]
            ci = mid["accuracy_ci"] or [float("nan")] * 2
            wall = statistics.median(c["wall_s"] for c in runs)
            parts.append(f"{mid['accuracy']:.4f} [{ci[0]:.3f}, {ci[1]:.3f}], {wall:.0f}")
            seeds |= {c["seed"] for c in runs}
        lines.append(f"| {row} | " + " | ".join(parts) + f" | {', '.join(map(str, sorted(seeds)))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", choices=ROWS, help="one row of the init-recipe table")
    parser.add_argument("--column", choices=RUNNABLE, default="new")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--results", default="/tmp/bench_recipes_rows.jsonl")
    parser.add_argument("--table", action="store_true", help="print the init-recipe table from --results")
    parser.add_argument(
        "--trajectory", action="store_true", help="with --row: every checkpoint's test accuracy, each export rule"
    )
    parser.add_argument("--config", default="configs/sst2-minilm.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--only", nargs="+", default=None, help="variant name prefixes to run")
    parser.add_argument("--work", default="/tmp/bench_recipes")
    parser.add_argument("--out", default="/tmp/bench_recipes.json")
    args = parser.parse_args()
    if args.table:
        print(table(Path(args.results)))
        return
    if args.row and args.trajectory:
        trajectory(args.row, args.seed, Path(args.work), Path(args.results))
        return
    if args.row:
        cell(args.row, args.column, args.seed, Path(args.work), Path(args.results))
        return
    variants = {k: v for k, v in VARIANTS.items() if not args.only or any(k.startswith(o) for o in args.only)}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for seed in args.seeds:
        for i, (name, overrides) in enumerate(variants.items()):
            settings = [f"run.seed={seed}", "run.num_threads=1", *overrides]
            final, wall = run(args.config, settings, Path(args.work) / f"s{seed}-v{i}")
            row = {
                "seed": seed,
                "accuracy": final["accuracy"],
                "accuracy_ci": final.get("accuracy_ci"),
                "macro_f1": final["macro_f1"],
                "wall_s": wall,
            }
            results[name].append(row)
            print(f"seed {seed} {name}: accuracy {row['accuracy']:.4f} {row['accuracy_ci']} {wall:.0f} s", flush=True)
            Path(args.out).write_text(json.dumps({"config": args.config, "results": results}, indent=2))
    print("\n| recipe | dev accuracy (median) | wall s (median) | per seed: accuracy [95% CI], s |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        per = "; ".join(
            f"{r['accuracy']:.4f} [{r['accuracy_ci'][0]:.3f}, {r['accuracy_ci'][1]:.3f}], {r['wall_s']:.0f}"
            for r in rows
        )
        acc, wall = statistics.median(r["accuracy"] for r in rows), statistics.median(r["wall_s"] for r in rows)
        print(f"| {name} | {acc:.4f} | {wall:.0f} | {per} |")


if __name__ == "__main__":
    main()
