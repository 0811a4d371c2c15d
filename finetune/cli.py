"""`finetune train | distill | plan | evaluate | predict | report | config | init | export | sweep | audit`: thin
argument parsing around the modules."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from finetune.core.errors import UserError


def _cmd_train(argv: list[str]) -> int:
    from finetune.train import main as train_main

    return train_main(argv, prog="finetune train")


def _cmd_distill(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune distill",
        description="Train the config's model (the student) on its labels and on a trained teacher's outputs: "
        "`finetune train` with distill.teacher=TEACHER (distill.temperature, distill.alpha, distill.unlabeled_file).",
    )
    parser.add_argument("--teacher", required=True, help="the teacher: a run's final/ folder, of the same labels")
    parser.add_argument("--config", required=True, help="YAML config file of the student's run")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. distill.temperature=4")
    args = parser.parse_args(argv)
    from finetune.train import main as train_main

    prog = f"finetune distill --teacher {shlex.quote(args.teacher)}"  # what a resume hint repeats
    return train_main(["--config", args.config, *args.overrides], prog=prog, fixed=(f"distill.teacher={args.teacher}",))


def _cmd_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune plan",
        description="Predict the peak memory of a training step for a ladder of micro-batch sizes (fake tensors: "
        "nothing is allocated).",
    )
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. precision.mode=bf16")
    parser.add_argument(
        "--budget-gb", type=float, default=None, help="memory budget in GiB (2^30 bytes); default memory.budget_gb"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="device to plan for (default: this machine's accelerator)",
    )
    parser.add_argument(
        "--num-processes", type=int, default=1, help="processes sharing the effective batch (default 1)"
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="plan one FSDP rank: parameters, gradients and optimizer state sharded over --num-processes",
    )
    parser.add_argument(
        "--micro",
        type=int,
        nargs="+",
        default=None,
        help="micro-batch sizes to plan (default: the divisors ladder up to the effective batch)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--grid",
        action="store_true",
        help="compare fp32 / bf16 / bf16-true / LoRA / QLoRA at --micro sizes (default 1 4 16) and --lengths",
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=None, help="--grid: tokens per row (default data.max_length and 512)"
    )
    args = parser.parse_args(argv)
    from finetune.config.files import load_config
    from finetune.memory.planner import grid_command, plan_command

    cfg = load_config(args.config, args.overrides)
    if args.grid:
        print(grid_command(cfg, args.device, args.micro, args.lengths, args.json))
        return 0
    print(plan_command(cfg, args.device, args.budget_gb, args.micro, args.num_processes, args.fsdp, args.json))
    return 0


def _cmd_predict(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune predict",
        description="Label texts with an exported model, streamed in chunks; a stopped run continues when the "
        "same command is run again.",
    )
    parser.add_argument(
        "--model", required=True, help="a run's final/ (--backend pytorch) or an ONNX export (--backend onnx)"
    )
    parser.add_argument(
        "--input",
        required=True,
        help=".txt (one text per line), .csv/.tsv with a header, .jsonl, .json or .parquet; a file of a format the "
        "run trained on is read as the run read its data (data.delimiter, quoting, header, encoding)",
    )
    parser.add_argument("--output", required=True, help=".jsonl, .csv or .parquet")
    parser.add_argument("--text-column", default="text")
    parser.add_argument(
        "--pair-column",
        default=None,
        help="second text of each pair (default: a text_pair column/key when the input has one)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--chunk-size", type=int, default=4096, help="texts read, sorted by length and written at a time"
    )
    parser.add_argument("--backend", choices=["pytorch", "onnx"], default="pytorch")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output (and start again)")
    parser.add_argument(
        "--workers", type=int, default=1, help="processes, each with the model and its share of the threads"
    )
    args = parser.parse_args(argv)
    for flag in ("batch_size", "chunk_size", "workers"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    from finetune.deploy.predict import Job, run_predict

    job = Job(
        Path(args.input),
        Path(args.output),
        Path(args.model),
        args.backend,
        args.text_column,
        args.pair_column,
        args.chunk_size,
    )
    run_predict(job, args.batch_size, args.overwrite, args.workers)
    return 0


def _cmd_evaluate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune evaluate", description="Evaluate an exported model on a config's validation/test data."
    )
    parser.add_argument("--model", required=True, help="exported model directory (<run>/final)")
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    from finetune.deploy.predict import evaluate_final

    print(json.dumps(evaluate_final(Path(args.model), args.config, args.overrides), indent=2))
    return 0


def _cmd_report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune report",
        description="Memory reports of a run's checkpoints as one table; with --errors, the model's worst mistakes.",
    )
    parser.add_argument("run_dir", help="a run directory (run.output_dir)")
    parser.add_argument("--plots", action="store_true", help="write curves.png and memory.png of the run again")
    parser.add_argument(
        "--errors",
        type=int,
        metavar="N",
        default=None,
        help="print the N most confident mistakes of final/'s weights (from predictions.jsonl)",
    )
    parser.add_argument("--split", choices=["validation", "test"], default=None, help="with --errors: one split only")
    args = parser.parse_args(argv)
    from finetune.evaluation.metrics import mistakes_report, plot_run
    from finetune.memory.monitor import report_table

    run = Path(args.run_dir)
    if args.errors is not None:
        print(mistakes_report(run, args.errors, args.split))
        return 0
    print(report_table(run))
    if args.plots:
        print(f"wrote {' and '.join(str(f) for f in plot_run(run))}", file=sys.stderr)
    return 0


def _positive_minutes(text: str) -> float:
    """argparse type of --minutes: a positive number."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of minutes")
    return value


