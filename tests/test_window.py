"""The accumulation window (finetune/data/window.py), proved through the code that trains.

Exactness: the gradient the optimizer applies equals a plain-torch full-batch gradient of each
window's mean loss, the short tail window included, and layouts with the same windows train the same
weights. The arithmetic: effective batch, micro-batch x accumulation x processes, the ladder. The
sampler: windows stamped with their sample count, seeded per epoch, whole under Accelerate's shards.
Resume: progress converted between launch layouts. Retry: out of memory inside a window redoes it at
half the micro-batch with the same result.

Elsewhere, because they share a fixture or a subprocess with other checks: exactness per problem
type (tests/test_tasks.py) and under two processes, and a 1-process checkpoint resumed on two
(tests/test_multiprocess.py).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import safetensors.torch as st
import torch
import torch.nn.functional as F
from accelerate.data_loader import BatchSamplerShard
from conftest import TINY

import finetune.train as train_mod
from finetune.config.files import load_config
from finetune.core import faults
from finetune.core.errors import UserError
from finetune.data.collate import Collator
from finetune.data.window import (
    OutOfMemoryGuard,
    WindowedBatchSampler,
    adapt_to_launch,
    micro_batch_ladder,
    resolve_batch,
    smaller_micro_batch,
    window_loss,
)
from finetune.training.checkpoint import TrainingProgress


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return st.load_file(str(run_dir / "final" / "model.safetensors"))


# ----------------------------------------------------------------------------------------------
# Exactness: the accumulated gradient is the window's full-batch gradient.


# Plain SGD, lr 1, no decay/clipping/warmup, fixed order: the optimizer sees exactly the accumulated gradient.
EXACT = {
    "data.max_train_samples": 10,
    "data.max_eval_samples": 8,
    "data.group_by_length": False,
    "train.optimizer": "sgd",
    "train.learning_rate": 1.0,
    "train.weight_decay": 0.0,
    "train.max_grad_norm": None,
    "train.lr_scheduler": "constant",
    "train.warmup_steps": 0,
    "train.epochs": 1,
    "train.log_every_steps": 1,
}


class _Spy:
    """Wraps train.py's build_* functions to record the data order and, before each optimizer step,
    the parameters and the gradient the optimizer is about to apply."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        self.ref_model: torch.nn.Module | None = None
        self.loader_args: tuple[Any, ...] = ()
        self.sampler: Any = None
        real_loader, real_opt = train_mod.build_train_loader, train_mod.build_optimizer

        def build_train_loader(ds: Any, tokenizer: Any, *args: Any) -> Any:
            loader, sampler = real_loader(ds, tokenizer, *args)
            self.loader_args, self.sampler = (ds, tokenizer), sampler
            return loader, sampler

        def build_optimizer(cfg: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
            opt = real_opt(cfg, model)
            self.ref_model = copy.deepcopy(model)
            names = {id(p): n for n, p in model.named_parameters()}

            def pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                params = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
                self.steps.append(
                    (
                        {n: p.detach().clone() for n, p in params.items()},
                        {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None},
                    )
                )

            opt.register_step_pre_hook(pre_step)
            return opt

        monkeypatch.setattr(train_mod, "build_train_loader", build_train_loader)
        monkeypatch.setattr(train_mod, "build_optimizer", build_optimizer)


def _window_gradients(
    spy: _Spy, windows: list[list[list[int]]], params: list[dict[str, torch.Tensor]], loss_of: Callable
) -> list[dict[str, torch.Tensor]]:
    """Gradients an independent plain-torch computation gets at the given parameters for each window."""
    ds, tokenizer = spy.loader_args
    collate = Collator(tokenizer)
    model = spy.ref_model
    assert model is not None
    model.train()
    out = []
    for window, p0 in zip(windows, params, strict=True):
        model.load_state_dict(p0, strict=False)
        model.zero_grad(set_to_none=True)
        micro_losses = []
        for micro in window:
            batch = collate([dict(ds[i]) for i in micro])
            labels = batch.pop("labels")
            per_sample = F.cross_entropy(model(**batch).logits.float(), labels, reduction="none")
            micro_losses.append(per_sample)
        loss_of(micro_losses).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    return out


def _rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).flatten() for k in a]).norm()
    return float(diff / torch.cat([b[k].flatten() for k in b]).norm())


