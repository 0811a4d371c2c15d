"""finetune vs transformers.Trainer: samples/s, dev accuracy, padding, loop overhead, time to accuracy.

    python scripts/bench_vs_trainer.py                    # throughput: 3 alternating repeats
    python scripts/bench_vs_trainer.py --mode overhead    # our loop vs a minimal PyTorch loop, same batches
    python scripts/bench_vs_trainer.py --target-acc 0.87  # wall time to first reach 87% dev accuracy

Everything runs in this one process, side by side and alternating (A B C A B C ...), so a busy
or throttled machine slows every contestant alike: report the RATIOS, not the absolute numbers.

Contestants (same model, same rows, same seed, same hyper-parameters):
- `finetune`: `finetune.train.train(cfg)`, the real code path (configs/sst2-minilm.yaml plus
  overrides), samples/s as logged by its loop (evaluation excluded).
- `finetune-packed`: the same with `data.packing=true` (several sentences per row, block-diagonal
  attention, positions restarting per sentence).
- `trainer`: `transformers.Trainer` as a user would write it: `datasets.map` tokenization,
  `DataCollatorWithPadding`, `TrainingArguments` defaults except the shared hyper-parameters.
- `trainer-grouped`: the same with `train_sampling_strategy="group_by_length"` (Trainer's own
  answer to padding).
Throughput is training time only (Trainer: on_train_begin -> on_train_end; finetune: its loop's
logged time), so model loading, tokenization and evaluation are excluded for all.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from finetune.config.files import load_config  # noqa: E402
from finetune.config.schema import Config  # noqa: E402
from finetune.core.fileio import read_jsonl  # noqa: E402
from finetune.data.build import build_data, build_train_loader  # noqa: E402
from finetune.data.reading import load_raw_splits  # noqa: E402
from finetune.model.load import build_model, build_tokenizer, resolve_model_path  # noqa: E402
from finetune.training.optim import build_optimizer, build_scheduler, planned_steps  # noqa: E402

BASE_CONFIG = ROOT / "configs" / "sst2-minilm.yaml"


# ----------------------------------------------------------------------------------------------
# Shared setup.


def make_config(args: argparse.Namespace, out: Path, seed: int, rows: int, extra: list[str] | None = None) -> Config:
    """The finetune config every contestant shares (its hyper-parameters are copied to Trainer)."""
    overrides = [
        f"run.output_dir={out}",
        "run.overwrite=true",
        f"run.seed={seed}",
        f"data.max_train_samples={rows}",
        f"data.max_length={args.max_length}",
        f"train.micro_batch_size={args.micro}",
        "train.gradient_accumulation_steps=1",
        f"train.epochs={args.epochs}",
        "train.eval_every_steps=null",
        f"train.log_every_steps={10**9}",  # one log row at the last step: the whole loop's samples/s
        "checkpoint.every_steps=null",
        f"precision.mode={args.precision}",
        *(f"run.num_threads={args.threads}",) * bool(args.threads),  # finetune sets its own threads otherwise
        *(f"train.learning_rate={args.lr}",) * (args.lr is not None),
        *args.override,
        *(extra or []),
    ]
    return load_config(args.base, overrides)


def shared_hparams(cfg: Config, total_steps: int) -> dict[str, Any]:
    """finetune's optimisation settings in TrainingArguments terms."""
    t = cfg.train
    warmup = t.warmup_steps if t.warmup_steps is not None else round(t.warmup_ratio * total_steps)
    return dict(
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        warmup_steps=warmup,
        lr_scheduler_type=t.lr_scheduler if t.lr_scheduler != "constant" else "constant_with_warmup",
        max_grad_norm=t.max_grad_norm or 0.0,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon,
        per_device_train_batch_size=int(t.micro_batch_size),
        num_train_epochs=t.epochs,
        seed=cfg.run.seed,
    )


