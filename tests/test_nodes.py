"""Past one machine: launch checks, shared storage, node loss, and two "nodes" on localhost.

The multi-node launches are real: two `accelerate launch --num_machines 2 --machine_rank 0/1` processes, one
training process each, gloo over TCP on 127.0.0.1 (ACCELERATE_USE_CPU=1 ... --multi_gpu), as on two hosts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_multiprocess import _free_port

from finetune.core import faults
from finetune.core.errors import UserError
from finetune.training.runtime import check_cpu_launch, cpu_flag_lost_processes

# what `accelerate launch --cpu --num_processes 2` exported to its one child (accelerate 1.15's simple launcher)
CPU_FLAG_CHILD = {
    "ACCELERATE_USE_CPU": "True",
    "ACCELERATE_MIXED_PRECISION": "no",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_cpu_flag_with_several_processes_is_detected() -> None:
    assert cpu_flag_lost_processes(CPU_FLAG_CHILD)
    with pytest.raises(UserError, match=r"ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N"):
        check_cpu_launch(CPU_FLAG_CHILD)
    # --cpu with one process on one machine: the launcher sets no MASTER_ADDR
    assert not cpu_flag_lost_processes({k: v for k, v in CPU_FLAG_CHILD.items() if not k.startswith("MASTER_")})
    # ACCELERATE_USE_CPU=1 ... --multi_gpu: torchrun's WORLD_SIZE / RANK are there (and the user's "1")
    multi = {**CPU_FLAG_CHILD, "ACCELERATE_USE_CPU": "1", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    assert not cpu_flag_lost_processes(multi)
    # --cpu --mpirun_hostfile: MPI sets its own world size, a real multi-CPU job
    assert not cpu_flag_lost_processes({**CPU_FLAG_CHILD, "OMPI_COMM_WORLD_SIZE": "2"})
    # not launched by accelerate at all (a user's shell with MASTER_ADDR exported)
    assert not cpu_flag_lost_processes({"MASTER_ADDR": "10.0.0.1"})
    check_cpu_launch({})


# ----------------------------------------------------------------------------------------------
# Two "nodes" on localhost: two launchers, `--num_machines 2 --machine_rank 0/1`, one process each.

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-debug.yaml"
# QLoRA on the tiny architecture: each rank saves the built base to a private folder and reloads it
# quantized (the "Unrecognized model in .../finetune-base-..." of a rank other than 0, fixed in sources.py);
# 90 rows in global batches of 8 with accumulation 5: 3 optimizer steps (windows of 40, 40, 10)
QLORA = [
    "model.quantization=4bit",
    "model.lora.r=4",
    "data.max_train_samples=90",
    "data.max_eval_samples=32",
    "train.gradient_accumulation_steps=5",
    "train.log_every_steps=1",
    "train.eval_every_steps=null",
    "log.plots=false",
    "run.num_threads=1",
]


def _launch_node(machine: int, port: int, overrides: list[str], fault: str | None = None) -> subprocess.Popen:
    """One node of two: `accelerate launch --multi_gpu --num_machines 2 --machine_rank <machine>` with one
    training process, gloo over TCP to 127.0.0.1:<port> (ACCELERATE_USE_CPU=1)."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop(faults.ENV, None)
    if fault is not None:
        env[faults.ENV] = fault
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_machines",
        "2",
        "--machine_rank",
        str(machine),
        "--num_processes",
        "2",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(ROOT / "finetune" / "train.py"),
        "--config",
        str(TINY),
        *overrides,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _two_nodes(overrides: list[list[str]], fault: str | None = None, timeout: float = 240) -> list[tuple[int, str]]:
    """Both nodes to their end: [(exit code, stderr)] of node 0 and node 1."""
    port = _free_port()
    nodes = [_launch_node(m, port, overrides[m], fault) for m in (0, 1)]
    return [(p.wait(timeout=timeout), p.communicate()[1]) for p in nodes]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def _worker_codes(stderr: str) -> list[str]:
    """The exit codes the launcher's failure summary reports for its training processes."""
    return [line.split(":")[1].split()[0] for line in stderr.splitlines() if line.strip().startswith("exitcode")]


