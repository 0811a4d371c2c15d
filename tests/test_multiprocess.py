"""Several processes: a 2-process CPU (gloo) run equals a 1-process run with twice the micro-batch.

The 2-process run is one real `accelerate launch --multi_gpu --num_processes 2` subprocess
(ACCELERATE_USE_CPU=1), so the whole path is covered: global batches split by Accelerate, the
weight-0 fill of the short last batch, the scheduler stepping once per optimizer step, DDP's
mean, `gather_for_metrics` in evaluation and main-process-only writing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from finetune.data.window import WindowedBatchSampler

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("FINETUNE_DATA_DIR", ROOT.parent / "shared" / "data"))
needs_data = pytest.mark.usefixtures("data_dir")  # conftest: a skip locally, a failure under CI=true

# 90 rows in global batches of 8: 12 batches, the last with 2 rows; accumulation 5 makes the
# windows 5, 5, 2 batches (40, 40, 10 samples). 100 eval rows in global batches of 16 leave a
# remainder of 4 that Accelerate refills on the last batch (even_batches).
COMMON = [
    "data.max_train_samples=90",
    "data.max_eval_samples=100",
    "train.gradient_accumulation_steps=5",
    "train.log_every_steps=1",
    "train.eval_every_steps=1",
    "train.epochs=1",
    "run.overwrite=true",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two(config: Path, overrides: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes 2` of finetune/train.py on CPU (gloo), with a
    test-only `fault` (finetune/core/faults.py) when given."""
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "FINETUNE_DATA_DIR": str(DATA_DIR),
    }
    env.pop("FINETUNE_TEST_ONLY_FAULTS", None)  # an in-process run's fault injection stays in-process
    if fault is not None:
        env["FINETUNE_TEST_ONLY_FAULTS"] = fault
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        str(ROOT / "finetune" / "train.py"),
        "--config",
        str(config),
        *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _lr_rows(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["lr"]) for r in rows if "lr" in r]


def _eval_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_accuracy" in r]