class DevSet:
    """The dev split, tokenized once, evaluated the same way for every contestant."""

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        raw = load_raw_splits(cfg)
        assert raw.validation is not None
        ids = {r: raw.label_names.index(n) for r, n in raw.raw_to_name.items()}
        enc = tokenizer(list(raw.validation["text"]), truncation=True, max_length=cfg.data.max_length)
        self.items = sorted(
            zip(enc["input_ids"], [ids[v] for v in raw.validation["label"]], strict=True), key=lambda x: len(x[0])
        )
        self.pad = tokenizer.pad_token_id

    @torch.no_grad()
    def accuracy(self, model: torch.nn.Module, batch_size: int = 64) -> float:
        was_training = model.training
        model.eval()
        correct = 0
        for s in range(0, len(self.items), batch_size):
            chunk = self.items[s : s + batch_size]
            n = max(len(x) for x, _ in chunk)
            ids = torch.full((len(chunk), n), self.pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), n), dtype=torch.long)
            for i, (x, _) in enumerate(chunk):
                ids[i, : len(x)] = torch.tensor(x)
                mask[i, : len(x)] = 1
            pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
            correct += int((pred == torch.tensor([y for _, y in chunk])).sum())
        model.train(was_training)
        return correct / len(self.items)


# ----------------------------------------------------------------------------------------------
# Contestants.


class _CpuTime:
    """`time` with perf_counter replaced by the process CPU clock."""

    def __getattr__(self, name: str) -> Any:
        return time.process_time if name == "perf_counter" else getattr(time, name)


def _curve_clock(args: argparse.Namespace) -> Any:
    return time.process_time if args.clock == "cpu" else time.perf_counter


class _TargetReached(Exception):
    """Time-to-accuracy: finetune's run crossed the target (the run is abandoned there)."""


def run_finetune(
    args: argparse.Namespace,
    seed: int,
    rows: int,
    eval_every: int | None = None,
    packed: bool = False,
    probe: Any = None,
) -> dict[str, Any]:
    """finetune's real code path; samples/s and padding as its loop logged them (`packed`: data.packing=true).
    `probe.enable()` / `probe.disable()` bracket the loop (a profiler)."""
    import finetune.train as ft
    from finetune.data.window import WindowedBatchSampler

    # CPU time of the loop, for a shared machine: from the loop's first set_epoch to the final
    # evaluation (the first evaluate call when there is no evaluation during training)
    marks: dict[str, float] = {}
    set_epoch, collect, score = WindowedBatchSampler.set_epoch, ft.collect_outputs, ft.score

    def mark_start(self: Any, epoch: int) -> None:
        if "cpu0" not in marks and probe is not None:
            probe.enable()
        marks.setdefault("cpu0", time.process_time())
        set_epoch(self, epoch)

    reached: dict[int, float] = {}

    def mark_end(*a: Any, **k: Any) -> Any:
        if "cpu1" not in marks and probe is not None:
            probe.disable()
        marks.setdefault("cpu1", time.process_time())
        return collect(*a, **k)

    def check_target(*a: Any, **k: Any) -> Any:
        metrics = score(*a, **k)
        if eval_every and args.target_acc is not None:
            # the loop evaluates at every eval_every-th step; stop at the first crossing, as the Trainer callback does
            marks["evals"] = marks.get("evals", 0) + 1
            if metrics["accuracy"] >= args.target_acc:
                reached[int(marks["evals"]) * eval_every] = metrics["accuracy"]
                raise _TargetReached
        return metrics

    WindowedBatchSampler.set_epoch, ft.collect_outputs, ft.score = mark_start, mark_end, check_target  # type: ignore
    if eval_every and args.clock == "cpu":
        # the loop times its log intervals (evaluation excluded) with time.perf_counter: hand it
        # the process CPU clock so the curve is in CPU seconds like Trainer's
        ft.time = _CpuTime()  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ft-") as tmp:
            extra = (
                [f"train.eval_every_steps={eval_every}", f"train.log_every_steps={eval_every}"] if eval_every else []
            )
            extra += ["data.packing=true"] * packed + args.ours
            cfg = make_config(args, Path(tmp) / "run", seed, rows, extra)
            try:
                final = ft.train(cfg)
            except _TargetReached:
                final = {"accuracy": next(iter(reached.values()))}
            rows_ = read_jsonl(Path(tmp) / "run" / "metrics.jsonl")
    finally:
        WindowedBatchSampler.set_epoch, ft.collect_outputs, ft.score = set_epoch, collect, score  # type: ignore
        ft.time = time  # type: ignore[assignment]
    train_rows = [r for r in rows_ if "samples_per_s" in r]
    out: dict[str, Any] = {"accuracy": final["accuracy"]}
    if eval_every is None:
        out["samples_per_s"] = train_rows[-1]["samples_per_s"]
        out["padding_fraction"] = train_rows[-1]["padding_fraction"]
        out["samples_per_cpu_s"] = rows * args.epochs / (marks["cpu1"] - marks["cpu0"])
    else:
        # cumulative training time at each evaluation: each log interval's samples / its samples/s
        per_step = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps
        t, prev, curve = 0.0, 0, []
        evals = {r["step"]: r["eval_accuracy"] for r in rows_ if "eval_accuracy" in r} | reached
        for r in train_rows:
            t += min((r["step"] - prev) * per_step, rows - prev * per_step) / r["samples_per_s"]
            prev = r["step"]
            if r["step"] in evals:
                curve.append((r["step"], t, evals[r["step"]]))
        out["curve"] = curve
    return out


