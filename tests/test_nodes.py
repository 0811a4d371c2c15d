"""Past one machine (issue 44): launch checks, shared storage, node loss, and two "nodes" on localhost.

The multi-node launches are real: two `accelerate launch --num_machines 2 --machine_rank 0/1` processes, one
training process each, gloo over TCP on 127.0.0.1 (ACCELERATE_USE_CPU=1 ... --multi_gpu), as on two hosts.
"""

from __future__ import annotations

import pytest

from finetune.errors import UserError
from finetune.runtime import check_cpu_launch, cpu_flag_lost_processes

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
