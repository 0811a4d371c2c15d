"""The accumulation window: the samples of one optimizer step, however they are split.

One optimizer step sees one window of micro-batch x accumulation x processes samples (an epoch's
last window may be shorter). Exact accumulation - the accumulated gradient equals the full-batch
gradient of the window's mean loss, short tail window included - holds only while these agree, and
all of them live here:

- the batch arithmetic (`effective_batch`, `resolve_batch`) and the micro-batch sizes to try
  (`micro_batch_ladder`) or to fall back to (`smaller_micro_batch`);
- the sampler (`WindowedBatchSampler`): windows formed independently of the micro-batch, every item
  stamped with its window's sample count, short global batches filled with weight-0 rows; the
  dataset wrapper (`WindowedDataset`) hands the stamp to `collate.Collator` as `batch["window_samples"]`;
- the loss normaliser (`window_loss`);
- redoing a window at a smaller micro-batch after running out of memory (`OutOfMemoryGuard`);
- resuming under another launch's layout (`adapt_to_launch`).

The Accelerator's half of the contract is `runtime.build_accelerator`'s `split_batches=True`: the
sampler's batches are global and Accelerate splits each across the processes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import Sampler

from finetune.config.schema import Config
from finetune.core.errors import UserError

if TYPE_CHECKING:  # annotations only: importing the window's arithmetic loads neither
    import datasets
    from accelerate import Accelerator

logger = logging.getLogger("finetune")


class WindowProgress(Protocol):
    """The fields of `checkpoint.TrainingProgress` that describe the batch layout and the position in
    the epoch (a Protocol: checkpoint sits above this module and holds the dataclass)."""

    batches_in_epoch: int  # global micro-batches of the epoch consumed
    micro_batch_size: int  # per process
    gradient_accumulation_steps: int
    num_processes: int | None  # None: a checkpoint written before the count was recorded


# ----------------------------------------------------------------------------------------------
# Batch arithmetic: effective batch = micro-batch x accumulation x processes.


def effective_batch(cfg: Config, num_processes: int = 1) -> int:
    """Effective batch: `train.batch_size`, else micro-batch x accumulation x processes.

    Args:
        cfg: the run's config (an explicit micro-batch unless `train.batch_size` is set).
        num_processes: processes of the launch.

    Returns:
        Samples per optimizer step, summed over processes.
    """
    t = cfg.train
    if t.batch_size is not None:
        return t.batch_size
    assert t.micro_batch_size != "auto"  # the config validator requires batch_size with auto
    return int(t.micro_batch_size) * t.gradient_accumulation_steps * num_processes


def resolve_batch(cfg: Config, num_processes: int) -> tuple[int | None, int | None, int]:
    """(micro-batch, accumulation, effective batch) per process; (None, None, E) when auto.

    `train.batch_size` alone replaces the two explicit keys (micro = E / processes, no
    accumulation); with an explicit micro-batch the accumulation is derived; with both explicit
    the three must agree. Every mismatch is one error naming all three keys.

    Args:
        cfg: the run's config.
        num_processes: processes of the launch.

    Returns:
        The micro-batch and accumulation (None for `train.micro_batch_size: auto`, which the
        planner chooses) and the effective batch.

    Raises:
        UserError: the effective batch does not split into processes x micro-batch x accumulation.
    """
    t = cfg.train
    given = t.model_fields_set
    P = num_processes
    if t.batch_size is None:
        assert t.micro_batch_size != "auto"
        micro, G = int(t.micro_batch_size), t.gradient_accumulation_steps
        return micro, G, micro * G * P
    E = t.batch_size
    explicit_micro = "micro_batch_size" in given
    explicit_G = "gradient_accumulation_steps" in given

    def disagree(reason: str) -> UserError:
        return UserError(
            f"train.batch_size={E} must equal train.micro_batch_size ({t.micro_batch_size}) x "
            f"train.gradient_accumulation_steps ({t.gradient_accumulation_steps if explicit_G else 'derived'}) x "
            f"processes ({P}): {reason}"
        )

    if E % P:
        raise disagree(f"{E} is not divisible by {P} processes")
    if t.micro_batch_size == "auto":
        return None, None, E
    if not explicit_micro:
        if explicit_G:
            if (E // P) % t.gradient_accumulation_steps:
                raise disagree(
                    f"{E // P} samples per process do not split into {t.gradient_accumulation_steps} micro-batches"
                )
            return E // P // t.gradient_accumulation_steps, t.gradient_accumulation_steps, E
        return E // P, 1, E
    micro = int(t.micro_batch_size)
    if (E // P) % micro:
        raise disagree(f"{E // P} samples per process is not a multiple of the micro-batch")
    G = E // P // micro
    if explicit_G and G != t.gradient_accumulation_steps:
        raise disagree(f"{micro} x {t.gradient_accumulation_steps} x {P} = {micro * t.gradient_accumulation_steps * P}")
    return micro, G, E


def micro_batch_ladder(per_process: int) -> list[int]:
    """Micro-batch sizes to try: powers of two dividing the per-process batch, and the batch itself.

    Args:
        per_process: samples per process in one window (effective batch / processes).

    Returns:
        The sizes, smallest first.
    """
    sizes = [m for m in (1 << k for k in range(per_process.bit_length())) if per_process % m == 0]
    if per_process not in sizes:
        sizes.append(per_process)
    return sizes


def smaller_micro_batch(micro: int, accumulation: int) -> tuple[int, int]:
    """The next micro-batch down and the accumulation that keeps micro x accumulation unchanged.

    Args:
        micro: the micro-batch now (at least 2).
        accumulation: the accumulation now.

    Returns:
        (half the micro-batch, or its largest divisor below half; the matching accumulation).
    """
    new = max(d for d in range(1, micro // 2 + 1) if micro % d == 0)
    return new, accumulation * (micro // new)


# ----------------------------------------------------------------------------------------------
# The sampler: whole windows, stamped with their sample count.


class WindowedBatchSampler(Sampler[list[tuple[int, int, float]]]):
    """Seeded, optionally length-grouped batches of (index, window_samples, weight) items.

    Exact gradient accumulation needs, at the first micro-batch of a window, the number of
    samples in the whole window (the tail window of an epoch is short). The sampler knows the
    epoch's batches in advance, so it stamps that count on every item; the collator turns it
    into `batch["window_samples"]`. Batches are global (micro-batch x processes, split by
    Accelerate with `split_batches=True`); with several processes (`pad_to_multiple` = P > 1) a
    short global batch is filled to the full global size with weight-0 copies, so every process
    gets the same number of rows and no sample counts twice.

    Args:
        lengths: tokens per dataset row (length grouping, the fill row, the heaviest window).
        batch_size: rows per global micro-batch (micro-batch x processes).
        accumulation: micro-batches per window.
        seed: the data order's seed (epoch e uses seed + e).
        group_by_length: sort rows by length within megabatches (less padding).
        pad_to_multiple: processes; above 1, short global batches are filled with weight-0 rows.
        megabatch_factor: windows per megabatch of length grouping.
        weights: per-sample loss weights (None: all 1).
    """

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        accumulation: int,
        seed: int,
        group_by_length: bool = True,
        pad_to_multiple: int = 1,
        megabatch_factor: int = 50,
        weights: list[float] | None = None,
    ) -> None:
        self.lengths = lengths
        # per-sample loss weights (class weights, 1/windows of a chunked text): a window is normalised
        # by their sum, which is what the stamped window total is
        self.weights = weights
        self.batch_size = batch_size
        self.accumulation = accumulation
        self.seed = seed
        self.group_by_length = group_by_length
        self.pad_to_multiple = pad_to_multiple
        self.megabatch = batch_size * accumulation * megabatch_factor
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the data order of `epoch` (seed + epoch), so a resumed run sees the same order."""
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        """The epoch's batches as lists of dataset indices."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        if not self.group_by_length:
            return [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        # sort within megabatches by length (longest first), cut into accumulation windows, shuffle
        # the window order, then cut each window into micro-batches. Grouping whole windows makes
        # an epoch's windows (which samples each optimizer step sees) independent of the
        # micro-batch size: micro 16 x 2 and micro 8 x 4 step on the same samples, which is what
        # lets an out-of-memory retry halve the micro-batch mid-epoch (`OutOfMemoryGuard.redo_window`).
        window = self.batch_size * self.accumulation
        windows: list[list[int]] = []
        for s in range(0, len(order), self.megabatch):
            chunk = sorted(order[s : s + self.megabatch], key=lambda i: -self.lengths[i])
            windows.extend(chunk[i : i + window] for i in range(0, len(chunk), window))
        # keep a full window last: only the epoch's final window may be short
        full = [w for w in windows if len(w) == window]
        short = [w for w in windows if len(w) != window]
        perm = torch.randperm(len(full), generator=g).tolist()
        return [
            w[i : i + self.batch_size]
            for w in [full[i] for i in perm] + short
            for i in range(0, len(w), self.batch_size)
        ]

    def __iter__(self) -> Iterator[list[tuple[int, int, float]]]:
        batches = self.batches()
        for w in range(0, len(batches), self.accumulation):
            window = batches[w : w + self.accumulation]
            weight = self.weights or [1.0] * len(self.lengths)
            n = sum(weight[i] for b in window for i in b)
            for b in window:
                items = [(i, n, weight[i]) for i in b]
                if self.pad_to_multiple > 1 and len(items) < self.batch_size:
                    # Several processes: Accelerate's BatchSamplerShard (split_batches=True) refills a
                    # short global batch with samples from the epoch's start (weight 1: counted twice)
                    # unless the batch is full. Fill it with weight-0 copies of its shortest sample
                    # instead: every rank gets batch_size / P rows and nothing counts twice.
                    pad = min(b, key=lambda i: self.lengths[i])
                    items += [(pad, n, 0.0)] * (self.batch_size - len(items))
                yield items

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def num_windows(self) -> int:
        """Optimizer steps in one epoch."""
        return math.ceil(len(self) / self.accumulation)

    def heaviest_window(self, limit: int | None = None) -> int:
        """Index in this epoch (among its first `limit` windows) of the window whose largest micro-batch has
        the most padded tokens (rows x longest row; ties: the longer row, then the earlier window): where
        activation memory peaks, since batches are padded per batch."""
        batches = self.batches()[: None if limit is None else limit * self.accumulation]

        def cost(b: list[int]) -> tuple[int, int]:
            longest = max(self.lengths[i] for i in b)
            return len(b) * longest, longest

        windows = [
            max(cost(b) for b in batches[w : w + self.accumulation]) for w in range(0, len(batches), self.accumulation)
        ]
        return max(range(len(windows)), key=lambda w: (windows[w], -w))


class WindowedDataset(TorchDataset):
    """Wraps a tokenized split so items addressed as (index, window_samples, weight) carry both.

    Args:
        ds: the tokenized split; plain integer keys read its rows unchanged (evaluation).
    """

    def __init__(self, ds: datasets.Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: tuple[int, int, float] | int) -> dict[str, Any]:
        if isinstance(key, tuple):
            index, window, weight = key
            item = dict(self.ds[int(index)])
            item["window_samples"] = window
            item["sample_weight"] = weight
            return item
        return dict(self.ds[int(key)])

    def __getitems__(self, keys: list[tuple[int, int, float]] | list[int]) -> list[dict[str, Any]]:
        """A micro-batch's rows in one read of the table (the DataLoader calls this with a batch sampler)."""
        windowed = isinstance(keys[0], tuple)
        columns = self.ds[[int(k[0]) if windowed else int(k) for k in keys]]  # type: ignore[index]
        rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
        if windowed:
            for row, (_, window, weight) in zip(rows, keys, strict=True):  # type: ignore[misc]
                row["window_samples"] = window
                row["sample_weight"] = weight
        return rows