def _trainer_data(cfg: Config, tokenizer: Any) -> Any:
    """The same rows, tokenized the way a Trainer user would (datasets.map, truncation)."""
    raw = load_raw_splits(cfg)
    ids = {r: raw.label_names.index(n) for r, n in raw.raw_to_name.items()}

    def enc(b: dict[str, list[Any]]) -> dict[str, Any]:
        out = tokenizer(b["text"], truncation=True, max_length=cfg.data.max_length)
        out["labels"] = [ids[v] for v in b["label"]]
        return out

    return raw.train.map(enc, batched=True, remove_columns=raw.train.column_names)


def run_trainer(
    args: argparse.Namespace,
    seed: int,
    rows: int,
    grouped: bool,
    dev: DevSet | None = None,
    eval_every: int | None = None,
) -> dict[str, Any]:
    """transformers.Trainer with its defaults (plus the shared hyper-parameters)."""
    from transformers import (
        AutoModelForSequenceClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    with tempfile.TemporaryDirectory(prefix="bench-tr-") as tmp:
        cfg = make_config(args, Path(tmp) / "unused", seed, rows)
        tokenizer = build_tokenizer(cfg)
        train_ds = _trainer_data(cfg, tokenizer)
        steps_per_epoch = math.ceil(len(train_ds) / args.micro)
        total = planned_steps(cfg, steps_per_epoch)[0]
        set_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            resolve_model_path(cfg.model.name_or_path or ""), num_labels=2
        )
        targs = TrainingArguments(
            output_dir=tmp,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            **({"train_sampling_strategy": "group_by_length"} if grouped else {}),
            **shared_hparams(cfg, total),
        )
        clock: dict[str, Any] = {"excluded": 0.0, "curve": []}

        class Clock(TrainerCallback):
            def on_train_begin(self, *a: Any, **k: Any) -> None:
                clock["t0"], clock["cpu0"], clock["c0"] = time.perf_counter(), time.process_time(), _curve_clock(args)()

            def on_step_end(self, a: Any, state: Any, control: Any, model: Any = None, **k: Any) -> None:
                # `model`: the model being trained, as Trainer hands it to every callback (not a
                # closure over run_trainer's local, which that function `del`s at its end)
                if eval_every and dev is not None and state.global_step % eval_every == 0:
                    now = _curve_clock(args)
                    t = now()
                    acc = dev.accuracy(model)
                    clock["curve"].append((state.global_step, t - clock["c0"] - clock["excluded"], acc))
                    clock["excluded"] += now() - t
                    if args.target_acc is not None and acc >= args.target_acc:
                        control.should_training_stop = True

            def on_train_end(self, *a: Any, **k: Any) -> None:
                clock["t1"], clock["cpu1"] = time.perf_counter(), time.process_time()

        trainer = Trainer(
            model=model,
            args=targs,
            train_dataset=train_ds,
            data_collator=DataCollatorWithPadding(tokenizer),
            callbacks=[Clock()],
        )
        trainer.train()
        seconds = clock["t1"] - clock["t0"] - (clock["excluded"] if args.clock == "wall" else 0.0)
        out: dict[str, Any] = {"samples_per_s": len(train_ds) * args.epochs / seconds, "curve": clock["curve"]}
        out["samples_per_cpu_s"] = len(train_ds) * args.epochs / (clock["cpu1"] - clock["cpu0"])
        # padding of the batches this Trainer feeds (one pass over its own dataloader, no model)
        real = total_tok = 0
        for batch in trainer.get_train_dataloader():
            real += int(batch["attention_mask"].sum())
            total_tok += batch["attention_mask"].numel()
        out["padding_fraction"] = 1.0 - real / max(total_tok, 1)
        out["accuracy"] = dev.accuracy(model) if dev is not None else float("nan")
        del trainer, model
    return out


