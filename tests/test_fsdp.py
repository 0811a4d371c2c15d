"""FSDP2 on 2 CPU processes (gloo) through Accelerate: configs/accelerate/fsdp-cpu.yaml.

Three real `accelerate launch` subprocesses (about 12 s each here), compared with in-process
1-process runs at twice the micro-batch (the independent reference, as in test_multiprocess.py):

- full fine-tuning: stopped by SIGTERM (rank 0 only) after optimizer step 1, its checkpoint sharded
  per rank (torch.distributed.checkpoint), resumed, ends at the 1-process run's weights; final/
  loads in `pipeline`; each rank's measured peak against the planner's per-rank plan;
- LoRA with checkpoint.export=best: the best checkpoint's shards loaded back through Accelerate's
  FSDP loader, adapters merged, equal to the 1-process run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_multiprocess import COMMON as DDP_COMMON
from test_multiprocess import _free_port

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-debug.yaml"
FSDP_CPU = ROOT / "configs" / "accelerate" / "fsdp-cpu.yaml"
needs_data = pytest.mark.usefixtures("data_dir")

# test_multiprocess's 90 rows and accumulation 5 (windows of 40, 40 and 10 samples, a weight-0 fill on the last
# batch), with a checkpoint every step to resume from, and without run.overwrite (a resume keeps its directory)
COMMON = [o for o in DDP_COMMON if o != "run.overwrite=true"] + ["checkpoint.every_steps=1"]
LORA = ["model.lora.r=4", "checkpoint.export=best"]


def _launch_fsdp(overrides: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file configs/accelerate/fsdp-cpu.yaml` (2 processes) of finetune/train.py."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("FINETUNE_TEST_ONLY_FAULTS", None)
    if fault is not None:
        env["FINETUNE_TEST_ONLY_FAULTS"] = fault
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(FSDP_CPU),
        "--main_process_port",
        str(_free_port()),
        str(ROOT / "finetune" / "train.py"),
        "--config",
        str(TINY),
        *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _one_process(run: Path, extra: list[str]) -> None:
    from finetune.train import main

    assert main(["--config", str(TINY), f"run.output_dir={run}", "train.micro_batch_size=8", *COMMON, *extra]) == 0


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The FSDP launches and their 1-process references."""
    from conftest import require_data

    require_data()
    d = tmp_path_factory.mktemp("fsdp")
    full = [f"run.output_dir={d / 'full2'}", "train.micro_batch_size=4", *COMMON]
    stopped = _launch_fsdp(full, fault="sigterm_at_step:1@0")
    first_ckpt = sorted((d / "full2" / "checkpoints").glob("step_*"))
    # each rank's shard of the parameters and of the optimizer state (before rotation removes step 1)
    shards = {
        part: sorted(p.name for p in (d / "full2" / "checkpoints" / "step_00000001" / part).glob("*.distcp"))
        for part in ("pytorch_model_fsdp_0", "optimizer_0")
    }
    resumed = _launch_fsdp([*full, "checkpoint.resume=auto"])
    lora = _launch_fsdp([f"run.output_dir={d / 'lora2'}", "train.micro_batch_size=4", *COMMON, *LORA])
    _one_process(d / "full1", [])
    _one_process(d / "lora1", LORA)
    return {"dir": d, "stopped": stopped, "first_ckpt": first_ckpt, "shards": shards, "resumed": resumed, "lora": lora}


