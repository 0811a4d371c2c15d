"""Several processes: a 2-process CPU (gloo) run equals a 1-process run with twice the micro-batch.

The 2-process run is one real `accelerate launch --multi_gpu --num_processes 2` subprocess
(ACCELERATE_USE_CPU=1), so the whole path is covered: global batches split by Accelerate, the
weight-0 fill of the short last batch, the scheduler stepping once per optimizer step, DDP's
mean, `gather_for_metrics` in evaluation and main-process-only writing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.data_loader import BatchSamplerShard
from safetensors.torch import load_file

from finetune.data import WindowedBatchSampler

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("FINETUNE_DATA_DIR", ROOT.parent / "shared" / "data"))
needs_data = pytest.mark.skipif(
    not (DATA_DIR / "sst2" / "train.tsv").is_file(), reason=f"SST-2 not found under {DATA_DIR}"
)

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


def test_sampler_under_accelerate_shards_covers_each_sample_once() -> None:
    """Every rank gets equal, full slices; weight-1 items cover the epoch exactly once."""
    lengths = [(i * 7) % 23 + 3 for i in range(90)]
    P, micro, G = 2, 4, 5
    sampler = WindowedBatchSampler(lengths, batch_size=micro * P, accumulation=G, seed=0, pad_to_multiple=P)
    shards = [list(BatchSamplerShard(sampler, num_processes=P, process_index=r, split_batches=True)) for r in range(P)]
    assert len(shards[0]) == len(shards[1]) == len(sampler) == 12
    assert all(len(b) == micro for shard in shards for b in shard)
    counted = [i for shard in shards for b in shard for (i, _, w) in b if w == 1.0]
    assert sorted(counted) == list(range(90))
    # every item of a window carries that window's real sample count (summed over ranks)
    windows = [
        sum(1 for r in range(P) for b in shards[r][w : w + G] for it in b if it[2] == 1.0) for w in range(0, 12, G)
    ]
    assert windows == [40, 40, 10]
    for r in range(P):
        for w in range(0, 12, G):
            assert {it[1] for b in shards[r][w : w + G] for it in b} == {windows[w // G]}


def _lr_rows(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["lr"]) for r in rows if "lr" in r]


def _eval_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_accuracy" in r]


@needs_data
def test_two_processes_equal_one_process_with_double_micro_batch(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "FINETUNE_DATA_DIR": str(DATA_DIR),
    }
    two = tmp_path / "two"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        str(ROOT / "finetune" / "train.py"), "--config", str(ROOT / "configs" / "tiny-debug.yaml"),
        f"run.output_dir={two}", "train.micro_batch_size=4", "checkpoint.every_steps=2", *COMMON,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
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
    for a, b in zip(e1, e2):
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
