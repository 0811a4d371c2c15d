"""`finetune audit`: the training rows whose label is likely wrong, ranked, in `label_issues.csv`.

The training rows are read exactly as `finetune train` reads them (the same config and dotted overrides;
`data.exclude_rows` applied, the first `data.max_train_samples` rows when it is set) and dealt into
`audit.folds` seeded folds, stratified by label. Fold k is an ordinary run of `train.train` in
`<run.output_dir>/fold-<k>/` on the rows of the other folds (`data.exclude_rows` leaves fold k out; the config's
validation, early stopping, precision and checkpoints as they are; `fold_epochs` passes; no test split), after
which its final/ predicts fold k's rows. Every row so gets probabilities from a model that never saw it, and
confident learning (`evaluation.issues`, cleanlab) picks the rows whose given label they contradict.

A finished fold's probabilities are in `fold-<k>/holdout.json`, so a stopped audit (SIGTERM, a crash) continues
from its finished folds, and the unfinished fold resumes from its last checkpoint (checkpoint.resume=auto).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from finetune.config.files import apply_overrides, dump_config, validate_config
from finetune.config.schema import Config
from finetune.config.tasks import MULTI, REGRESSION, SINGLE
from finetune.core.errors import UserError
from finetune.core.fileio import write_atomic
from finetune.data.reading import EXCLUDE_COLUMN, LabelTarget, TrainRows, read_train_rows
from finetune.deploy.card import plot_confusion_matrix
from finetune.deploy.final import load_final
from finetune.deploy.predict import model_logits
from finetune.evaluation.issues import LabelIssue, check_cleanlab, find_label_issues, label_text, swap_counts
from finetune.evaluation.metrics import predictions
from finetune.init.recipe import SEEN_PER_CLASS, step_seconds
from finetune.model.load import build_tokenizer
from finetune.train import train
from finetune.training.runtime import PreemptionGuard

logger = logging.getLogger("finetune")

ISSUES_FILE = "label_issues.csv"
AUDIT_FILE = "audit.json"
CONFIG_FILE = "audit.yaml"  # the audit's resolved config: a rerun continues only the same audit
PLOT_FILE = "label_issues.png"  # single-label: flagged rows by given and suggested label
HOLDOUT_FILE = "holdout.json"  # in fold-<k>/: the fold's rows and their out-of-sample logits


def audited_rows(cfg: Config) -> TrainRows:
    """The rows an audit covers: the training rows as `finetune train` reads them, cut to `data.max_train_samples`.

    Raises:
        UserError: unreadable data, a regression task, fewer rows of a class than `audit.folds`.
    """
    if cfg.model.problem_type == REGRESSION:
        raise UserError("finetune audit finds wrong class labels; model.problem_type=regression has none")
    rows = read_train_rows(cfg)
    n = cfg.data.max_train_samples
    if n is not None and n < len(rows.rows):
        rows.data, rows.rows = rows.data.select(range(n)), rows.rows[:n]
    k = cfg.audit.folds
    if cfg.model.problem_type == SINGLE:
        counts = Counter(rows.data["label"][:])
        name, fewest = min(((rows.raw_to_name[v], c) for v, c in counts.items()), key=lambda x: x[1])
        if fewest < 2:
            raise UserError(f"class {name!r} has {fewest} training row: an audit needs at least 2 rows a class")
        if fewest < k:
            raise UserError(
                f"audit.folds={k}: every class needs at least {k} training rows (one in each fold); {name!r} has "
                f"{fewest}: set audit.folds={fewest} or lower"
            )
    elif len(rows.rows) < k:
        raise UserError(f"audit.folds={k}: only {len(rows.rows)} training rows")
    return rows


def assign_folds(targets: list[Any], texts: list[str], problem_type: str, folds: int, seed: int) -> list[int]:
    """The fold of each row: seeded, stratified by label for single-label data (scikit-learn's StratifiedKFold;
    KFold for multi-label). Where a text occurs more than once, every copy goes to one fold (the Group variants):
    a copy in the training folds would teach the model the held-out copy's label, wrong or not."""
    from sklearn.model_selection import GroupKFold, KFold, StratifiedGroupKFold, StratifiedKFold

    single, grouped = problem_type == SINGLE, len(set(texts)) < len(texts)
    if grouped:
        kind = StratifiedGroupKFold if single else GroupKFold
    else:
        kind = StratifiedKFold if single else KFold
    splitter = kind(folds, shuffle=True, random_state=seed)
    y = np.asarray(targets) if single else np.zeros(len(targets))
    groups = np.unique(texts, return_inverse=True)[1] if grouped else None
    out = [0] * len(targets)
    for k, (_, held) in enumerate(splitter.split(np.zeros(len(targets)), y, groups)):
        for i in held:
            out[i] = k
    return out