def run_minimal(args: argparse.Namespace, seed: int, rows: int, probe: Any = None) -> dict[str, Any]:
    """A minimal hand-written loop over the batches finetune's own loader yields (same order,
    same padding), in the same precision written by hand: fp32; bf16 = autocast around the forward;
    bf16-true = the whole model cast to bf16 (no fp32 norms). It steps finetune's optimizer and
    scheduler (bf16-true: the same Bf16AdamW update), so what remains is loop overhead."""
    from accelerate.utils import set_seed

    with tempfile.TemporaryDirectory(prefix="bench-min-") as tmp:
        cfg = make_config(args, Path(tmp) / "run", seed, rows)
        set_seed(seed)
        tokenizer = build_tokenizer(cfg)
        data = build_data(cfg, tokenizer)
        model = build_model(cfg, data.label_names, tokenizer)
        loader, sampler = build_train_loader(data.train, tokenizer, cfg, args.micro, 1, 1)
        total, _ = planned_steps(cfg, sampler.num_windows())
        mode = cfg.precision.mode
        if mode == "bf16-true":
            model.to(torch.bfloat16)
        optimizer = build_optimizer(cfg, model)
        scheduler = build_scheduler(cfg, optimizer, total)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16")
        model.train()
        n = 0
        if probe is not None:
            probe.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        for batch in loader:
            labels = batch.pop("labels")
            batch.pop("sample_weight"), batch.pop("window_samples")
            with autocast:
                logits = model(**batch).logits
            loss = F.cross_entropy(logits.float(), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm or math.inf)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            n += len(labels)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if probe is not None:
            probe.disable()
    return {"samples_per_s": n / seconds, "samples_per_cpu_s": n / cpu}


# ----------------------------------------------------------------------------------------------
# Modes.


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mode_throughput(args: argparse.Namespace) -> dict[str, Any]:
    cfg = make_config(args, Path(tempfile.gettempdir()) / "bench-unused", args.seed, args.rows)
    dev = DevSet(cfg, build_tokenizer(cfg))
    names = ["finetune", "finetune-packed", "trainer", "trainer-grouped"]
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    warm_up(args, dev)
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else list(reversed(names)):  # alternate the order too
            t = time.perf_counter()
            if name.startswith("finetune"):
                r = run_finetune(args, args.seed, args.rows, packed=name == "finetune-packed")
            else:
                r = run_trainer(args, args.seed, args.rows, grouped=name == "trainer-grouped", dev=dev)
            r.pop("curve", None)
            results[name].append(r)
            print(
                f"[repeat {rep + 1}/{args.repeats}] {name:16s} {r['samples_per_s']:7.1f} samples/s  "
                f"{r['samples_per_cpu_s']:7.1f} samples/cpu-s  "
                f"acc {r['accuracy']:.4f}  padding {r['padding_fraction']:.3f}  ({time.perf_counter() - t:.0f} s)",
                flush=True,
            )
            gc.collect()
    keys = ("samples_per_s", "samples_per_cpu_s", "accuracy", "padding_fraction")
    summary = {n: {k: _median([r[k] for r in rs]) for k in keys} for n, rs in results.items()}
    # ratios per repeat (side by side), then their median
    ratios = {
        f"{a}/{b}" + (" (cpu)" if k == "samples_per_cpu_s" else ""): _median(
            [x[k] / y[k] for x, y in zip(results[a], results[b], strict=True)]
        )
        for k in ("samples_per_s", "samples_per_cpu_s")
        for a, b in (
            ("finetune", "trainer"),
            ("finetune", "trainer-grouped"),
            ("finetune-packed", "trainer"),
            ("finetune-packed", "trainer-grouped"),
            ("finetune-packed", "finetune"),
            ("trainer-grouped", "trainer"),
        )
    }
    print(
        f"\nmedian of {args.repeats} alternating repeats; {args.rows} rows, micro-batch {args.micro}, "
        f"max length {args.max_length}, "
        f"fp32, lr {cfg.train.learning_rate}, seed {args.seed}, torch threads {torch.get_num_threads()}"
    )
    print(f"{'':16s} {'samples/s':>10s} {'samples/cpu-s':>14s} {'dev acc':>8s} {'padding':>8s}")
    for n, s in summary.items():
        print(
            f"{n:16s} {s['samples_per_s']:10.1f} {s['samples_per_cpu_s']:14.1f} {s['accuracy']:8.4f} "
            f"{s['padding_fraction']:8.3f}"
        )
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}x")
    return {"mode": "throughput", "runs": results, "median": summary, "ratios": ratios}