@pytest.mark.slow
@pytest.mark.usefixtures("data_dir")
def test_two_nodes_see_different_directories_one_line(tmp_path: Path) -> None:
    """run.output_dir on each node's own disk: the second node does not find the main process's marker;
    one line naming the node and the path, every training process exits 2, before any step."""
    small = ["data.max_train_samples=16", "data.max_eval_samples=8", "run.num_threads=1", "log.plots=false"]
    (n0, err0), (n1, err1) = _two_nodes([[f"run.output_dir={tmp_path / f'node{m}'}", *small] for m in (0, 1)])
    assert n0 != 0 and n1 != 0, (err0[-2000:], err1[-2000:])
    lines = _errors(err0) + _errors(err1)
    assert len(lines) == 1, (err0[-3000:], err1[-3000:])
    marker = tmp_path / "node1" / ".shared-storage-check"
    assert lines[0].startswith("error: node 1 (") and f"{marker} does not exist here" in lines[0], lines
    assert _worker_codes(err0) == ["2"] and _worker_codes(err1) == ["2"], (err0[-3000:], err1[-3000:])
    assert not (tmp_path / "node0" / "checkpoints").exists() and not (tmp_path / "node0" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("data_dir")
def test_a_lost_node_costs_one_line_and_the_run_resumes_exactly(tmp_path: Path) -> None:
    """Node 1 (its launcher and its process) is SIGKILLed after optimizer step 2, before that step's
    checkpoint: node 0 ends with one line naming rank 1, the intact checkpoint of step 1 and the resume
    command (exit 2, well within 60 s); the same two-node launch with checkpoint.resume=auto ends with the
    weights of one process at double the micro-batch (QLoRA: the merged final/ and its adapter)."""
    import time

    run = tmp_path / "run"
    shared = [f"run.output_dir={run}", "train.micro_batch_size=4", "checkpoint.every_steps=1", *QLORA]
    port = _free_port()
    nodes = [_launch_node(m, port, shared, fault="kill_node_at_step:2@1") for m in (0, 1)]
    assert nodes[1].wait(timeout=240) == -signal.SIGKILL
    killed = time.monotonic()
    code0 = nodes[0].wait(timeout=120)
    noticed = time.monotonic() - killed
    err0 = nodes[0].communicate()[1]
    nodes[1].communicate()
    lines = _errors(err0)
    assert code0 != 0 and len(lines) == 1, err0[-3000:]
    step1 = run / "checkpoints" / "step_00000001"
    assert lines[0].startswith("error: node 1 (rank 1) lost (a collective failed: "), lines
    assert f"the last intact checkpoint is {step1};" in lines[0] and lines[0].endswith("checkpoint.resume=auto")
    assert _worker_codes(err0) == ["2"], err0[-3000:]
    assert "[rank0]" not in err0, err0[-3000:]  # no traceback of the survivor
    assert noticed < 60, noticed
    print(f"node loss noticed and reported in {noticed:.1f} s: {lines[0]}")
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000001"]

    resumed = _two_nodes([[*shared, "checkpoint.resume=auto"]] * 2)
    assert [c for c, _ in resumed] == [0, 0], resumed[0][1][-3000:] + resumed[1][1][-3000:]
    assert f"resumed from {step1} at step 1" in resumed[0][1]

    from finetune.train import main

    one = tmp_path / "one"
    assert main(["--config", str(TINY), f"run.output_dir={one}", "train.micro_batch_size=8", *QLORA]) == 0
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        w1, w2 = load_file(one / "final" / name), load_file(run / "final" / name)
        assert w1.keys() == w2.keys()
        diff = max((w1[k].float() - w2[k].float()).abs().max().item() for k in w1)
        assert diff <= 1e-5, f"{name}: max abs weight difference {diff}"
    adapter = load_file(one / "final" / "adapter" / "adapter_model.safetensors")
    assert max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k) > 1e-4  # it trained


class FakeStore:
    """The few calls of torch's c10d store that the beats use, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, int | str] = {}

    def add(self, key: str, n: int) -> int:
        self.values[key] = int(self.values.get(key, 0)) + n
        return int(self.values[key])

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def set(self, key: str, value: str) -> None:
        self.values[key] = value


def test_a_silent_rank_is_lost_after_the_peer_timeout_and_a_finished_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The main process's view of the beats (ranks._watch_peers) on a clock of its own: rank 1 beats,
    rank 2 stops after its first beat, rank 3 stops but has ended normally (its "done" mark)."""
    from finetune.training import ranks

    clock = [0.0]
    monkeypatch.setattr(ranks.time, "monotonic", lambda: clock[0])
    ended: list[tuple[list[int], str]] = []
    monkeypatch.setattr(ranks, "_end_for_lost", lambda lost, how, store: ended.append((lost, how)))
    store = FakeStore()
    peers = ranks._PeerBeats(world=4, started=0.0)
    for second in range(1, 40):
        clock[0] = float(second)
        store.add(f"{ranks.BEAT_KEY}1", 1)
        if second == 1:
            store.add(f"{ranks.BEAT_KEY}2", 1)
            store.add(f"{ranks.BEAT_KEY}3", 1)
            store.set(f"{ranks.DONE_KEY}3", "1")
        ranks._watch_peers(store, 0, peers)
        if ended:
            break
    assert ended == [([2], "no heartbeat for 31 s")]  # rank 2's last beat moved at second 1
    assert clock[0] == 1 + ranks.PEER_TIMEOUT_S + 1
    assert store.values[f"{ranks.BEAT_KEY}0"] == clock[0]  # the main process beat once a second itself
    # after a failed collective: ranks whose counter does not move within the sample are the lost ones
    monkeypatch.setattr(ranks.time, "sleep", lambda s: store.add(f"{ranks.BEAT_KEY}1", 1))
    assert ranks.lost_ranks(store, 0, 3) == [2]
