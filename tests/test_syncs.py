"""Host synchronisations: the counter itself, and the loop reading no tensor value back per optimizer step
outside its log rows, evaluations and checkpoints (fp32, bf16 autocast, bf16-true; an encoder and a decoder)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import finetune.train as ft
from finetune.config.files import load_config
from finetune.core.syncs import READS, HostSyncCounter

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# Reads the loop does not own, each with why it is not a device sync of ours:
ALLOWED = {
    # the model's own forward: transformers checks the attention mask for padding (masking_utils) in any loop
    "site-packages/transformers/": "the model's forward",
    # its step counters are CPU tensors, as torch.optim's are: reading one does not wait for a GPU
    "(Bf16AdamW.step)": "the optimizer's CPU step counters",
}
LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}


def test_counter_counts_each_kind_of_read_by_site_and_restores_torch() -> None:
    x = torch.tensor([1.5, 2.0])
    before = {name: torch.Tensor.__dict__.get(name) for name in READS}
    with HostSyncCounter() as counter:
        x.sum().item()
        x.tolist()
        bool(x[0] > 1)
        float(x[0]), int(x[1])
        x.cpu(), x.numpy()
        y = x * 2  # no read
    assert counter.count == 7 and y.shape == (2,)
    sites = counter.top()
    assert sorted(n for _, n in sites) == [1, 1, 1, 2, 2]  # one site per line of this test
    assert all(s.startswith(f"{__file__}:") and s.endswith(f"({_qualname()})") for s, _ in sites)
    assert {name: torch.Tensor.__dict__.get(name) for name in READS} == before
    x.sum().item()
    assert counter.count == 7  # off after the block


def _qualname() -> str:
    return "test_counter_counts_each_kind_of_read_by_site_and_restores_torch"


def _reads_per_step(cfg_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Counter[str]]:
    """The tensor reads between consecutive optimizer steps of a run, by call site (ALLOWED ones left out)."""
    marks: list[Counter[str]] = []
    counter = HostSyncCounter()
    step = ft.optimizer_step

    def counted(*args: Any) -> None:
        marks.append(counter.sites.copy())
        step(*args)

    monkeypatch.setattr(ft, "optimizer_step", counted)
    with counter:
        ft.train(load_config(cfg_path))
    per_step = []
    for a, b in zip(marks, marks[1:], strict=False):
        diff = b.copy()
        diff.subtract(a)
        per_step.append(Counter({s: n for s, n in diff.items() if n and not any(k in s for k in ALLOWED)}))
    return per_step


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,arch",
    [("fp32", None), ("bf16", None), ("bf16-true", None), ("bf16-true", LLAMA)],
    ids=["fp32", "bf16", "bf16-true", "bf16-true-llama"],
)
def test_loop_reads_nothing_back_between_log_rows(
    mode: str, arch: dict[str, Any] | None, tiny_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Micro-batch 8 x accumulation 2, 6 optimizer steps, a log row at the last step only, clipping on: every
    step between the first and the last reads no tensor value back (the loss, the non-finite check, the
    window's sums and the grad norm stay on the device)."""
    updates = {
        "precision.mode": mode,
        "data.max_train_samples": 96,
        "train.micro_batch_size": 8,
        "train.gradient_accumulation_steps": 2,
        "train.max_steps": 6,
        "train.log_every_steps": 1000,
        "train.max_grad_norm": 1.0,
        "checkpoint.every_steps": None,
        "data.max_eval_samples": 16,
    }
    if arch is not None:
        updates["model.architecture"] = arch
    per_step = _reads_per_step(tiny_config(updates), monkeypatch)
    assert len(per_step) == 5
    assert all(not reads for reads in per_step), per_step