def warm_up(args: argparse.Namespace, dev: DevSet | None = None) -> None:
    """One short discarded run of each code path: the first run in a process pays one-off costs
    (imports, allocator and thread-pool warm-up, dataset caches) that would bias repeat 1."""
    if args.warmup_rows <= 0:
        return
    run_finetune(args, args.seed, args.warmup_rows)
    if args.mode == "throughput":  # packing refuses decoders; the overhead mode does not run it
        run_finetune(args, args.seed, args.warmup_rows, packed=True)
    run_minimal(args, args.seed, args.warmup_rows)
    if dev is not None:
        run_trainer(args, args.seed, args.warmup_rows, grouped=False, dev=None)
    gc.collect()


def mode_overhead(args: argparse.Namespace) -> dict[str, Any]:
    ours, minimal = [], []
    warm_up(args)
    for rep in range(args.repeats):
        pair = [("finetune", run_finetune), ("minimal", run_minimal)]
        for name, fn in pair if rep % 2 == 0 else pair[::-1]:
            r = fn(args, args.seed, args.rows)
            (ours if name == "finetune" else minimal).append(r)
            print(
                f"[repeat {rep + 1}/{args.repeats}] {name:9s} {r['samples_per_s']:7.1f} samples/s  "
                f"{r['samples_per_cpu_s']:7.1f} samples/cpu-s",
                flush=True,
            )
            gc.collect()
    overhead = {
        k: _median([m[k] / o[k] - 1.0 for o, m in zip(ours, minimal, strict=True)])
        for k in ("samples_per_s", "samples_per_cpu_s")
    }
    print(
        f"\nour loop vs a minimal loop over identical batches (median of {args.repeats}): "
        f"finetune {_median([o['samples_per_s'] for o in ours]):.1f} samples/s, "
        f"minimal {_median([m['samples_per_s'] for m in minimal]):.1f}; "
        f"overhead {100 * overhead['samples_per_s']:+.1f}% wall, {100 * overhead['samples_per_cpu_s']:+.1f}% cpu time"
    )
    result = {"mode": "overhead", "finetune": ours, "minimal": minimal, "overhead": overhead}
    if args.profile is not None:
        result["host_syncs"] = profile_loops(args)
    return result


def profile_loops(args: argparse.Namespace) -> dict[str, Any]:
    """One more run of each loop under cProfile and the host-sync counter: the top functions by their own
    time, and the reads of tensor values by call site, written to `args.profile`."""
    import cProfile
    import io
    import pstats

    from finetune.core.syncs import HostSyncCounter

    class Probe:
        """cProfile and the host-sync counter, on for the loop only."""

        def __init__(self) -> None:
            self.prof, self.counter = cProfile.Profile(), HostSyncCounter()
            self.before: Any = None
            self.loop_sites: Any = None

        def enable(self) -> None:
            self.before = self.counter.sites.copy()
            self.prof.enable()

        def disable(self) -> None:
            self.prof.disable()
            self.loop_sites = self.counter.sites - self.before  # the loop's reads only

    text, syncs = [], {}
    for name, fn in (("finetune", run_finetune), ("minimal", run_minimal)):
        probe = Probe()
        with probe.counter:
            r = fn(args, args.seed, args.rows, probe=probe)
        prof, sites = probe.prof, probe.loop_sites
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(30)
        print("the loop's own Python (finetune, accelerate) by cumulative time:", file=out)
        stats.sort_stats("cumulative").print_stats(r"finetune/|accelerate/", 30)
        total, top = sum(sites.values()), sites.most_common(15)
        syncs[name] = {"total": total, "top_sites": top}
        text += [f"# {name}: {r['samples_per_s']:.1f} samples/s under the profiler", out.getvalue()]
        text += [f"host reads of tensor values in the loop: {total}"] + [f"  {n:6d}  {site}" for site, n in top]
    args.profile.write_text("\n".join(text))
    print(f"profile written to {args.profile}")
    return syncs


