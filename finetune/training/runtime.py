"""Runtime concerns of a training process: the Accelerator, threads, determinism, logging,
signals and preemption, and the error for running out of memory inside the optimizer step (a window's
out-of-memory retry is `finetune.data.window.OutOfMemoryGuard`).

Exit codes after a preemption checkpoint: 143 (SIGTERM) and 130 (SIGINT), see docs/RESUME.md.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import accelerate
import datasets
import torch
import transformers
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState
from accelerate.utils import InitProcessGroupKwargs
from tqdm import tqdm as plain_tqdm
from tqdm.auto import tqdm

from finetune.config.schema import Config
from finetune.core.errors import UserError
from finetune.model.precision import accelerate_mixed_precision, check_supported, fp32_norms_enabled
from finetune.training.ranks import COLLECTIVE_TIMEOUT_S, watch_other_ranks
from finetune.training.trackers import reach_trackers

logger = logging.getLogger("finetune")
# train.log only: the terminal already shows these in the progress bar, a log file has no bar to show them
progress_log = logging.getLogger("finetune.progress")

# the parent when this module was imported: a launcher that is PID 1 itself (a container's entrypoint)
# is a live parent, so "reparented" means "parent changed", not "parent is 1"
_PARENT_AT_START = os.getppid()
EXIT_CODES = {"SIGTERM": 143, "SIGINT": 130}  # 128 + signal number, as a shell reports a killed job
DYNAMO_ENV = "ACCELERATE_DYNAMO_BACKEND"  # set by `accelerate launch` from an `accelerate config` with dynamo


# ----------------------------------------------------------------------------------------------
# Process set-up.


def check_launch_dynamo(cfg: Config) -> None:
    """Refuse a launch config that asks Accelerate to compile while `model.compile` is off.

    Accelerate would wrap the model in a second compile of its own (a module compiled in place is
    no `OptimizedModule`); finetune always passes `dynamo_backend="no"` and compiles in
    `model.compile` only.

    Raises:
        UserError: ACCELERATE_DYNAMO_BACKEND asks for a backend and `model.compile` is false.
    """
    backend = os.environ.get(DYNAMO_ENV, "no")
    if backend.lower() in ("no", ""):
        return
    if not cfg.model.compile:
        raise UserError(
            f"the Accelerate launch config asks for torch.compile ({DYNAMO_ENV}={backend}) but model.compile is false; "
            "finetune compiles the model itself: set model.compile=true (and model.compile_backend), "
            "or remove dynamo from the Accelerate config"
        )
    logger.info(f"{DYNAMO_ENV}={backend} ignored: the model is compiled once, by model.compile")


# log.trackers -> what to pip install (Accelerate checks for the import name; aim 4 is not supported by it)
TRACKER_PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "trackio": "trackio",
    "mlflow": "mlflow",
    "comet_ml": "comet-ml",
    "aim": "'aim<4'",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
}
# the keyword each tracker's init takes for a run's name (Accelerate names the project "finetune")
TRACKER_RUN_NAME = {"wandb": "name", "trackio": "name", "mlflow": "run_name", "swanlab": "experiment_name"}


def check_trackers(trackers: list[str]) -> None:
    """Refuse a tracker whose package is missing: Accelerate would leave it out without a word.

    Raises:
        UserError: a tracker's package cannot be imported.
    """
    from accelerate.utils import imports

    for name in trackers:
        if not getattr(imports, f"is_{name}_available")():
            package = TRACKER_PACKAGES[name]
            raise UserError(
                f"log.trackers: {name} needs the package {package}, which is not installed: "
                f"pip install {package} (or remove {name} from log.trackers)"
            )


def tracker_init_kwargs(trackers: list[str], run_dir: Path) -> dict[str, dict[str, str]]:
    """Accelerate's `init_kwargs`: each tracker's run named after the run directory."""
    return {t: {TRACKER_RUN_NAME[t]: run_dir.name} for t in trackers if t in TRACKER_RUN_NAME}


# set in a process by MPI launchers (`accelerate launch --cpu --mpirun_hostfile`): a real multi-CPU job
MPI_SIZE_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def cpu_flag_lost_processes(env: Mapping[str, str]) -> bool:
    """Whether this process comes from `accelerate launch --cpu` asked for several processes or machines.

    `--cpu` takes Accelerate's one-process launcher whatever `--num_processes` / `--num_machines` say: it
    exports ACCELERATE_USE_CPU="True" and, for more than one process or machine, MASTER_ADDR and
    MASTER_PORT, but no WORLD_SIZE or RANK (torchrun sets those), so every process trains alone.
    """
    launched = "ACCELERATE_MIXED_PRECISION" in env and env.get("ACCELERATE_USE_CPU") == "True"
    distributed = any(k in env for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", *MPI_SIZE_ENV))
    return launched and "MASTER_ADDR" in env and not distributed


def check_cpu_launch(env: Mapping[str, str]) -> None:
    """Refuse `accelerate launch --cpu` with several processes or machines (each would train alone).

    Raises:
        UserError: the launch went through `--cpu` with `--num_processes` or `--num_machines` above 1.
    """
    if cpu_flag_lost_processes(env):
        raise UserError(
            "accelerate launch --cpu starts one process per machine, without distribution (--num_processes and "
            "--num_machines are not used with it): for several CPU processes or machines use "
            "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N [--num_machines M --machine_rank R "
            "--main_process_ip IP --main_process_port PORT] finetune/train.py ... (docs/SCALING.md)"
        )


def build_accelerator(cfg: Config) -> Accelerator:
    """Accelerator with mixed precision, gradient accumulation and global (split) batches; with several
    processes, this process ends as soon as another reports a failure (`watch_other_ranks`).

    Raises:
        UserError: the launch config contradicts the run config (accumulation, dynamo), the
            precision mode is not supported on this device, a tracker's package is missing, a
            launch of several processes reached Accelerate as one, FSDP was asked for with a
            setting it cannot run (`check_fsdp`), a tracker's server cannot be reached, or `--cpu`
            was given with several processes (`check_cpu_launch`).
    """
    check_launch_dynamo(cfg)
    check_cpu_launch(os.environ)
    check_trackers(cfg.log.trackers)
    # Accelerate keeps the mixed-precision state of a process's first Accelerator; a second run in
    # the same process (a test, a notebook, a sweep trial) with another precision needs a fresh one.
    # The process group (PartialState) is kept.
    AcceleratorState._reset_state()
    accelerator = Accelerator(
        mixed_precision=accelerate_mixed_precision(cfg.precision.mode),
        gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
        # batches are global (micro-batch x processes) and split across ranks: the scheduler
        # then steps once per optimizer step and every rank sees its slice of the same batch
        # (the sampler's half of this is finetune.data.window.WindowedBatchSampler)
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        dynamo_backend="no",
        log_with=list(cfg.log.trackers) or None,
        project_dir=cfg.run.output_dir,
        # one timeout for gloo and NCCL; a lost node is noticed by its beats (`watch_other_ranks`) long before
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))],
    )
    check_supported(cfg.precision.mode, accelerator.device)
    if accelerator.is_main_process:  # trackers log from the main process only
        reach_trackers(cfg.log.trackers)
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1 and accelerator.num_processes == 1:
        # seen on a CPU-only machine: a launch without ACCELERATE_USE_CPU=1, and DeepSpeed's CPU accelerator
        raise UserError(
            f"launched as {world} processes, but Accelerate sees 1 ({accelerator.distributed_type}): each would train "
            "alone into the same run directory; on a CPU-only machine set ACCELERATE_USE_CPU=1 (DDP or FSDP; "
            "DeepSpeed does not run on CPU here, docs/SCALING.md)"
        )
    enable_fsdp_on_cpu(accelerator)
    check_fsdp(cfg, accelerator)
    watch_other_ranks()
    if accelerator.gradient_accumulation_steps != cfg.train.gradient_accumulation_steps:
        # ACCELERATE_GRADIENT_ACCUMULATION_STEPS (set by `accelerate launch` from a DeepSpeed
        # config) overrides the argument; the sampler's windows and the loss scale use the config's
        raise UserError(
            f"the Accelerate launch config sets gradient accumulation to {accelerator.gradient_accumulation_steps} "
            f"but train.gradient_accumulation_steps is {cfg.train.gradient_accumulation_steps}; set it in one place "
            "(remove gradient_accumulation_steps from the Accelerate/DeepSpeed config)"
        )
    return accelerator


def enable_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """Turn a CPU (gloo) launch that asked for FSDP into FSDP2 through Accelerate's own FSDP code.

    Accelerate's AcceleratorState enables FSDP for GPU-like devices only: on CPU it keeps
    MULTI_CPU (plain DDP) without a word, although torch's `fully_shard` runs on CPU with gloo.
    Setting the state's plugin and type is all its FSDP branch does for fp32.

    Raises:
        UserError: the launch asks for FSDP1, which needs a GPU.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    if state.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables `accelerate launch` exported
    if plugin.fsdp_version != 2:
        # FSDP1 asks for a device at wrap time: "RuntimeError: There are currently no available devices
        # found, must be one of 'XPU', 'CUDA', 'MLU', 'NPU', 'MUSA', or 'HPU'."
        raise UserError(
            f"FSDP version {plugin.fsdp_version} cannot run on CPU (torch's FullyShardedDataParallel "
            "needs a GPU); set fsdp_version: 2 in the Accelerate config "
            "(configs/accelerate/fsdp-cpu.yaml)"
        )
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def check_fsdp(cfg: Config, accelerator: Accelerator) -> None:
    """Refuse under FSDP what cannot run sharded, before anything is built or written.

    Raises:
        UserError: bf16-true with fp32 norms, or a quantized base (QLoRA), under FSDP.
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return
    if cfg.precision.mode == "bf16-true" and fp32_norms_enabled(cfg.precision.mode, cfg.precision.fp32_norms):
        # fully_shard flattens each wrapped block into one group of one dtype: torch raises "FSDP expects
        # uniform original parameter dtype but got {torch.bfloat16, torch.float32}" at the first forward
        raise UserError(
            "precision.mode=bf16-true with fp32 norms (precision.fp32_norms, on by default) cannot run under FSDP "
            "(FSDP2 shards a block's parameters as one group of one dtype; fp32 norms inside bf16 blocks mix two); "
            "use precision.mode=bf16 (fp32 weights, bf16 compute) or precision.fp32_norms=false"
        )
    if cfg.model.quantization is not None:
        raise UserError(
            f"model.quantization={cfg.model.quantization} (QLoRA) cannot run under FSDP here: the quantized base "
            "is loaded per process by bitsandbytes and is not sharded; train it on one process (or use model.lora "
            "without quantization under FSDP)"
        )


def local_processes() -> int:
    """Training processes on this machine (set by `accelerate launch` / torchrun; 1 otherwise)."""
    for key in ("LOCAL_WORLD_SIZE", "ACCELERATE_NUM_PROCESSES_PER_NODE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def apply_num_threads(setting: int | str) -> int:
    """`run.num_threads`: set torch's intra-op threads before the model is built; return the count.

    `auto` is the cores this process may use divided among the local processes. `accelerate
    launch` exports OMP_NUM_THREADS=1 to its child, which alone made a CPU run 1.5x slower.
    """
    if setting == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // local_processes())
    else:
        threads = int(setting)
    torch.set_num_threads(threads)
    return threads


def configure_kernels(deterministic: bool, cudnn_attention: bool = False) -> None:
    """`precision.deterministic` and `precision.cudnn_attention`: the kernels CUDA may choose.

    deterministic: kernels needed for bitwise exact resume on CUDA. Sets CUBLAS_WORKSPACE_CONFIG
    (must happen before cuBLAS initialises) and `torch.use_deterministic_algorithms(True)`; ops
    without a deterministic kernel then raise. CPU fp32 training is deterministic without it.
    cudnn_attention: whether SDPA may pick cuDNN's fused attention, which plans a graph per new
    input shape; batches grouped by length bring a new shape every few steps.
    """
    torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)
    if not deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def setup_logging(accelerator: Accelerator, run_dir: Path | None) -> None:
    """Log to stderr on the main process (and to train.log in the run directory); `progress_log`'s
    training and evaluation rows go to train.log only."""
    for handler in logger.handlers + progress_log.handlers:
        handler.close()  # the previous run's train.log (in-process runs: tests, notebooks) is not left open
    logger.handlers.clear()
    progress_log.handlers.clear()
    logger.setLevel(logging.INFO if accelerator.is_main_process else logging.WARNING)
    progress_log.setLevel(logging.INFO)
    logger.propagate = progress_log.propagate = False
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(stream)
    if run_dir is not None and accelerator.is_main_process:
        fh = logging.FileHandler(run_dir / "train.log")
        fh.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(fh)
        progress_log.addHandler(fh)


# seconds between two progress lines when stderr is not a terminal (TQDM_MININTERVAL overrides it): a
# 500-step demo of ~3 minutes logs ~7 lines instead of 59 KB of carriage-return frames
PROGRESS_LINE_INTERVAL_S = 30.0
PROGRESS_LINE_FORMAT = "{desc} {n_fmt}/{total_fmt} | elapsed {elapsed}, ETA {remaining}, {rate_fmt}{postfix}"


class ProgressLines(plain_tqdm):
    """tqdm for a stderr that is not a terminal (CI, `nohup`, a cluster's job log): one plain line per
    interval and a last one at the end (for a transient bar, `leave=False`, only if it printed any),
    with tqdm's counts, elapsed time, ETA, rate and postfix, never a carriage return."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._line_n: int | None = None  # set before tqdm's first refresh calls display()
        self._line_t = time.time()
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm clears a bar before tqdm.write and at close: printed lines need no clearing
            return False
        now = self._time()
        if self._line_n == self.n or now - self._line_t < self.mininterval:
            return False
        self._line_t, self._line_n = now, self.n
        self.fp.write(str(self) + "\n")
        self.fp.flush()
        return True

    def clear(self, nolock: bool = False) -> None:
        return None

    def close(self) -> None:
        if not self.disable and (self.leave or self._line_n is not None) and self._line_n != self.n:
            self._line_t = float("-inf")
            self.display()
        self.leave = False  # tqdm's close would end the bar's line with one more newline
        super().close()


def progress_bar(*args: Any, **kwargs: Any) -> Any:
    """tqdm's bar where stderr is a terminal (or a notebook's widget); `ProgressLines` where it is not."""
    stream = kwargs.get("file") or sys.stderr
    notebook = any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)  # tqdm.auto's pick in Jupyter
    if notebook or getattr(stream, "isatty", lambda: False)():
        return tqdm(*args, **kwargs)
    interval = os.environ.get("TQDM_MININTERVAL")
    kwargs.update(
        mininterval=float(interval) if interval else PROGRESS_LINE_INTERVAL_S,
        smoothing=0,
        bar_format=PROGRESS_LINE_FORMAT,
    )
    return ProgressLines(*args, **kwargs)


