"""docs/RESULTS.md from the records in docs/results/*.jsonl: one table per area, each row with its command.

    .venv/bin/python scripts/results_page.py            # writes docs/RESULTS.md
    .venv/bin/python scripts/results_page.py --check    # exit 1 when docs/RESULTS.md is not what it would write

A record is one JSON line per measured result with at least the fields of REQUIRED. Records of one area, `what`
and `metric` (typically one per seed) make one row: the middle run's value and interval, every run's value
beside it. Optional fields: `runs` (the values of the repeats behind a single record), `spread` (the smallest
and largest repeat), `anchor` (a published result for scale). A record with `superseded` or `evidence` (a
string saying by what, or which design it supports) stays in its file, where the bench scripts read it, and is
left off the page. tests/test_results_page.py fails when the page is stale or a record incomplete.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "RESULTS.md"

Record = dict[str, Any]
REQUIRED = ("area", "what", "metric", "value", "interval", "seeds", "hardware", "date", "commit", "command")
HIDDEN = ("superseded", "evidence")  # kept in the record, not shown on the page

# area -> (heading, what its table holds); the page lists the areas in this order
AREAS: dict[str, tuple[str, str]] = {
    "accuracy": (
        "Accuracy of the shipped configs",
        "Each config in configs/ as committed, trained by `finetune train --config` (or the bench script that "
        "wraps it) and scored on the split the metric names. MiniLM is all-MiniLM-L6-v2 (the default), MPNet "
        "all-mpnet-base-v2 (`make mpnet`). Anchors are published results of other, mostly larger models, for "
        "scale.",
    ),
    "init": (
        "Accuracy from `finetune init`",
        "`finetune init DATA`, then `finetune train --config` the file it wrote, unedited but for the output "
        "directory and seed (scripts/bench_recipes.py builds each data set once as train/dev/test files), "
        "scored on a test split no run trains or selects on. Beside it: init as of commit c4f1520 (a fixed table "
        "of epochs, before the adaptive recipe) and the best hand configuration tried (overrides named).",
    ),
    "speed": (
        "Speed against transformers.Trainer",
        "The same model, rows, optimizer settings and precision in one process, the contestants alternating; "
        "throughput counts training time only. Trainer 5.23 with its defaults (random batches, "
        "`DataCollatorWithPadding`, fused AdamW) and with `group_by_length`.",
    ),
    "overhead": (
        "The loop's overhead",
        "finetune's loop against a minimal PyTorch loop over the same batches (same model, optimizer, schedule and "
        "precision; forward, loss, backward, clip, step only): overhead = minimal samples/s / finetune's - 1, the "
        "median of the per-repeat ratios. Then the fixed costs a run pays once.",
    ),
    "memory": (
        "Memory and the planner",
        "`finetune plan`'s prediction against what the training loop measures (MemTracker on a CPU, "
        "`torch.cuda.max_memory_allocated` on a GPU), and the peaks of the memory-saving settings. "
        "docs/MEMORY.md has the full tables.",
    ),
    "precision": (
        "Precision",
        "Accuracy and speed per `precision.mode`. docs/PRECISION.md explains the modes and their fixes.",
    ),
    "prediction": (
        "Prediction and int8 ONNX",
        "The demo's model (`make demo` writes it to runs/sst2-minilm/final), each method a child process timed end "
        "to end (start-up, model load, reading, prediction, writing) on 50,000 SST-2 training sentences, 2 threads; "
        "accuracy on the 872 SST-2 dev sentences.",
    ),
    "resume": (
        "Resume and faults",
        "Runs killed and resumed with `checkpoint.resume=auto`, against the same run uninterrupted. docs/RESUME.md "
        "describes what a checkpoint holds.",
    ),
    "audit": (
        "Wrong labels: `finetune audit`",
        "scripts/bench_audit.py: a share of the training labels flipped uniformly at random to another class "
        "(seeded), then `finetune audit` on the shipped MiniLM config pointed at the noisy copy (for 2,000 SST-2 "
        "rows: the config `finetune init` wrote; 5 folds, cleanlab's low_self_confidence) against the same "
        "cleanlab rule on 5-fold TF-IDF + logistic regression probabilities: precision and recall of the flagged "
        "rows against the flipped ones; then the config trained on the noisy copy, on it without the flagged rows "
        "(`data.exclude_rows`) and on the clean file. value: the median over seeds (runs: every seed's).",
    ),
    "fewshot": (
        "A handful of rows a class: `finetune init` against SetFit",
        "scripts/bench_fewshot.py: the same random draws of k training rows a class (seeded by the split number) "
        "for both systems, the full test set for both (SMS Spam: a seeded fifth of its distinct messages). Ours: "
        "`finetune init --model M` on the draw, then `finetune train` with the written config unedited (a try's "
        "overrides are named in `what`); SetFit 1.2.0 with the same local encoder folder, batch 16, 20 pair "
        "iterations, its defaults otherwise. value: the mean test accuracy over the draws, its standard deviation "
        "and the mean wall time (ours: init + train; SetFit: load + train; test prediction not timed) in `what`.",
    ),
    "distill": (
        "Distillation: `finetune distill`",
        "scripts/bench_distill.py: an MPNet teacher trained once with its shipped config, then per seed MiniLM's "
        "shipped config on the labels alone against the same config distilled from the teacher (`finetune distill`, "
        "rows without a try's name: distill.loss=kl, temperature 2, alpha 0.5; the try `mse` is today's default; "
        "SST-2 also learns from the other 51,349 training sentences "
        "without their labels); `finetune predict` texts/s of the teacher, the student and the student as int8 ONNX, "
        "each a child process timed end to end. A try (its name and overrides in the row) reruns the student runs "
        "with those overrides, from the same teacher and its cached logits. value: the median over seeds (runs: "
        "every seed's).",
    ),
    "calibration": (
        "Calibration",
        "How many validation rows a temperature needs (`train.calibrate`): temperature scaling fitted on n "
        "synthetic rows of a known true temperature, scored on 10,000 new rows; below the threshold a fitted "
        "temperature raised their NLL in more draws than it lowered it for at least one true temperature and number "
        "of classes (finetune/evaluation/calibrate.py's MIN_ROWS). scripts/bench_calibration.py prints the tables.",
    ),
}

INTRO = """# Results