# ----------------------------------------------------------------------------------------------
# The loss normaliser.


def window_loss(
    per_sample: torch.Tensor, window_samples: torch.Tensor, accumulation: int, processes: int
) -> torch.Tensor:
    """The loss one micro-batch hands to `accelerator.backward`.

    Exact accumulation: the sum over the window's true sample count (short tail window and all
    processes included); x accumulation x processes cancels Accelerate's division by the
    accumulation count and DDP's mean over processes. Summed over the window, the gradients are
    then those of the window's mean loss.

    Args:
        per_sample: this process's weighted per-sample losses of the micro-batch (fp32).
        window_samples: the stamped window total (the sum of the window's sample weights).
        accumulation: micro-batches per window.
        processes: processes of the launch.

    Returns:
        A scalar loss.
    """
    return per_sample.sum() * (accumulation * processes) / window_samples


# ----------------------------------------------------------------------------------------------
# Out of memory inside a window: redo it at a smaller micro-batch.


class OutOfMemoryGuard:
    """Around the forward and backward of one micro-batch: swallows `torch.OutOfMemoryError` and
    records it, so the loop can halve the micro-batch, double the accumulation and redo the window
    (same effective batch). Only forward/backward: the weights are untouched until the optimizer
    step, which runs outside the guard (an error there is not recoverable without a checkpoint).
    """

    def __init__(self) -> None:
        self.hit = False
        self.message = ""

    def __enter__(self) -> OutOfMemoryGuard:
        self.hit = False
        return self

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> bool:
        if typ is not None and issubclass(typ, torch.OutOfMemoryError):
            self.hit = True
            self.message = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
            return True
        return False

    def shrink(self, micro: int, accumulation: int, batches_done: int) -> tuple[int, int, int]:
        """(micro, accumulation, micro-batches to skip) to redo the current window with.

        Every window before the current one is full (only an epoch's last window is short), so the
        windows done are (batches_done - 1) // accumulation, and the rebuilt loader - whose
        windows hold the same samples (`WindowedBatchSampler`) - skips that many windows.

        Args:
            micro: the micro-batch that ran out of memory.
            accumulation: its accumulation.
            batches_done: micro-batches of the epoch consumed, the failed one included.

        Returns:
            The smaller micro-batch, its accumulation, and the micro-batches of the epoch to skip.

        Raises:
            UserError: the micro-batch is 1 already.
        """
        if micro == 1:
            raise UserError(
                f"out of memory at micro-batch 1 ({self.message}); try precision.mode=bf16, "
                "model.gradient_checkpointing=true, model.lora or a shorter data.max_length "
                "(`finetune plan` shows where the memory goes)"
            )
        windows_done = (batches_done - 1) // accumulation
        new_micro, new_acc = smaller_micro_batch(micro, accumulation)
        logger.warning(
            f"out of memory at micro-batch {micro} x accumulation {accumulation} ({self.message}); "
            f"redoing the window with micro-batch {new_micro} x accumulation {new_acc} (same effective batch)"
        )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the failed window's blocks
        return new_micro, new_acc, windows_done * new_acc

    def redo_window(self, progress: WindowProgress, accelerator: Accelerator, loader: Any) -> None:
        """Move `progress` to the smaller layout at the start of the failed window; let go of `loader`.

        The caller drops the failed window's gradients first and then builds the loader of the new
        layout (which sets the accelerator's accumulation count).

        Args:
            progress: the run's progress; its micro-batch, accumulation and `batches_in_epoch` change.
            accelerator: the run's Accelerator.
            loader: the prepared training loader the window failed in.

        Raises:
            UserError: the micro-batch is 1 already.
        """
        micro, G, skip = self.shrink(
            progress.micro_batch_size, progress.gradient_accumulation_steps, progress.batches_in_epoch
        )
        progress.micro_batch_size, progress.gradient_accumulation_steps, progress.batches_in_epoch = micro, G, skip
        if hasattr(loader, "end"):
            loader.end()  # leave Accelerate's end-of-dataloader tracking to the new loader
        # Accelerate's own count of micro-batches in the window (an internal: `accumulate` syncs when
        # step % accumulation == 0); left at the failed window's count it would sync the redone window
        # at the wrong micro-batch
        accelerator.step = 0