def data_digest(rows: TrainRows) -> str:
    """sha256 of the audited rows' texts and labels: a fold finished on other data is never reused."""
    h = hashlib.sha256()
    for i, text in enumerate(rows.data["text"][:]):
        h.update(f"{rows.rows[i]}\0{text}\0{rows.data[i].get('text_pair', '')}\0{rows.data[i]['label']}\n".encode())
    return h.hexdigest()


def prepare_dir(cfg: Config, digest: str) -> Path:
    """`run.output_dir`, empty or an audit of this very config and data (continued); `run.overwrite=true` starts
    afresh.

    Raises:
        UserError: the directory holds something else, or an audit of another config or other data.
    """
    out = Path(cfg.run.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"run.output_dir {out} exists and is not a directory")
    saved = out / CONFIG_FILE
    # the config as an audit compares it: run.overwrite=true starts one afresh, and audit.filter_by only ranks the
    # folds' predictions again, so neither is part of what the folds computed
    run, audit = cfg.run.model_copy(update={"overwrite": False}), cfg.audit.model_copy(update={"filter_by": None})
    same = dump_config(cfg.model_copy(update={"run": run, "audit": audit}))
    same += f"# data sha256 (the audited rows' texts and labels): {digest}\n"
    if out.is_dir() and any(out.iterdir()):
        if not saved.is_file():
            what = "a training run" if (out / "config.yaml").is_file() else f"no audit (no {CONFIG_FILE})"
            raise UserError(
                f"run.output_dir {out} is not empty and holds {what}; audit into another one, e.g. "
                f"run.output_dir={out}-audit"
            )
        if cfg.run.overwrite:
            shutil.rmtree(out)
        elif saved.read_text() != same:
            config_part = saved.read_text().split("\n# data sha256")[0]
            what = "other data" if config_part == same.split("\n# data sha256")[0] else "another config"
            raise UserError(
                f"run.output_dir {out} holds an audit of {what} ({saved} differs); choose another "
                "run.output_dir, or set run.overwrite=true to start this one afresh"
            )
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(saved, same)
    return out


def fold_epochs(cfg: Config, rows: TrainRows) -> float:
    """The passes each fold trains: `audit.epochs`, or by init's rule each class seen about SEEN_PER_CLASS times
    over a fold's run, at least one pass and at most `train.epochs` (large data: one pass, K passes in all; a few
    hundred rows a class: the passes a model needs to learn them at all)."""
    if cfg.audit.epochs is not None:
        return cfg.audit.epochs
    k, n = cfg.audit.folds, len(rows.rows)
    classes = max(1, len(rows.label_names))
    per_class = n * (k - 1) / k * (1 - (cfg.data.validation_split or 0.0)) / classes
    return float(min(cfg.train.epochs, max(1, math.ceil(SEEN_PER_CLASS / max(1.0, per_class)))))