def provenance(files: dict[str, Path], data_sha256: dict[str, str]) -> dict[str, Any]:
    """Library versions, git commit and data-file hashes (computed once, also used for resume checks)."""
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "git_commit": commit,
        "data_files": {split: {"path": str(p), "sha256": data_sha256[split]} for split, p in files.items()},
        "command": sys.argv,
    }


# ----------------------------------------------------------------------------------------------
# Preemption.


class Preempted(Exception):
    """Raised by the loop after the preemption checkpoint is on disk; entry points turn it into an exit code."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by {signal_name} at step {step}; checkpoint {checkpoint}")
        self.signal_name = signal_name
        self.step = step
        self.checkpoint = checkpoint
        self.exit_code = EXIT_CODES.get(signal_name, 143)


def _set_parent_death_signal() -> None:
    """Linux: have the kernel send us SIGTERM when our parent (the launcher) dies.

    `accelerate launch` forwards no signals: a SIGTERM sent to the launcher alone kills it and
    the training process would run on unaware. Only done under a launcher (its environment
    variables are set), because a plain `nohup finetune train &` must survive its shell.
    """
    if not sys.platform.startswith("linux"):
        return
    launched = any(
        k in os.environ
        for k in ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID", "LOCAL_RANK")
    )
    if not launched:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        return
    if os.getppid() != _PARENT_AT_START:  # the launcher died before prctl took effect (reparented)
        os.kill(os.getpid(), signal.SIGTERM)


class PreemptionGuard:
    """SIGTERM/SIGINT set a flag; the loop checks it at optimizer-step boundaries.

    Used as a context manager so the previous handlers come back afterwards (tests run
    `main()` in-process under pytest, whose SIGINT handler must survive).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            if os.environ.get("RANK", "0") == "0":
                print(
                    f"\n{name} received: saving a checkpoint at the end of this optimizer step",
                    file=sys.stderr,
                    flush=True,
                )
        elif signum == signal.SIGINT:  # a second Ctrl-C means: stop now
            raise KeyboardInterrupt

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            _set_parent_death_signal()
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agree(self, accelerator: Accelerator, out_of_time: bool = False) -> tuple[str | None, bool]:
        """(the signal to stop for, whether the time budget is spent), agreed by all processes in one collective:
        any rank signalled or out of time -> every rank stops at this step (the caller passes the main
        process's budget decision, False elsewhere)."""
        if accelerator.num_processes == 1:
            return self.signal_name, out_of_time
        code = {None: 0, "SIGINT": 1, "SIGTERM": 2}.get(self.signal_name, 2)
        flags = torch.tensor([code, int(out_of_time)], device=accelerator.device)
        signal_code, budget = accelerator.reduce(flags, "max").tolist()
        return {0: None, 1: "SIGINT", 2: "SIGTERM"}[int(signal_code)], bool(budget)


def resume_hint(prog: str, config: str, overrides: list[str]) -> str:
    """The one command that resumes a run (the overrides kept, checkpoint.resume set to auto)."""
    kept = [o for o in overrides if not o.startswith("checkpoint.resume=") and not o.startswith("run.overwrite=")]
    return " ".join([prog, "--config", config, *kept, "checkpoint.resume=auto"])


# ----------------------------------------------------------------------------------------------
# Out of memory inside the optimizer step: not recoverable in place.


def optimizer_step_out_of_memory(step: int, exc: BaseException, last_checkpoint: Path | None) -> UserError:
    """The one-line error for an out-of-memory error inside the optimizer step.

    Part of the weights may already be updated, so the window cannot be redone in place.
    """
    where = f"the last checkpoint {last_checkpoint} is intact" if last_checkpoint else "no checkpoint was written yet"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
    return UserError(
        f"out of memory inside optimizer step {step} ({first}): the weights may be half updated, so the step "
        f"cannot be redone; {where}; resume with checkpoint.resume=auto and a smaller train.micro_batch_size "
        "(same effective batch), or train.optimizer=adafactor"
    )