# ----------------------------------------------------------------------------------------------
# Resume under another launch.


def adapt_to_launch(progress: WindowProgress, micro: int, accumulation: int, processes: int, path: Path) -> None:
    """Make a resumed `progress` continue under this launch's batch layout, or refuse.

    The effective batch must stay (else other samples form each step). With the same process
    count the checkpoint's micro-batch is kept (an out-of-memory retry may have lowered it); with
    another count the launch's micro-batch and accumulation are used and `batches_in_epoch` is
    converted through the windows done (checkpoints fall on window boundaries, and an epoch's
    windows hold the same samples whatever the split: `WindowedBatchSampler`).

    Args:
        progress: the checkpoint's progress, changed in place.
        micro: this launch's micro-batch.
        accumulation: this launch's accumulation.
        processes: this launch's process count.
        path: the checkpoint (named in the error).

    Raises:
        UserError: the effective batch would change.
    """
    saved_p = progress.num_processes if progress.num_processes is not None else processes
    saved_layout = (saved_p, progress.micro_batch_size, progress.gradient_accumulation_steps)
    saved = "{} process(es) x micro-batch {} x accumulation {}".format(*saved_layout)
    saved_e = progress.micro_batch_size * progress.gradient_accumulation_steps * saved_p
    if saved_e != micro * accumulation * processes:
        raise UserError(
            f"cannot resume from {path}: it was trained with {saved} = effective batch {saved_e}, this launch has "
            f"{processes} process(es) x micro-batch {micro} x accumulation {accumulation} = "
            f"{micro * accumulation * processes}; relaunch with {saved_p} process(es), or set "
            f"train.batch_size={saved_e} "
            "(without train.micro_batch_size) so the split follows the process count"
        )
    if saved_p != processes:
        windows_done = progress.batches_in_epoch // progress.gradient_accumulation_steps
        progress.batches_in_epoch = windows_done * accumulation
        progress.micro_batch_size, progress.gradient_accumulation_steps = micro, accumulation
        logger.info(
            f"resuming a run of {saved} with {processes} process(es) x micro-batch {micro} "
            f"x accumulation {accumulation}"
        )
    progress.num_processes = processes