def fold_config(cfg: Config, fold_dir: Path, exclude: Path, epochs: float, max_minutes: float | None) -> Config:
    """Fold k's training run: `cfg` writing into `fold_dir`, leaving out the rows `exclude` lists, resumable, no test
    split, `epochs` passes, and `max_minutes` (the audit's budget share) when tighter than the config's."""
    raw = cfg.model_dump(mode="json")
    t = cfg.train
    budget = min(x for x in (t.max_minutes, max_minutes) if x is not None) if (t.max_minutes or max_minutes) else None
    updates = {
        "run.output_dir": str(fold_dir / "run"),
        "run.overwrite": False,
        "data.exclude_rows": str(exclude),
        "data.max_train_samples": None,
        "data.test_file": None,
        "data.hub_test_split": None,
        "checkpoint.resume": "auto",
        "train.epochs": epochs,
        "train.max_minutes": budget,
    }
    raw = apply_overrides(raw, [f"{k}={json.dumps(v)}" for k, v in updates.items()])
    return validate_config(raw, source=f"audit {fold_dir.name}")


def _write_exclusions(path: Path, rows: list[int]) -> None:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([EXCLUDE_COLUMN])
    w.writerows([r] for r in rows)
    write_atomic(path, buf.getvalue())


def holdout_logits(final: Path, texts: list[str], pairs: list[str] | None) -> np.ndarray:
    """final/'s logits for `texts`, as `finetune predict` computes them.

    Raises:
        UserError: final/ cannot be loaded.
    """
    tokenizer, model = load_final(final)
    return model_logits(tokenizer, model, texts, pairs)


