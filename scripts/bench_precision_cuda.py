"""The precision matrix on CUDA: fp16 / bf16 / bf16-true (and fp32) x torch.compile off / on.

For each cell: one fresh training process on the same SST-2 slice and step count
(configs/sst2-minilm.yaml, micro-batch 32, max_length 128), then from its metrics.jsonl:
training samples/s and ms per optimizer step (log intervals after the first, so compilation and
warm-up are excluded and reported apart as the first interval's time), peak
`torch.cuda.max_memory_allocated` over the run, the number of compiled graphs (`compile_graphs`,
i.e. recompiles + 1), fp16 scaler skips, and dev accuracy after the steps.

    HF_HUB_OFFLINE=1 python scripts/bench_precision_cuda.py [--model DIR] [--steps 100] [--json out.json]

Written for a GPU machine (one prepared run: about a minute per cell on one H200 plus compile
time). On a CPU it runs the cells the CPU allows (fp16 is refused there, as in training) with
`--device-ok-cpu`, which is how its plumbing was checked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchlib import ROOT, train_run

CONFIG = ROOT / "configs" / "sst2-minilm.yaml"


def one_cell(mode: str, compiled: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Train one (mode, compile) cell in a fresh process; its numbers from metrics.jsonl."""
    run_dir = args.work / f"{mode}-{'compile' if compiled else 'eager'}"
    log_every = max(1, args.steps // 10)
    overrides = [
        f"precision.mode={mode}",
        f"model.compile={str(compiled).lower()}",
        f"data.max_train_samples={args.steps * 32}",
        f"train.max_steps={args.steps}",
        "train.micro_batch_size=32",
        "train.gradient_accumulation_steps=1",
        f"data.max_length={args.max_length}",
        f"train.log_every_steps={log_every}",
        "train.eval_every_steps=null",
        "checkpoint.every_steps=null",
        f"data.max_eval_samples={args.eval_samples}",
        *([f"model.name_or_path={args.model}"] if args.model else []),
        *args.override,
    ]
    child = train_run(CONFIG, overrides, run_dir, check=False)
    cell: dict[str, Any] = {"mode": mode, "compile": compiled, "wall_s": child.wall_s}
    if child.error is not None:
        cell["error"] = child.error
        return cell
    rows = child.metrics()
    train_rows = [r for r in rows if "samples_per_s" in r]
    steady = train_rows[1:] or train_rows
    sps = statistics.median(r["samples_per_s"] for r in steady)
    cell.update(
        samples_per_s=sps,
        ms_per_step=1000.0 * 32 / sps,
        first_interval_s=log_every * 32 / train_rows[0]["samples_per_s"],  # includes compilation
        peak_allocated_mib=max(r.get("peak_memory_bytes", 0) for r in train_rows) / 2**20,
        compile_graphs=train_rows[-1].get("compile_graphs"),
        scaler_skipped_steps=train_rows[-1].get("fp16_skipped_steps"),
        recompile_limit_hits=train_rows[-1].get("compile_recompile_limit_hits", 0),
        accuracy=json.loads((run_dir / "eval.json").read_text()).get("accuracy"),
    )
    return cell


def main() -> int:
    """Run the matrix; print the markdown table for docs/PRECISION.md; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["fp32", "fp16", "bf16", "bf16-true"])
    ap.add_argument("--compile", nargs="+", choices=["off", "on"], default=["off", "on"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=872)
    ap.add_argument(
        "--model",
        default=None,
        help="model.name_or_path (a local copy of MiniLM's weights on a machine without the package)",
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_precision_cuda"))
    ap.add_argument("--json", type=Path, default=ROOT / "runs" / "bench_precision_cuda.json")
    ap.add_argument(
        "--device-ok-cpu", action="store_true", help="run without CUDA (plumbing check; numbers are CPU RSS)"
    )
    ap.add_argument("override", nargs="*", help="extra dotted.key=value overrides for every cell")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.device_ok_cpu:
        print(
            "error: no CUDA device (this is the GPU matrix; --device-ok-cpu runs it on the CPU for a plumbing check)",
            file=sys.stderr,
        )
        return 2
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    cells = []
    for compiled in [c == "on" for c in args.compile]:
        for mode in args.modes:
            cell = one_cell(mode, compiled, args)
            cells.append(cell)
            print(json.dumps(cell), file=sys.stderr, flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"device": device, "torch": torch.__version__, "steps": args.steps, "cells": cells}, indent=2)
    )
    print(f"{device}, torch {torch.__version__}: {args.steps} steps x 32 SST-2 rows, max_length {args.max_length}")
    print(
        "| mode | compile | samples/s | ms/step | first interval s (incl. compile) | peak allocated MiB | graphs "
        "| fp16 skipped steps | dev accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        if "error" in c:
            print(f"| {c['mode']} | {'on' if c['compile'] else 'off'} | refused: {c['error']} | | | | | | |")
            continue
        print(
            f"| {c['mode']} | {'on' if c['compile'] else 'off'} | {c['samples_per_s']:.0f} | {c['ms_per_step']:.1f} "
            f"| {c['first_interval_s']:.1f} | "
            f"{c['peak_allocated_mib']:,.0f} | {c['compile_graphs'] if c['compile_graphs'] is not None else '-'} | "
            f"{c['scaler_skipped_steps'] if c['scaler_skipped_steps'] is not None else '-'} | {c['accuracy']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