def _cmd_init(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune init", description="Write a commented config for a data file or folder that trains as it is."
    )
    parser.add_argument(
        "data",
        help="a csv/tsv/jsonl/json/parquet file, a folder of train/dev/test files, or a "
        "folder with one sub-folder per label",
    )
    parser.add_argument("-o", "--output", default=None, help="the config to write (default: <data name>.yaml)")
    parser.add_argument(
        "--model",
        default=None,
        help="model directory, alias or hub id (default minilm-l6; without it, single-label data gets each "
        "offline encoder's estimated run time)",
    )
    parser.add_argument(
        "--minutes",
        type=_positive_minutes,
        default=None,
        help="the time you can give: the strongest offline encoder whose run fits is written, with this budget",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output file")
    parser.add_argument(
        "--no-budget",
        action="store_true",
        help="write no time budget (train.max_minutes), so no training step is timed on this machine",
    )
    args = parser.parse_args(argv)
    from finetune.init.write import init_config

    data = Path(args.data)
    out = Path(args.output or f"{data.resolve().stem if data.is_file() else data.resolve().name}.yaml")
    for note in init_config(data, out, args.model, args.force, budget=not args.no_budget, minutes=args.minutes):
        print(f"  {note}", file=sys.stderr)
    print(f"wrote {out}; train with: finetune train --config {out}", file=sys.stderr)
    return 0


def _cmd_config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune config", description="The config schema, and a config as the run would resolve it."
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--show", metavar="CONFIG", help="print CONFIG resolved (defaults filled, overrides applied)")
    what.add_argument("--schema", action="store_true", help="print the JSON Schema of a config file (for editors)")
    what.add_argument("--markdown", action="store_true", help="print the configuration reference (docs/CONFIG.md)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides (with --show)")
    args = parser.parse_args(argv)
    from finetune.config.docs import json_schema, schema_markdown
    from finetune.config.files import dump_config, load_config

    if args.show is None and args.overrides:
        raise UserError("overrides go with --show CONFIG")
    if args.show is not None:
        print(dump_config(load_config(args.show, args.overrides)), end="")
    else:
        print(json_schema() if args.schema else schema_markdown(), end="")
    return 0


def _cmd_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune export",
        description="Export a run's final/ to ONNX (dynamic batch and sequence axes), checked with ONNX Runtime "
        "against PyTorch; OUT_DIR holds model.onnx, config and tokenizer.",
    )
    parser.add_argument("--onnx", action="store_true", help="export to ONNX (the one format for now)")
    parser.add_argument("final_dir", help="a run's final/ directory")
    parser.add_argument("out_dir", help="the directory to write (must not exist, or be empty, unless --force)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    parser.add_argument("--atol", type=float, default=1e-4, help="largest logit difference accepted (default 1e-4)")
    parser.add_argument(
        "--quantize",
        choices=["int8"],
        default=None,
        help="int8: dynamic int8 quantization for CPU serving, compared with fp32 on the run's validation set",
    )
    args = parser.parse_args(argv)
    if not args.onnx:
        raise UserError("choose the export format: finetune export --onnx FINAL_DIR OUT_DIR")
    from finetune.deploy.export import describe_check, export_onnx

    check = export_onnx(Path(args.final_dir), Path(args.out_dir), args.force, atol=args.atol, quantize=args.quantize)
    print(describe_check(check, args.out_dir), file=sys.stderr)
    return 0


def _cmd_sweep(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune sweep",
        description="Search hyper-parameters with Optuna (TPE, median pruning): each trial is a run in "
        "<run.output_dir>/trial-NNN, the study in <run.output_dir>/study.db, the best config in best.yaml.",
    )
    parser.add_argument("--config", required=True, help="YAML config file (its sweep: section is the search space)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. data.max_train_samples=2000")
    parser.add_argument("--trials", type=int, required=True, help="trials to run now (added to the study)")
    parser.add_argument(
        "--storage",
        default=None,
        help="Optuna storage URL (default sqlite:///<run.output_dir>/study.db); a shared RDB URL "
        "lets several machines work on one study",
    )
    parser.add_argument("--study-name", default=None, help="study name in the storage (default: run.output_dir's name)")
    parser.add_argument("--timeout", type=float, default=None, help="start no trial after this many seconds")
    args = parser.parse_args(argv)
    if args.trials < 1:
        raise UserError(f"--trials {args.trials}: a sweep runs at least one trial")
    if args.timeout is not None and args.timeout <= 0:
        raise UserError(f"--timeout {args.timeout:g}: give a positive number of seconds")
    from finetune.config.files import load_config
    from finetune.sweep import run_sweep
    from finetune.training.runtime import Preempted

    try:
        run_sweep(load_config(args.config, args.overrides), args.trials, args.storage, args.study_name, args.timeout)
    except Preempted as exc:  # the trial in progress is recorded as failed; finished trials stay in the study
        print(
            f"{exc.signal_name}: the sweep stopped in a trial at step {exc.step} (checkpoint {exc.checkpoint}); "
            "run the same command again to add trials to the study",
            file=sys.stderr,
        )
        return exc.exit_code
    return 0


def _cmd_audit(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune audit",
        description="Find the training rows whose label is likely wrong: K-fold out-of-sample predictions (each fold "
        "an ordinary run in <run.output_dir>/fold-K) and confident learning (cleanlab); the rows ranked in "
        "<run.output_dir>/label_issues.csv. A stopped audit continues when the same command is run again.",
    )
    parser.add_argument("--config", required=True, help="the YAML config `finetune train` takes")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. audit.folds=3")
    parser.add_argument(
        "--minutes",
        type=_positive_minutes,
        default=None,
        help="the time the whole audit may take (shared by the folds)",
    )
    args = parser.parse_args(argv)
    from finetune.audit import run_audit, summary_line
    from finetune.config.files import load_config
    from finetune.training.runtime import Preempted

    cfg = load_config(args.config, args.overrides)
    try:
        summary = run_audit(cfg, args.minutes)
    except Preempted as exc:
        print(
            f"{exc.signal_name}: the audit stopped in a fold at step {exc.step} (checkpoint {exc.checkpoint}); run the "
            "same command again to continue (finished folds are kept)",
            file=sys.stderr,
        )
        return exc.exit_code
    print(summary_line(summary), file=sys.stderr)
    kept = [o for o in args.overrides if not o.startswith(("run.output_dir=", "audit."))]  # the audit's own keys
    again = ["finetune", "train", "--config", args.config, *kept, f"data.exclude_rows={summary['exclude_file']}"]
    print(
        f"train without them: {shlex.join([*again, f'run.output_dir={cfg.run.output_dir}-clean'])} (or edit the "
        "file first: its `row` column lists the rows left out)",
        file=sys.stderr,
    )
    return 0


COMMANDS = {
    "train": _cmd_train,
    "distill": _cmd_distill,
    "plan": _cmd_plan,
    "evaluate": _cmd_evaluate,
    "predict": _cmd_predict,
    "report": _cmd_report,
    "config": _cmd_config,
    "init": _cmd_init,
    "export": _cmd_export,
    "sweep": _cmd_sweep,
    "audit": _cmd_audit,
}


def main(argv: list[str] | None = None) -> int:
    """`finetune <command> ...`; user errors print one line and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: finetune {{{','.join(COMMANDS)}}} ...  (finetune COMMAND --help for its options)"
    if argv[:1] in (["-h"], ["--help"]):  # asked for: the usage on stdout, success
        print(usage)
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage, file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