@pytest.mark.slow
@needs_data
def test_fsdp_sigterm_resume_equals_one_process(runs: dict) -> None:
    """SIGTERM to rank 0 after step 1: both ranks stop at the step with one sharded checkpoint; the resumed
    run ends at the weights of 1 process with the double micro-batch; final/ loads in `pipeline`."""
    d, stopped, resumed = runs["dir"], runs["stopped"], runs["resumed"]
    assert stopped.returncode != 0 and "SIGTERM received" in stopped.stderr, stopped.stderr[-3000:]
    assert [p.name for p in runs["first_ckpt"]] == ["step_00000001"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "2 process(es) x micro-batch 4 x accumulation 5 = effective batch 40" in resumed.stderr
    assert "resumed from" in resumed.stderr and "step_00000001 at step 1" in resumed.stderr

    # the checkpoint holds each rank's shard of the parameters and of the optimizer state
    for part, files in runs["shards"].items():
        assert files == ["__0_0.distcp", "__1_0.distcp"], part

    w1 = load_file(d / "full1" / "final" / "model.safetensors")
    w2 = load_file(d / "full2" / "final" / "model.safetensors")
    diff = _max_diff(w1, w2)
    assert diff <= 1e-5, f"max abs weight difference {diff}"
    rows = [json.loads(x) for x in (d / "full2" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(losses) == 3 and losses[0] != pytest.approx(losses[-1], abs=1e-5)  # training moved the model

    e1 = json.loads((d / "full1" / "eval.json").read_text())
    e2 = json.loads((d / "full2" / "eval.json").read_text())
    assert e1["num_samples"] == e2["num_samples"] == 100
    assert e1["confusion_matrix"] == e2["confusion_matrix"] and e1["loss"] == pytest.approx(e2["loss"], abs=1e-5)

    from transformers import pipeline

    texts = ["a gem of a film", "dull and far too long"]
    out1 = pipeline("text-classification", model=str(d / "full1" / "final"), top_k=None)(texts)
    out2 = pipeline("text-classification", model=str(d / "full2" / "final"), top_k=None)(texts)
    for a, b in zip(out1, out2, strict=True):
        assert {r["label"] for r in a} == {"negative", "positive"}
        assert {r["label"]: r["score"] for r in a} == pytest.approx({r["label"]: r["score"] for r in b}, abs=1e-5)


@pytest.mark.slow
@needs_data
def test_fsdp_lora_export_best_equals_one_process(runs: dict) -> None:
    """LoRA under FSDP (frozen base sharded with the adapters), final/ from the best checkpoint's shards."""
    d, lora = runs["dir"], runs["lora"]
    assert lora.returncode == 0, lora.stderr[-3000:]
    assert "final/ holds the best checkpoint by accuracy" in lora.stderr
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        w1, w2 = load_file(d / "lora1" / "final" / name), load_file(d / "lora2" / "final" / name)
        diff = _max_diff(w1, w2)
        assert diff <= 1e-5, f"{name}: max abs weight difference {diff}"
    adapters = load_file(d / "lora2" / "final" / "adapter" / "adapter_model.safetensors")
    assert max(v.abs().max().item() for k, v in adapters.items() if "lora_B" in k) > 1e-4  # lora_B starts at 0
    j1 = json.loads((d / "lora1" / "eval.json").read_text())
    j2 = json.loads((d / "lora2" / "eval.json").read_text())
    assert j1["step"] == j2["step"] and j1["exported"] == j2["exported"] == "best"


@pytest.mark.slow
@needs_data
def test_fsdp_planner_per_rank_against_each_rank_measured(runs: dict) -> None:
    """Each rank's measured peak (MemTracker in the run, memory.json `ranks`) against `plan(..., shards=2)`:
    parameters, gradients and optimizer state halved, plus the largest unit gathered whole."""
    from finetune.config.files import load_config
    from finetune.memory.planner import plan

    d = runs["dir"]
    one = json.loads((d / "full1" / "memory.json").read_text())
    for run, extra in (("full2", []), ("lora2", LORA)):
        report = json.loads((d / run / "memory.json").read_text())
        measured = report["ranks"]
        assert len(measured) == 2
        # the plan pads every row to data.max_length: plan at the sampled window's longest batch instead
        longest = max(length for _, length in report["sampled_batches"])
        cfg = load_config(
            TINY,
            [f"run.output_dir={d / 'plan'}", "train.micro_batch_size=4", f"data.max_length={longest}", *COMMON, *extra],
        )
        row = plan(cfg, "cpu", None, [4], num_processes=2, shards=2).rows[0]
        for rank in measured:
            error = rank["peak_bytes"] / row.peak_bytes - 1
            assert abs(error) <= 0.05, f"{run}: measured {rank['peak_bytes']:,} vs planned {row.peak_bytes:,}"
            print(f"{run}: measured {rank['peak_bytes']:,} B, planned {row.peak_bytes:,} B ({error:+.1%})")
        if run == "full2":  # every rank holds half of the parameters and of the AdamW state of one process
            for rank in measured:
                assert rank["optimizer_state_bytes"] == pytest.approx(one["optimizer_state_bytes"] / 2, rel=0.01)
                assert rank["parameters_bytes"] == pytest.approx(one["parameters_bytes"] / 2, rel=0.01)
            gathered = row.categories["temporaries"] - plan(cfg, "cpu", None, [4]).rows[0].categories["temporaries"]
            # without the gathered unit the plan would fall far short of what each rank measured
            assert min(r["peak_bytes"] for r in measured) > 1.3 * (row.peak_bytes - gathered)


def _fsdp_accelerator(state_dict_type: str = "SHARDED_STATE_DICT") -> SimpleNamespace:
    from accelerate.utils import DistributedType

    plugin = SimpleNamespace(state_dict_type=state_dict_type)
    return SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin))


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"precision.mode": "bf16-true"}, ["precision.mode=bf16-true with fp32 norms", "FSDP"]),
        ({"model.lora": {"r": 4}, "model.quantization": "4bit"}, ["model.quantization=4bit (QLoRA)", "FSDP"]),
    ],
)
def test_fsdp_refuses_what_cannot_shard(tmp_path: Path, overrides: dict, words: list[str]) -> None:
    from conftest import write_tiny_config

    from finetune.config.files import load_config
    from finetune.core.errors import UserError
    from finetune.training.runtime import check_fsdp

    cfg = load_config(write_tiny_config(tmp_path, overrides))
    with pytest.raises(UserError) as info:
        check_fsdp(cfg, _fsdp_accelerator())
    assert all(w in str(info.value) for w in words) and "\n" not in str(info.value)
    check_fsdp(
        load_config(write_tiny_config(tmp_path, {"precision.mode": "bf16-true", "precision.fp32_norms": False})),
        _fsdp_accelerator(),
    )  # uniform bf16 blocks shard (it ran here)


def test_resume_refuses_a_checkpoint_of_another_layout(tmp_path: Path) -> None:
    from accelerate.utils import DistributedType

    from finetune.core.errors import UserError
    from finetune.training.checkpoint import check_state_layout

    whole, sharded, full = tmp_path / "whole", tmp_path / "sharded", tmp_path / "full"
    (sharded / "pytorch_model_fsdp_0").mkdir(parents=True)
    full.mkdir()
    (full / "pytorch_model_fsdp.bin").write_bytes(b"")
    whole.mkdir()
    ddp = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    check_state_layout(whole, ddp)
    check_state_layout(sharded, _fsdp_accelerator())
    check_state_layout(full, _fsdp_accelerator("StateDictType.FULL_STATE_DICT"))
    refused = [
        (sharded, ddp, "holds the FSDP sharded state dict, but this launch reads the whole model"),
        (
            whole,
            _fsdp_accelerator(),
            r"holds the whole model \(one process or DDP\), but this launch "
            "reads the FSDP sharded state dict",
        ),
        (full, _fsdp_accelerator(), "holds the FSDP full state dict"),
    ]
    for path, acc, said in refused:
        with pytest.raises(UserError, match=said):
            check_state_layout(path, acc)