def _first_crossing(curve: list[tuple[int, float, float]], target: float) -> float | None:
    return next((t for _, t, acc in curve if acc >= target), None)


def mode_target(args: argparse.Namespace) -> dict[str, Any]:
    cfg = make_config(args, Path(tempfile.gettempdir()) / "bench-unused", args.seed, args.rows)
    dev = DevSet(cfg, build_tokenizer(cfg))
    names = ["finetune", "trainer"] + (["trainer-grouped"] if args.with_grouped else [])
    times: dict[str, list[float | None]] = {n: [] for n in names}
    curves: dict[str, list[Any]] = {n: [] for n in names}
    for i, seed in enumerate(range(args.seed, args.seed + args.seeds)):
        for name in names if i % 2 == 0 else names[::-1]:
            if name == "finetune":
                r = run_finetune(args, seed, args.rows, eval_every=args.eval_every)
            else:
                r = run_trainer(
                    args, seed, args.rows, grouped=name == "trainer-grouped", dev=dev, eval_every=args.eval_every
                )
            t = _first_crossing(r["curve"], args.target_acc)
            times[name].append(t)
            curves[name].append(r["curve"])
            best = max((acc for _, _, acc in r["curve"]), default=float("nan"))
            print(
                f"[seed {seed}] {name:16s} time to {args.target_acc:.2f}: "
                f"{'not reached' if t is None else f'{t:.0f} s'} (best {best:.4f})",
                flush=True,
            )
            gc.collect()

    def med(xs: list[float | None]) -> float | None:
        # an unreached target counts as infinitely slow (the median still exists if most reach it)
        return statistics.median([math.inf if x is None else x for x in xs])

    summary = {n: med(ts) for n, ts in times.items()}
    print(
        f"\n{args.clock} time to first reach {args.target_acc:.2f} dev accuracy "
        f"(training only, evaluation every {args.eval_every} steps excluded), median over {args.seeds} seeds:"
    )
    for n, v in summary.items():
        print(f"{n:16s} {v:8.0f} s")
    ratio = summary["finetune"] / summary["trainer"] if summary["trainer"] not in (None, math.inf, 0) else float("nan")
    print(f"ratio finetune/trainer: {ratio:.2f}x")
    return {
        "mode": "target",
        "target": args.target_acc,
        "times": times,
        "curves": curves,
        "median": summary,
        "ratio": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["throughput", "overhead"], default="throughput")
    p.add_argument("--base", type=Path, default=BASE_CONFIG, help="the config every contestant starts from")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "bf16-true"],
        default="fp32",
        help="precision.mode of every contestant (the minimal loop: autocast, or the model cast to bf16)",
    )
    p.add_argument(
        "--profile", type=Path, default=None, help="overhead mode: cProfile both loops once, top functions to this file"
    )
    p.add_argument("--rows", type=int, default=3200, help="first N SST-2 training rows (default 3200)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--micro", type=int, default=32, help="micro-batch size (default 32)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target-acc", type=float, default=None, help="time-to-accuracy mode: the dev accuracy to reach")
    p.add_argument("--seeds", type=int, default=3, help="time-to-accuracy: seeds (median)")
    p.add_argument("--eval-every", type=int, default=25, help="time-to-accuracy: evaluate every N optimizer steps")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time-to-accuracy: wall time, or process CPU time (robust on a shared machine; use with --threads 1)",
    )
    p.add_argument("--with-grouped", action="store_true", help="time-to-accuracy: also Trainer with group_by_length")
    p.add_argument(
        "--warmup-rows",
        type=int,
        default=None,
        help="rows of the discarded warm-up run of each code path (0: none; default 64, and --rows in the overhead "
        "mode: CPU bf16 kernels are set up once per new shape, which would bill the first contestant for every shape)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=None, help="write all results here")
    p.add_argument(
        "--ours",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="overrides for finetune alone: recipes Trainer has no option for (train.layer_lr_decay=0.8)",
    )
    p.add_argument("override", nargs="*", help="extra finetune overrides (dotted.key=value) for every contestant")
    args = p.parse_args(argv)
    if args.warmup_rows is None:
        args.warmup_rows = args.rows if args.mode == "overhead" else 64
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target_acc is not None:
        result = mode_target(args)
    elif args.mode == "overhead":
        result = mode_overhead(args)
    else:
        result = mode_throughput(args)
    result["command"] = " ".join(sys.argv)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