def test_accumulated_gradient_equals_full_batch_gradient_on_ragged_windows(
    tiny_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10 samples, micro-batch 4, accumulation 2: micro-batches [4, 4, 2] -> windows [4, 4] and [2]
    spy = _Spy(monkeypatch)
    cfg = tiny_config({**EXACT, "train.micro_batch_size": 4, "train.gradient_accumulation_steps": 2})
    assert train_mod.main(["--config", str(cfg)]) == 0

    spy.sampler.set_epoch(0)
    batches = spy.sampler.batches()
    assert [len(b) for b in batches] == [4, 4, 2]
    windows = [batches[0:2], batches[2:3]]
    assert len(spy.steps) == 2  # one optimizer step per window, the short tail included
    params = [p for p, _ in spy.steps]
    loop_grads = [g for _, g in spy.steps]

    # full-batch gradient of each window: the mean loss over all of the window's samples
    full = _window_gradients(spy, windows, params, lambda ls: torch.cat(ls).mean())
    errors = [_rel_err(g, f) for g, f in zip(loop_grads, full, strict=True)]
    assert max(errors) <= 1e-5, errors

    # the test can tell: the usual per-micro-batch mean divided by the accumulation count (what
    # `loss.mean()` + Accelerate's division gives) is right for the [4, 4] window and wrong for [2]
    naive = _window_gradients(spy, windows, params, lambda ls: sum(micro_loss.mean() for micro_loss in ls) / 2)
    assert _rel_err(naive[0], full[0]) <= 1e-5
    assert _rel_err(naive[1], full[1]) > 0.4

    # and SGD with lr 1 applied exactly that gradient (the second step starts from p - g)
    step1 = {n: params[0][n] - loop_grads[0][n] for n in loop_grads[0]}
    assert _rel_err({n: params[1][n] for n in step1}, step1) <= 1e-6


@pytest.mark.slow
def test_batch_layouts_with_the_same_windows_train_the_same_weights(
    tiny_config: Callable[..., Path], tmp_path: Path
) -> None:
    """micro 4 x accumulation 2 and micro 8 x accumulation 1 both make windows [8] and [2]."""
    from safetensors.torch import load_file

    a = tiny_config(
        {
            **EXACT,
            "train.micro_batch_size": 4,
            "train.gradient_accumulation_steps": 2,
            "run.output_dir": str(tmp_path / "a"),
        },
        name="a.yaml",
    )
    b = tiny_config(
        {
            **EXACT,
            "train.micro_batch_size": 8,
            "train.gradient_accumulation_steps": 1,
            "run.output_dir": str(tmp_path / "b"),
        },
        name="b.yaml",
    )
    assert train_mod.main(["--config", str(a)]) == 0
    assert train_mod.main(["--config", str(b)]) == 0
    wa, wb = (
        load_file(tmp_path / "a" / "final" / "model.safetensors"),
        load_file(tmp_path / "b" / "final" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys()
    moved = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert moved <= 1e-5
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


# ----------------------------------------------------------------------------------------------
# Batch arithmetic: micro-batch x accumulation x processes, the ladder.


def test_batch_size_resolution_and_errors(tmp_path: Path) -> None:
    def cfg(*overrides: str) -> Any:
        return load_config(TINY, list(overrides))

    assert resolve_batch(cfg(), 1) == (16, 2, 32)  # tiny-debug: explicit micro 16 x 2
    # batch_size with the two keys removed replaces them
    raw = TINY.read_text().replace("  micro_batch_size: 16\n", "").replace("  gradient_accumulation_steps: 2\n", "")
    bare = tmp_path / "bare.yaml"
    bare.write_text(raw)
    assert resolve_batch(load_config(bare, ["train.batch_size=64"]), 1) == (64, 1, 64)
    assert resolve_batch(load_config(bare, ["train.batch_size=64"]), 2) == (32, 1, 64)
    assert resolve_batch(load_config(bare, ["train.batch_size=64", "train.micro_batch_size=16"]), 1) == (16, 4, 64)
    assert resolve_batch(
        load_config(bare, ["train.batch_size=64", "train.micro_batch_size=auto", "memory.budget_gb=1"]), 1
    ) == (None, None, 64)
    assert resolve_batch(cfg("train.batch_size=32"), 1) == (16, 2, 32)  # all three agree
    for overrides, P in ((["train.batch_size=64"], 1), (["train.batch_size=32"], 2), (["train.batch_size=48"], 1)):
        with pytest.raises(UserError) as err:
            resolve_batch(cfg(*overrides), P)
        msg = str(err.value)
        assert (
            "train.batch_size" in msg and "train.micro_batch_size" in msg and "train.gradient_accumulation_steps" in msg
        )
    with pytest.raises(UserError, match="train.batch_size.*train.micro_batch_size.*train.gradient_accumulation_steps"):
        cfg("train.batch_size=40")  # not a multiple of 16 x 2: refused when the config is read
    with pytest.raises(UserError, match="memory.budget_gb"):
        cfg("train.micro_batch_size=auto", "train.batch_size=32")


def test_ladder_and_smaller_micro_batch() -> None:
    assert micro_batch_ladder(32) == [1, 2, 4, 8, 16, 32]
    assert micro_batch_ladder(24) == [1, 2, 4, 8, 24]
    assert smaller_micro_batch(16, 2) == (8, 4)
    assert smaller_micro_batch(6, 1) == (3, 2)
    assert smaller_micro_batch(3, 4) == (1, 12)
    guard = OutOfMemoryGuard()
    with guard:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert guard.hit and "Tried to allocate" in guard.message
    assert guard.shrink(16, 2, batches_done=6) == (8, 4, 8)  # 2 windows done, redo the 3rd at micro 8
    with pytest.raises(UserError, match="micro-batch 1"):
        guard.shrink(1, 32, batches_done=3)
    with pytest.raises(ValueError), OutOfMemoryGuard():
        raise ValueError("other errors pass through")


# ----------------------------------------------------------------------------------------------
# The sampler: whole windows stamped with their sample count.


def _windows(sampler: WindowedBatchSampler) -> list[list[tuple[int, int, float]]]:
    return list(iter(sampler))


def test_sampler_stamps_window_sizes_on_ragged_tail() -> None:
    s = WindowedBatchSampler([5] * 10, batch_size=4, accumulation=2, seed=0, group_by_length=False)
    batches = _windows(s)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [{it[1] for it in b} for b in batches] == [{8}, {8}, {2}]
    assert sorted(it[0] for b in batches for it in b) == list(range(10))
    assert s.num_windows() == 2 and len(s) == 3


@pytest.mark.parametrize("group_by_length", [True, False])
def test_heaviest_window_has_the_most_padded_tokens(group_by_length: bool) -> None:
    lengths = [(i * 37) % 61 + 2 for i in range(203)]  # a ragged tail: 203 rows in windows of 3 x 4
    s = WindowedBatchSampler(lengths, batch_size=4, accumulation=3, seed=5, group_by_length=group_by_length)
    s.set_epoch(1)
    batches = _windows(s)  # the micro-batches as the loader receives them, 3 to a window
    cost = [
        max((len(b) * max(lengths[i] for i, _, _ in b), max(lengths[i] for i, _, _ in b)) for b in batches[w : w + 3])
        for w in range(0, len(batches), 3)
    ]
    assert s.heaviest_window() == cost.index(max(cost))
    assert s.heaviest_window(limit=5) == cost.index(max(cost[:5]))


def test_sampler_is_seeded_per_epoch() -> None:
    lengths = [(i * 13) % 31 + 1 for i in range(200)]
    a = WindowedBatchSampler(lengths, batch_size=8, accumulation=1, seed=3)
    b = WindowedBatchSampler(lengths, batch_size=8, accumulation=1, seed=3)
    assert a.batches() == b.batches()
    e0 = a.batches()
    a.set_epoch(1)
    assert a.batches() != e0
    b.set_epoch(1)
    assert a.batches() == b.batches()
    assert WindowedBatchSampler(lengths, batch_size=8, accumulation=1, seed=4).batches() != e0


def test_length_grouping_reduces_padding() -> None:
    lengths = [(i * 37) % 120 + 3 for i in range(400)]

    def padding(group: bool) -> int:
        s = WindowedBatchSampler(lengths, batch_size=16, accumulation=1, seed=0, group_by_length=group)
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in s.batches())

    assert padding(True) < padding(False) / 3
    s = WindowedBatchSampler(lengths[:390], batch_size=16, accumulation=1, seed=0)
    sizes = [len(b) for b in s.batches()]
    assert sizes[:-1] == [16] * (len(sizes) - 1) and sizes[-1] == 390 % 16  # only the last batch is short


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


# ----------------------------------------------------------------------------------------------
# Resume under another launch's layout.


def test_adapt_to_launch() -> None:
    """Resuming under another launch: the effective batch must stay; the split follows the launch."""
    where = Path("run/checkpoints/step_00000002")

    def saved(batches: int, micro: int, G: int, P: int | None) -> TrainingProgress:
        return TrainingProgress(
            step=2, batches_in_epoch=batches, micro_batch_size=micro, gradient_accumulation_steps=G, num_processes=P
        )

    def layout(p: TrainingProgress) -> tuple[int, int, int | None, int]:
        return p.micro_batch_size, p.gradient_accumulation_steps, p.num_processes, p.batches_in_epoch

    # another effective batch: refused, naming both layouts' process counts; progress untouched
    p = saved(10, 8, 5, 1)
    with pytest.raises(UserError) as info:
        adapt_to_launch(p, 8, 5, 2, where)
    msg = str(info.value)
    assert "1 process(es) x micro-batch 8 x accumulation 5 = effective batch 40" in msg
    assert "2 process(es) x micro-batch 8 x accumulation 5 = 80" in msg
    assert str(where) in msg
    assert layout(p) == (8, 5, 1, 10)

    # the same effective batch split otherwise: batches_in_epoch converted through the windows done
    p = saved(10, 4, 5, 2)
    adapt_to_launch(p, 4, 10, 1, where)  # 2 x 4 x 5 -> 1 x 4 x 10: two windows of 5 global batches -> of 10
    assert layout(p) == (4, 10, 1, 20)
    p = saved(3, 32, 1, 1)
    adapt_to_launch(p, 4, 2, 4, where)  # 1 x 32 x 1 -> 4 x 4 x 2: three windows of 1 batch -> of 2
    assert layout(p) == (4, 2, 4, 6)  # 4 x 2 x 4 = 32, the effective batch kept

    # the same process count: the checkpoint's micro-batch stays (an out-of-memory retry halved it)
    p = saved(20, 2, 10, 2)
    adapt_to_launch(p, 4, 5, 2, where)
    assert layout(p) == (2, 10, 2, 20)
    # a checkpoint that did not record its process count counts as this launch's
    p = saved(20, 2, 10, None)
    adapt_to_launch(p, 4, 5, 2, where)
    assert layout(p) == (2, 10, 2, 20)


# ----------------------------------------------------------------------------------------------
# Out of memory inside a window: the retry.


@pytest.mark.slow
def test_injected_oom_redoes_the_window_at_half_the_micro_batch(
    tiny_config: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OOM in step 3's window at micro 16 x 2 (then a preemption and a resume): the same final weights
    as a run at micro 8 x 4 from the start; the checkpoint keeps the smaller micro-batch."""
    from finetune.train import main

    base = {"data.max_train_samples": 200, "data.max_eval_samples": 16, "checkpoint.every_steps": 2}
    a = tiny_config(base, name="a.yaml")
    monkeypatch.setenv(faults.ENV, "oom_at_step:3,sigterm_at_step:5")
    assert main(["--config", str(a)]) == 143  # preempted after step 5, checkpoint written
    progress = json.loads(sorted((tmp_path / "run" / "checkpoints").glob("step_*/progress.json"))[-1].read_text())
    assert (progress["step"], progress["micro_batch_size"], progress["gradient_accumulation_steps"]) == (5, 8, 4)
    report = json.loads(sorted((tmp_path / "run" / "checkpoints").glob("step_*/memory.json"))[-1].read_text())
    assert (report["config"]["micro_batch_size"], report["config"]["gradient_accumulation_steps"]) == (8, 4)
    monkeypatch.delenv(faults.ENV)
    assert main(["--config", str(a), "checkpoint.resume=auto"]) == 0
    log = (tmp_path / "run" / "train.log").read_text()
    assert (
        "out of memory at micro-batch 16 x accumulation 2" in log
        and "resuming with micro-batch 8 x accumulation 4" in log
    )
    got = _final_weights(tmp_path / "run")
    b = tiny_config(
        {
            **base,
            "run.output_dir": str(tmp_path / "b"),
            "train.micro_batch_size": 8,
            "train.gradient_accumulation_steps": 4,
        },
        name="b.yaml",
    )
    assert main(["--config", str(b)]) == 0
    want = _final_weights(tmp_path / "b")
    assert got.keys() == want.keys()
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= 1e-6
    # and the weights moved: the comparison is not between two untrained models
    c = tiny_config({**base, "run.output_dir": str(tmp_path / "c"), "train.max_steps": 1}, name="c.yaml")
    assert main(["--config", str(c)]) == 0
    assert max((got[k] - v).abs().max().item() for k, v in _final_weights(tmp_path / "c").items()) > 1e-4


def test_redo_window_moves_progress_to_the_failed_window_and_resets_accelerates_count() -> None:
    """The layout change of a retry in one place: the smaller split, the epoch position at the failed
    window's start, the old loader released and Accelerate's micro-batch count back at 0."""
    guard = OutOfMemoryGuard()
    with guard:
        raise torch.OutOfMemoryError("CUDA out of memory")
    progress = TrainingProgress(micro_batch_size=16, gradient_accumulation_steps=2, batches_in_epoch=6)
    ended: list[bool] = []
    loader = SimpleNamespace(end=lambda: ended.append(True))
    accelerator = SimpleNamespace(step=1)
    guard.redo_window(progress, accelerator, loader)  # type: ignore[arg-type]
    layout = (progress.micro_batch_size, progress.gradient_accumulation_steps, progress.batches_in_epoch)
    assert layout == (8, 4, 8) and ended == [True] and accelerator.step == 0
    with pytest.raises(UserError, match="micro-batch 1"):
        guard.redo_window(TrainingProgress(micro_batch_size=1, gradient_accumulation_steps=32), accelerator, loader)


def test_window_loss_cancels_accelerates_division_and_the_mean_over_processes() -> None:
    per_sample = torch.tensor([1.0, 2.0, 3.0])
    # a tail window of 5 samples over 2 processes at accumulation 4: x 4 x 2 / 5
    assert window_loss(per_sample, torch.tensor(5.0), 4, 2).item() == pytest.approx(6.0 * 8 / 5)