def estimate_line(cfg: Config, rows: TrainRows) -> str:
    """What the audit will run and, where a training step can be timed here (`init.recipe.step_seconds`), how long
    it should take (the folds' planned steps; predicting counts as a third of a step a batch)."""
    k, n = cfg.audit.folds, len(rows.rows)
    t, d = cfg.train, cfg.data
    epochs = fold_epochs(cfg, rows)
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else 8
    batch = t.batch_size or micro * t.gradient_accumulation_steps
    fold_rows = n - math.ceil(n / k)
    trained = fold_rows * (1 - (d.validation_split or 0.0))
    steps = math.ceil(epochs * math.ceil(trained / batch))
    line = (
        f"audit: {n:,} training rows in {k} folds; each fold a run of {epochs:g} epoch(s) on about {fold_rows:,} rows "
        f"({steps:,} steps of {batch}), then predicting its {math.ceil(n / k):,} held-out rows"
    )
    try:
        tokenizer = build_tokenizer(cfg)
        sample = rows.data["text"][: min(n, 256)]
        length = min(d.max_length, max(8, round(np.mean([len(x) for x in tokenizer(sample)["input_ids"]]))))
        seconds = step_seconds(cfg, rows.label_names, tokenizer, micro, batch // micro, length)
    except Exception as exc:  # an estimate only: the audit itself reports any real problem
        logger.debug(f"audit: no step timed ({type(exc).__name__}: {exc})")
        return line
    per_fold = steps * seconds + math.ceil(n / k) / batch * seconds / 3
    cap = f" (train.max_minutes caps a fold at {t.max_minutes:g})" if t.max_minutes else ""
    total = k * per_fold
    took = f"{total / 60:.0f} minutes" if total >= 120 else f"{total:.0f} s"
    return line + f"; about {took} at {seconds:.2f} s a step measured here{cap}"


def run_audit(cfg: Config, minutes: float | None = None) -> dict[str, Any]:
    """Audit the training labels of `cfg` (module docstring); return the summary written to audit.json.

    Raises:
        UserError: bad config or data (before anything is written), or any run's own user error.
        Preempted: a signal stopped a fold's run after its checkpoint (run the same command again to continue).
    """
    started = time.perf_counter()
    rows = audited_rows(cfg)
    target = _target(cfg, rows)
    labels = [target(v) for v in rows.data["label"][:]]
    if cfg.model.problem_type == MULTI:  # multi-hot -> the label ids cleanlab takes
        labels = [[j for j, on in enumerate(hot) if on] for hot in labels]
        always = [rows.label_names[j] for j in range(len(rows.label_names)) if all(j in y for y in labels)]
        if always:
            raise UserError(f"label {always[0]!r} is on in every training row: there is no wrong value of it to find")
    check_cleanlab()
    budget = minutes / cfg.audit.folds if minutes is not None else None
    try:  # a fold's config is valid before anything is written (--minutes sets train.max_minutes, which has needs)
        fold_config(cfg, Path(cfg.run.output_dir) / "fold-1", Path("exclude_rows.csv"), 1.0, budget)
    except UserError as exc:
        raise UserError(
            f"--minutes {minutes:g} gives each fold a train.max_minutes: {exc}" if minutes else str(exc)
        ) from None
    out = prepare_dir(cfg, data_digest(rows))
    k = cfg.audit.folds
    texts = rows.data["text"][:]
    pairs = rows.data["text_pair"][:] if "text_pair" in rows.data.column_names else None
    keys = texts if pairs is None else [f"{a}\0{b}" for a, b in zip(texts, pairs, strict=True)]
    fold_of = assign_folds(labels, keys, cfg.model.problem_type, k, cfg.run.seed)
    print(estimate_line(cfg, rows), file=sys.stderr, flush=True)
    logits: np.ndarray | None = None
    timings: dict[str, float] = {}
    with PreemptionGuard() as guard:
        for fold in range(k):
            fold_dir = out / f"fold-{fold + 1}"
            held = [i for i in range(len(labels)) if fold_of[i] == fold]
            fold_logits, seconds = _fold(cfg, rows, held, fold_dir, texts, pairs, guard, minutes, started, k - fold)
            timings[fold_dir.name] = seconds
            if logits is None:
                logits = np.zeros((len(labels), fold_logits.shape[1]))
            logits[held] = fold_logits
    assert logits is not None
    probs, predicted = predictions(logits, cfg.model.problem_type)
    assert probs is not None
    issues = find_label_issues(labels, probs, cfg.model.problem_type, cfg.audit.filter_by)
    write_issues(out / ISSUES_FILE, issues, rows, texts, pairs)
    exclude = out / ISSUES_FILE
    if rows.left_out:  # the config's own data.exclude_rows still holds: training leaves out both lists' rows
        exclude = out / "exclude_all.csv"
        _write_exclusions(exclude, sorted(set(rows.left_out) | {rows.rows[x.index] for x in issues}))
    summary = _summary(cfg, rows, labels, predicted, issues, timings, time.perf_counter() - started)
    summary["exclude_file"] = str(exclude)
    if cfg.log.plots and cfg.model.problem_type == SINGLE and issues:
        n = len(rows.label_names)
        swaps = np.zeros((n, n), dtype=int)
        for x in issues:
            swaps[x.given, x.suggested] += 1
        title = f"{len(issues):,} rows flagged by the audit"
        axes = ("suggested label (out of sample)", "given label")
        plot_confusion_matrix(swaps.tolist(), rows.label_names, out / PLOT_FILE, title, axes)
        summary["plot"] = str(out / PLOT_FILE)
    write_atomic(out / AUDIT_FILE, json.dumps(summary, indent=2))
    return summary


def _target(cfg: Config, rows: TrainRows) -> Any:
    return LabelTarget(cfg.model.problem_type, tuple(rows.label_names), tuple(sorted(rows.raw_to_name.items())))


def _fold(
    cfg: Config,
    rows: TrainRows,
    held: list[int],
    fold_dir: Path,
    texts: list[str],
    pairs: list[str] | None,
    guard: PreemptionGuard,
    minutes: float | None,
    started: float,
    folds_left: int,
) -> tuple[np.ndarray, float]:
    """One fold's held-out logits and seconds: from holdout.json when it finished before, else its run, then its
    final/'s prediction of the held-out rows."""
    done = fold_dir / HOLDOUT_FILE
    file_rows = [rows.rows[i] for i in held]
    if done.is_file():
        saved = json.loads(done.read_text())
        if saved["rows"] == file_rows:
            logger.info(f"audit: {fold_dir.name} finished before ({len(held)} rows); its predictions reused")
            return np.asarray(saved["logits"], dtype=np.float64), float(saved["seconds"])
    fold_start = time.perf_counter()
    fold_dir.mkdir(parents=True, exist_ok=True)
    exclude = fold_dir / "exclude_rows.csv"
    kept = set(rows.rows) - set(file_rows)
    _write_exclusions(exclude, [r for r in range(rows.total) if r not in kept])
    share = None
    if minutes is not None:
        left = minutes - (time.perf_counter() - started) / 60
        share = max(0.5, 0.9 * left / folds_left)  # a tenth kept for the folds' predictions
    fcfg = fold_config(cfg, fold_dir, exclude, fold_epochs(cfg, rows), share)
    logger.info(f"audit: {fold_dir.name} trains on {len(kept):,} rows, {len(held):,} held out")
    train(fcfg, guard)
    held_pairs = [pairs[i] for i in held] if pairs is not None else None
    logits = holdout_logits(Path(fcfg.run.output_dir) / "final", [texts[i] for i in held], held_pairs)
    seconds = time.perf_counter() - fold_start
    write_atomic(done, json.dumps({"rows": file_rows, "logits": logits.tolist(), "seconds": seconds}))
    return logits, seconds


def write_issues(
    path: Path, issues: list[LabelIssue], rows: TrainRows, texts: list[str], pairs: list[str] | None
) -> None:
    """label_issues.csv: `row` (the file's 0-based data row), `text` (`text_pair`), `given_label`,
    `suggested_label`, `score` (the probability of the given label), most likely wrong first."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        [
            EXCLUDE_COLUMN,
            "text",
            *(["text_pair"] if pairs is not None else []),
            "given_label",
            "suggested_label",
            "score",
        ]
    )
    for x in issues:
        i = x.index
        w.writerow(
            [
                rows.rows[i],
                texts[i],
                *([pairs[i]] if pairs is not None else []),
                label_text(x.given, rows.label_names),
                label_text(x.suggested, rows.label_names),
                f"{x.score:.4f}",
            ]
        )
    write_atomic(path, buf.getvalue())


def _summary(
    cfg: Config,
    rows: TrainRows,
    labels: list[Any],
    predicted: np.ndarray,
    issues: list[LabelIssue],
    timings: dict[str, float],
    seconds: float,
) -> dict[str, Any]:
    """audit.json: counts, the out-of-sample agreement with the given labels, the classes and swaps flagged most."""
    if cfg.model.problem_type == MULTI:
        agree = float(np.mean([list(np.flatnonzero(p)) == y for p, y in zip(predicted, labels, strict=True)]))
    else:
        agree = float(np.mean(np.asarray(predicted) == np.asarray(labels)))
    per_class = Counter(label_text(x.given, rows.label_names) for x in issues)
    return {
        "rows": len(labels),
        "flagged": len(issues),
        "flagged_fraction": len(issues) / max(1, len(labels)),
        "folds": cfg.audit.folds,
        "filter_by": cfg.audit.filter_by,
        "out_of_sample_agreement": agree,
        "flagged_by_given_label": dict(per_class.most_common()),
        "swaps": dict(swap_counts(issues, rows.label_names, top=10)),
        "fold_seconds": timings,
        "seconds": seconds,
        "issues_file": str(Path(cfg.run.output_dir) / ISSUES_FILE),
    }


def summary_line(summary: dict[str, Any]) -> str:
    """The audit's one-paragraph result for the terminal."""
    swaps = ", ".join(f"{k} {v}" for k, v in list(summary["swaps"].items())[:3]) or "none"
    share = 100 * summary["flagged_fraction"]
    return (
        f"audit: {summary['flagged']:,} of {summary['rows']:,} training rows ({share:.1f}%) "
        f"likely mislabelled (out-of-sample predictions agree with {100 * summary['out_of_sample_agreement']:.1f}% of "
        f"the given labels); most frequent given -> suggested: {swaps}; ranked in {summary['issues_file']} "
        f"({summary['seconds'] / 60:.1f} min)"
    )