What this tool reaches, measured, and the one command that reproduces each number. This page is written by
`scripts/results_page.py` from the records in `docs/results/*.jsonl` (one JSON line per measured result); edit
the records, not the page, and run the script (`--check` says whether the page is current).

**Hardware.** "2-core CPU" is 2 cores of an AMD EPYC with AVX-512 (bf16 units), torch 2.13.0+cpu and transformers
5.23.0, shared with other jobs during many runs: its wall times are upper bounds, not speed claims, and speed rows
compare contestants of the same run. "NVIDIA H200" rows ran on one lent H200 (torch 2.11.0+cu130) with random
weights of the named model's shapes and synthetic rows. Commands run from the repository root (offline:
`HF_HUB_OFFLINE=1`; data under `../shared/data` or `$FINETUNE_DATA_DIR`).

**Reading a row.** *value*: the result; for a row of several runs (one per seed), the middle run's value (of
two, the higher). *interval*: that run's 95% percentile bootstrap interval over the evaluation rows (1,000
resamples, eval.json's `<metric>_ci`): the noise of a finite dev or test set, not of the seed; two runs whose
intervals overlap are not shown apart by one seed. *runs*: every run's value in seed order (or every repeat's),
"a to b" the smallest and largest of the repeats. *metric*: accuracy-type metrics are eval.json's keys
(validation unless `test.`). *date*, *commit*: when the result was measured and the commit that recorded it.
*command*: numbered under each table; a row of several seeds shows the middle run's command, the others differ
only in the seed.
"""


def load_records(folder: Path = RECORDS) -> list[tuple[str, Record]]:
    """Every record of `folder`/*.jsonl with where it is (file:line), files in name order.

    Raises:
        ValueError: a line that is not a JSON object (records are committed files: a torn line is an error).
    """
    found = []
    for path in sorted(folder.glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path.name}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not JSON ({err})") from err
            if not isinstance(record, dict):
                raise ValueError(f"{where}: not a JSON object")
            found.append((where, record))
    return found


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _pair(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(map(_is_number, value))


# what each field must hold where a record has it (the REQUIRED ones and the optional ones)
CHECKS: dict[str, Any] = {
    "area": lambda v: v in AREAS,
    "what": _text,
    "metric": _text,
    "value": _is_number,
    "interval": lambda v: v is None or _pair(v),
    "seeds": lambda v: isinstance(v, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in v),
    "hardware": _text,
    "date": lambda v: isinstance(v, str) and re.fullmatch(r"\d{4}-\d\d-\d\d", v) is not None,
    "commit": lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{7,40}", v) is not None,
    "command": lambda v: _text(v) and "\n" not in v,
    "runs": lambda v: isinstance(v, list) and len(v) > 0 and all(map(_is_number, v)),
    "spread": _pair,
    "anchor": lambda v: isinstance(v, str),
    "superseded": _text,
    "evidence": _text,
}


def record_problems(where: str, record: Record) -> list[str]:
    """What is missing or malformed in one record, each line naming `where`."""
    out = [f"{where}: no `{key}`" for key in REQUIRED if key not in record]
    bad = [key for key, ok in CHECKS.items() if key in record and not ok(record[key])]
    return out + [f"{where}: bad `{key}`: {record[key]!r}" for key in bad]


def problems(records: list[tuple[str, Record]]) -> list[str]:
    """Every record's problems (an empty list when all are complete)."""
    return [line for where, record in records for line in record_problems(where, record)]


def number(value: float) -> str:
    """A value as the page shows it: at most 4 decimals under 1, 3 under 10, 2 under 100, 1 above; no trailing `.0`
    (a record holds a value as measured or as written; the page shows no more digits than that)."""
    if isinstance(value, int):
        return f"{value:,}"
    digits = 4 if abs(value) < 1 else 3 if abs(value) < 10 else 2 if abs(value) < 100 else 1
    text = f"{round(value, digits):,}"
    return text[:-2] if text.endswith(".0") else text


def bound(value: float) -> str:
    """An interval's end: 3 decimals under 1 (percentile bootstrap ends carry no more), else as `number`."""
    return f"{value:.3f}" if abs(value) < 1 else number(value)


def _seed_order(record: Record) -> tuple[int, str]:
    return (min(record["seeds"], default=0), record["date"])


def row(group: list[Record]) -> dict[str, str]:
    """One table row from the records of one `what` and `metric`: the middle run and every run beside it."""
    ordered = sorted(group, key=lambda r: (r["value"], _seed_order(r)))
    middle = ordered[len(ordered) // 2]
    if len(group) > 1:
        runs = " / ".join(number(r["value"]) for r in sorted(group, key=_seed_order))
    elif "runs" in middle:
        runs = " / ".join(number(v) for v in middle["runs"])
    elif "spread" in middle:
        runs = f"{number(middle['spread'][0])} to {number(middle['spread'][1])}"
    else:
        runs = "-"
    dates = sorted({r["date"] for r in group})
    commits = list(dict.fromkeys(r["commit"] for r in sorted(group, key=lambda r: r["date"])))
    interval = middle["interval"]
    return {
        "what": middle["what"],
        "metric": middle["metric"],
        "value": f"**{number(middle['value'])}**",
        "interval": f"[{bound(interval[0])}, {bound(interval[1])}]" if interval else "-",
        "runs": runs,
        "seeds": ", ".join(map(str, sorted({s for r in group for s in r["seeds"]}))) or "-",
        "hardware": ", ".join(sorted({r["hardware"] for r in group})),
        "date": dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}",
        "commit": ", ".join(commits),
        "anchor": "; ".join(dict.fromkeys(r["anchor"] for r in group if r.get("anchor"))) or "-",
        "command": middle["command"],
    }


def table(records: list[Record]) -> list[str]:
    """One area's table (rows in the order of `what`, case and backticks aside, then metric) and its numbered
    commands."""
    groups: dict[tuple[str, str], list[Record]] = {}
    for record in records:
        groups.setdefault((record["what"], record["metric"]), []).append(record)
    rows = [row(groups[key]) for key in sorted(groups, key=lambda k: (k[0].replace("`", "").lower(), k[1]))]
    columns = ["what", "metric", "value", "interval", "runs", "seeds", "hardware", "date", "commit"]
    if any(r["anchor"] != "-" for r in rows):
        columns.append("anchor")
    commands = list(dict.fromkeys(r["command"] for r in rows))
    lines = ["| " + " | ".join([*columns, "command"]) + " |", "|" + "---|" * (len(columns) + 1)]
    for r in rows:
        cells = [r[c] for c in columns] + [f"({commands.index(r['command']) + 1})"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines += ["", "Commands:", ""]
    lines += [f"{n}. `{command}`" for n, command in enumerate(commands, 1)]
    return lines


def render(records: list[tuple[str, Record]]) -> str:
    """The page: the intro, then one section per area that has records to show.

    Raises:
        ValueError: a record is incomplete (`problems` lists what).
    """
    found = problems(records)
    if found:
        raise ValueError("incomplete records:\n" + "\n".join(found))
    shown = [r for _, r in records if not any(key in r for key in HIDDEN)]
    lines = [INTRO.rstrip("\n")]
    for area, (heading, about) in AREAS.items():
        mine = [r for r in shown if r["area"] == area]
        if mine:
            lines += ["", f"## {heading}", "", about, "", *table(mine)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the page, or with --check compare it; the exit status (1: stale page or incomplete records)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from what would be written")
    parser.add_argument("--records", type=Path, default=RECORDS, help="folder of *.jsonl records")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write or check")
    args = parser.parse_args(argv)
    try:
        text = render(load_records(args.records))
    except ValueError as err:
        print(err, file=sys.stderr)
        return 1
    if args.check:
        current = args.page.read_text() if args.page.exists() else ""
        if current != text:
            print(f"{args.page} is stale: run .venv/bin/python scripts/results_page.py", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