@pytest.mark.slow
@needs_data
def test_two_processes_equal_one_process_with_double_micro_batch(tmp_path: Path) -> None:
    two = tmp_path / "two"
    proc = _launch_two(
        ROOT / "configs" / "tiny-debug.yaml",
        [f"run.output_dir={two}", "train.micro_batch_size=4", "checkpoint.every_steps=2", *COMMON],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es) x micro-batch 4" in proc.stderr

    from finetune.train import main

    one = tmp_path / "one"
    assert (
        main(
            [
                "--config",
                str(ROOT / "configs" / "tiny-debug.yaml"),
                f"run.output_dir={one}",
                "train.micro_batch_size=8",
                *COMMON,
            ]
        )
        == 0
    )

    # same weights
    w1 = load_file(one / "final" / "model.safetensors")
    w2 = load_file(two / "final" / "model.safetensors")
    assert w1.keys() == w2.keys()
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert diff <= 1e-5, f"max abs weight difference {diff}"

    # identical learning-rate schedule, one row per optimizer step (3 windows)
    lr1, lr2 = _lr_rows(one), _lr_rows(two)
    assert [s for s, _ in lr1] == [1, 2, 3]
    assert [s for s, _ in lr2] == [1, 2, 3]
    assert [lr for _, lr in lr1] == pytest.approx([lr for _, lr in lr2], rel=1e-9)
    assert lr1[0][1] > lr1[1][1] > lr1[2][1]  # linear decay, one scheduler step per optimizer step

    # evaluation: every eval row and eval.json agree (no sample counted twice)
    e1, e2 = _eval_rows(one), _eval_rows(two)
    assert len(e1) == len(e2) == 3
    for a, b in zip(e1, e2, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    # training moved the model (two runs that do nothing would also agree)
    assert e1[0]["eval_loss"] != pytest.approx(e1[-1]["eval_loss"], abs=1e-4)
    j1 = json.loads((one / "eval.json").read_text())
    j2 = json.loads((two / "eval.json").read_text())
    assert j1["num_samples"] == j2["num_samples"] == 100
    assert j1["confusion_matrix"] == j2["confusion_matrix"]
    assert j1["accuracy"] == j2["accuracy"] and j1["macro_f1"] == j2["macro_f1"]
    assert j1["loss"] == pytest.approx(j2["loss"], abs=1e-5)

    # the mid-run checkpoint holds every rank's RNG state (save_state on all ranks, one rename)
    ckpts = sorted((two / "checkpoints").glob("step_*"))
    assert ckpts, "no checkpoint written"
    for c in ckpts:
        assert sorted(p.name for p in c.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]
    assert not [p for p in two.rglob("*") if p.name.startswith(".tmp")]

    # only the main process wrote logs: one row per step, not one per rank
    assert len((two / "metrics.jsonl").read_text().splitlines()) == len(
        (one / "metrics.jsonl").read_text().splitlines()
    )


@pytest.mark.slow
@needs_data
def test_a_full_disk_on_one_rank_ends_every_rank_with_one_line(tmp_path: Path) -> None:
    """The disk fills on rank 1 while rank 0 saves its share of the same checkpoint: every rank ends with
    exit code 2 and the job prints one line. Before, rank 1 removed the temporary under rank 0, which
    failed with a traceback of its own (exit 1); an out-of-memory error on one rank left the other in
    DDP's all-reduce until gloo broke the connection (a traceback) or the launcher killed it (SIGTERM)."""
    import time

    run = tmp_path / "run"
    started = time.monotonic()
    proc = _launch_two(
        ROOT / "configs" / "tiny-debug.yaml",
        [
            f"run.output_dir={run}",
            "train.micro_batch_size=4",
            "train.gradient_accumulation_steps=1",
            "data.max_train_samples=16",
            "data.max_eval_samples=8",
            "train.eval_every_steps=null",
            "checkpoint.every_steps=1",
        ],
        fault="disk_full_in_save:1@1",
    )
    elapsed = time.monotonic() - started
    assert proc.returncode != 0, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: the disk is full"), proc.stderr[-3000:]
    assert "[rank0]" not in proc.stderr and "[rank1]" not in proc.stderr, proc.stderr[-3000:]  # no rank's traceback
    # the launcher's summary: both ranks exited by themselves, with the error's code (not -15: killed)
    codes = [line.split(":")[1].split()[0] for line in proc.stderr.splitlines() if line.strip().startswith("exitcode")]
    assert codes == ["2", "2"], proc.stderr[-3000:]
    assert elapsed < 120, elapsed  # start-up included; the launcher's kill after SIGTERM alone waits 30 s
    assert not (run / "checkpoints" / "step_00000001").exists()


@needs_data
def test_launch_config_accumulation_must_match_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`accelerate launch` with a DeepSpeed config exports its accumulation count; a mismatch is refused."""
    from finetune.train import main

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    rc = main(
        [
            "--config",
            str(ROOT / "configs" / "tiny-debug.yaml"),
            f"run.output_dir={tmp_path / 'r'}",
            "train.gradient_accumulation_steps=2",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "gradient accumulation to 3" in err and "train.gradient_accumulation_steps is 2" in err
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------------------------
# Exact accumulation against a plain-torch full-batch reference, export=best and resume across
# process counts. One tiny config (SGD without momentum, decay or clipping, constant learning rate)
# makes every optimizer step w <- w - lr * (mean gradient over the window's samples), so the
# trained weights can be computed independently: known initial weights (saved here), the epoch's
# windows, one full-batch gradient per window.

LR = 2.0  # large: the updates dwarf float rounding, so a wrong gradient scale shows plainly
EFFECTIVE, ACCUMULATION, TRAIN_ROWS = 40, 5, 90  # windows of 40, 40, 10 samples
SGD = {
    "train.optimizer": "sgd",
    "train.momentum": 0.0,
    "train.weight_decay": 0.0,
    "train.max_grad_norm": None,
    "train.lr_scheduler": "constant",
    "train.warmup_ratio": 0.0,
    "train.learning_rate": LR,
    "train.epochs": 1,
    # the effective batch only: the micro-batch follows the process count (8 on one, 4 on two)
    "train.batch_size": EFFECTIVE,
    "train.micro_batch_size": ...,
    "train.gradient_accumulation_steps": ACCUMULATION,
    "train.log_every_steps": 1,
    "data.max_train_samples": TRAIN_ROWS,
    "data.max_eval_samples": 100,
}


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors with DDP's / compile's wrapper prefixes removed."""
    out = {}
    for k, v in load_file(path).items():
        for prefix in ("module.", "_orig_mod."):
            k = k.removeprefix(prefix)
        out[k] = v
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@dataclasses.dataclass
class SgdSetup:
    config: Path  # model.name_or_path = the saved initial weights
    init: dict[str, torch.Tensor]
    steps: list[dict[str, torch.Tensor]]  # reference weights after optimizer step 1, 2, 3
    windows: list[int]  # samples per window
    # reference(scale): the reference steps with each window's gradient times scale(window size)
    reference: Callable[[Callable[[int], float]], list[dict[str, torch.Tensor]]]

    def tolerance(self) -> float:
        """Allowed max abs difference: 1e-4 of the largest total update (float rounding measured ~1e-7 of it)."""
        return 1e-4 * _max_diff(self.steps[-1], self.init)


def _reference_steps(
    init_dir: Path, train: Any, seed: int, group_by_length: bool, P: int, scale: Callable[[int], float]
) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """Plain torch: the epoch's windows (as the training sampler forms them for P processes), one
    full-batch mean cross-entropy per window (times `scale(window size)`), w <- w - LR * grad."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(init_dir), dtype=torch.float32)
    model.train()  # dropout is 0 in tiny-debug
    micro = EFFECTIVE // ACCUMULATION // P
    sampler = WindowedBatchSampler(
        train["length"][:],
        batch_size=micro * P,
        accumulation=ACCUMULATION,
        seed=seed,
        group_by_length=group_by_length,
        pad_to_multiple=P,
    )
    sampler.set_epoch(0)
    batches = list(sampler)
    pad_id = model.config.pad_token_id or 0
    steps, sizes = [], []
    for w in range(0, len(batches), ACCUMULATION):
        idx = [i for b in batches[w : w + ACCUMULATION] for (i, _, weight) in b if weight == 1.0]
        rows = [train[i] for i in idx]
        L = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
        types = torch.zeros((len(rows), L), dtype=torch.long)
        mask = torch.zeros((len(rows), L), dtype=torch.long)
        for j, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[j, :n], types[j, :n], mask[j, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["token_type_ids"]), 1
        labels = torch.tensor([r["labels"] for r in rows])
        logits = model(input_ids=ids, token_type_ids=types, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.float(), labels) * scale(len(rows))
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
        steps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        sizes.append(len(rows))
    return steps, sizes


@pytest.fixture(scope="module")
def sgd_setup(tmp_path_factory: pytest.TempPathFactory) -> SgdSetup:
    """Initial weights saved to disk, a config starting from them, and the plain-torch reference."""
    from conftest import require_data, write_tiny_config

    require_data()

    from finetune.config.files import load_config
    from finetune.data.build import build_data
    from finetune.model.load import build_model, build_tokenizer

    d = tmp_path_factory.mktemp("sgd")
    scratch = load_config(write_tiny_config(d, SGD, name="scratch.yaml"))
    tokenizer = build_tokenizer(scratch)
    torch.manual_seed(1234)
    model = build_model(scratch, ["negative", "positive"], tokenizer)
    init_dir = d / "init"
    model.save_pretrained(init_dir)
    tokenizer.save_pretrained(init_dir)
    config = write_tiny_config(
        d, {**SGD, "model.name_or_path": str(init_dir), "model.architecture": None, "model.tokenizer": None}
    )
    cfg = load_config(config)
    data = build_data(cfg, build_tokenizer(cfg))  # tokenized as the runs tokenize (tokenizer from init_dir)
    assert len(data.train) == TRAIN_ROWS

    def reference(scale: Callable[[int], float] = lambda n: 1.0) -> list[dict[str, torch.Tensor]]:
        return _reference_steps(init_dir, data.train, cfg.run.seed, cfg.data.group_by_length, 2, scale)[0]

    steps, sizes = _reference_steps(init_dir, data.train, cfg.run.seed, cfg.data.group_by_length, 2, lambda n: 1.0)
    assert sizes == [40, 40, 10]
    # one process forms the same windows (what resuming across process counts relies on)
    assert (
        _max_diff(
            _reference_steps(init_dir, data.train, cfg.run.seed, cfg.data.group_by_length, 1, lambda n: 1.0)[0][-1],
            steps[-1],
        )
        <= 1e-6
    )
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return SgdSetup(config, init, steps, sizes, reference)


@pytest.fixture(scope="module")
def sgd_two_process_run(sgd_setup: SgdSetup, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One run over two launches: 1 process (micro-batch 8) stopped by SIGTERM after step 1, resumed
    on 2 processes (micro-batch 4) for steps 2 and 3; a checkpoint and an evaluation every step,
    export=best. Returns the run directory and the 2-process launch's stderr."""
    from finetune.core import faults
    from finetune.train import main

    run = tmp_path_factory.mktemp("sgd_two") / "run"
    overrides = [
        f"run.output_dir={run}",
        "checkpoint.every_steps=1",
        "checkpoint.export=best",
        "train.eval_every_steps=1",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FINETUNE_DATA_DIR", str(DATA_DIR))
        mp.setenv(faults.ENV, "sigterm_at_step:1")
        assert main(["--config", str(sgd_setup.config), *overrides]) == 143
    proc = _launch_two(sgd_setup.config, [*overrides, "checkpoint.resume=auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stderr


@pytest.mark.slow
@needs_data
def test_two_process_accumulation_equals_full_batch_gradient(
    sgd_setup: SgdSetup, sgd_two_process_run: tuple[Path, str]
) -> None:
    """Every optimizer step equals plain SGD on the window's full-batch mean gradient: step 1 on one
    process, steps 2 and 3 on two, the short tail window (10 samples, weight-0 fill on the second
    process) included."""
    run, log = sgd_two_process_run
    assert "2 process(es) x micro-batch 4 x accumulation 5 = effective batch 40" in log
    tol = sgd_setup.tolerance()
    ref = sgd_setup.steps
    # checkpoints that survived rotation (keep_last 2 and the best), the last one included
    ckpts = {int(p.name.removeprefix("step_")): p for p in (run / "checkpoints").glob("step_*")}
    assert 3 in ckpts and 2 in ckpts  # written by the 2-process launch
    for step, path in ckpts.items():
        diff = _max_diff(_weights(path / "model.safetensors"), ref[step - 1])
        assert diff <= tol, f"step {step}: max abs weight difference {diff} > {tol}"
    # the run trained (the tolerance is relative to the reference's update: that update is real)
    assert _max_diff(_weights(ckpts[3] / "model.safetensors"), sgd_setup.init) > 0.05

    # the tolerance catches a wrong gradient scale: a missing or doubled factor of the process
    # count, a missing factor of the accumulation count, or the naive per-micro-batch mean (which
    # divides the short window's 10 samples by the nominal 40)
    wrong = {
        "x1/2 (missing process factor)": lambda n: 0.5,
        "x2 (doubled process factor)": lambda n: 2.0,
        "x1/5 (missing accumulation factor)": lambda n: 1 / ACCUMULATION,
        "naive per-micro-batch mean": lambda n: n / EFFECTIVE,
    }
    last = _weights(ckpts[3] / "model.safetensors")
    for name, scale in wrong.items():
        diff = _max_diff(last, sgd_setup.reference(scale)[-1])
        assert diff > 100 * tol, f"a {name} gradient would pass unnoticed ({diff} vs tolerance {tol})"


@pytest.mark.slow
@needs_data
def test_export_best_under_ddp(sgd_setup: SgdSetup, sgd_two_process_run: tuple[Path, str]) -> None:
    """checkpoint.export=best with 2 processes (it crashed: safetensors refused the gloo run's device
    "cpu:0"): final/ holds the best checkpoint's weights, whatever wrapper prefix its keys carry, and
    eval.json names its step."""
    run, log = sgd_two_process_run
    from finetune.training import checkpoint as ckpt

    best = ckpt.best_checkpoint(run, "accuracy")
    assert best is not None
    best_step = ckpt.read_progress(best).step
    final = _weights(run / "final" / "model.safetensors")
    assert _max_diff(final, _weights(best / "model.safetensors")) == 0.0
    assert _max_diff(final, sgd_setup.steps[best_step - 1]) <= sgd_setup.tolerance()
    # this run's best is not its last step, so final/ differs from the last weights
    assert best_step < 3, f"the learning rate no longer makes an earlier step best (best: step {best_step})"
    assert _max_diff(final, sgd_setup.steps[-1]) > 100 * sgd_setup.tolerance()
    j = json.loads((run / "eval.json").read_text())
    assert j["exported"] == "best" and j["step"] == best_step
    assert f"final/ holds the best checkpoint by accuracy: {best.name}" in log
    # eval.json describes final/'s weights: the best checkpoint's own evaluation
    own = json.loads((best / "eval.json").read_text())
    assert j["accuracy"] == own["accuracy"] and j["loss"] == pytest.approx(own["loss"], abs=1e-6)


@pytest.mark.slow
@needs_data
def test_resume_one_process_checkpoint_on_two_processes(
    sgd_setup: SgdSetup, sgd_two_process_run: tuple[Path, str]
) -> None:
    """train.batch_size fixes the effective batch: the 1-process run (micro-batch 8) stopped after
    step 1 resumed on 2 processes (micro-batch 4) and ended where the plain-torch reference ends."""
    run, log = sgd_two_process_run
    first = run / "checkpoints" / "step_00000001"
    assert "1 process(es) x micro-batch 8 x accumulation 5 = effective batch 40" in (run / "train.log").read_text()
    assert f"resumed from {first} at step 1" in log
    converted = "resuming a run of 1 process(es) x micro-batch 8 x accumulation 5 with 2 process(es) x micro-batch 4"
    assert converted in log
    last = _weights(run / "checkpoints" / "step_00000003" / "model.safetensors")
    diff = _max_diff(last, sgd_setup.steps[-1])
    assert diff <= sgd_setup.tolerance(), f"max abs weight difference {diff}"


@pytest.mark.slow
@needs_data
def test_time_budget_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    """train.max_minutes under 2 processes: only rank 0's clock runs fast (the test-only clock, 30 s a step), so
    rank 0 alone finds the budget spent at step 3; the per-step stop agreement carries its decision, and both
    ranks end there with the best checkpoint as final/ (a rank that went on alone would wait in DDP's
    all-reduce for ever)."""
    run = tmp_path / "run"
    proc = _launch_two(
        ROOT / "configs" / "tiny-debug.yaml",
        [
            f"run.output_dir={run}",
            "train.micro_batch_size=4",
            "train.gradient_accumulation_steps=1",
            "data.max_train_samples=64",
            "data.max_eval_samples=32",
            "train.eval_every_steps=1",
            "checkpoint.every_steps=1",
            "checkpoint.export=best",
            "train.max_minutes=1.5",
        ],
        fault="clock_step_seconds:30@0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("time budget of 1.5 minutes (train.max_minutes) spent at step 3") == 1, proc.stderr[-3000:]
    from finetune.training import checkpoint as ckpt

    last = ckpt.newest_valid_checkpoint(run)
    progress = ckpt.read_progress(last)
    assert (progress.step, progress.finished, progress.seconds_trained) == (3, True, 90.0)
    # every rank saved the step-3 state: both reached it, and neither trained past it
    assert sorted(p.name for p in last.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 3
    assert json.loads((run / "eval.json").read_text())["exported"] == "best"
