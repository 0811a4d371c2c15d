"""What `finetune.train.train` leaves behind in its process: nothing of the run.

A sweep calls train() once per trial in one process; a model, optimizer or tensor that a finished or
failed run leaves referenced is memory the next trial cannot have (on a GPU, the allocator's blocks).
"""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune import train as train_module
from finetune.config.files import load_config
from finetune.core import faults
from finetune.core.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def live_tensors() -> dict[int, torch.Tensor]:
    """Every tensor the garbage collector can see (parameters, gradients, optimizer state, caches)."""
    return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor)}


def reachable_bytes() -> int:
    """Bytes of the distinct storages behind every tensor the garbage collector can see."""
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                storage = o.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # fake/functional tensors an earlier ONNX export left behind own no memory
                continue
    return sum(storages.values())


@pytest.mark.slow
def test_train_releases_the_run_whether_it_returns_or_raises(
    tiny_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: dict[str, weakref.ref[Any]] = {}
    build_model, build_optimizer = train_module.build_policy_model, train_module.build_optimizer

    def policy_model(*args: Any, **kwargs: Any) -> Any:
        model, *rest = build_model(*args, **kwargs)
        made["model"] = weakref.ref(model)
        return (model, *rest)

    def optimizer(*args: Any, **kwargs: Any) -> Any:
        opt = build_optimizer(*args, **kwargs)
        made["optimizer"], made["a weight"] = weakref.ref(opt), weakref.ref(opt.param_groups[0]["params"][0])
        return opt

    monkeypatch.setattr(train_module, "build_policy_model", policy_model)
    monkeypatch.setattr(train_module, "build_optimizer", optimizer)
    small = {"data.max_train_samples": 32, "data.max_eval_samples": 16, "train.max_steps": 1}
    gc.collect()
    before, before_bytes = live_tensors(), reachable_bytes()

    def assert_released(how: str) -> None:
        assert set(made) == {"model", "optimizer", "a weight"}
        gc.collect()
        # an independent count: the tiny model's weights are ~4 MB (its embedding table alone), a leak is all of them
        left_bytes = reachable_bytes() - before_bytes
        assert left_bytes < 64 * 1024, f"{how}: {left_bytes} bytes of tensors more than before the run"
        alive = [name for name, ref in made.items() if ref() is not None]
        holders = {name: sorted({type(r).__name__ for r in gc.get_referrers(made[name]())}) for name in alive}
        assert not alive, f"{how}: alive, held by {holders}"
        left = [tuple(t.shape) for i, t in live_tensors().items() if i not in before]
        assert not left, f"{how}: tensors left alive: {left[:10]}"
        made.clear()

    # raised: the save of step 1 fails (a full disk), the error reaches the caller, who drops it
    monkeypatch.setenv(faults.ENV, "disk_full_in_save:1")
    with pytest.raises(UserError, match="disk is full"):
        train_module.train(load_config(tiny_config({**small, "checkpoint.every_steps": 1}, name="fails.yaml")))
    monkeypatch.delenv(faults.ENV)
    assert_released("raised")
    # two steps: the second's window runs under the memory report's MemTracker, whose hooks once kept the
    # window's autograd graph, and with it every parameter, alive after train() returned
    two = {"train.max_steps": 2, "train.gradient_accumulation_steps": 1}
    cfg = load_config(tiny_config({**small, **two, "run.overwrite": True}))
    result = train_module.train(cfg)
    assert result["step"] == 2
    report = json.loads((Path(cfg.run.output_dir) / "memory.json").read_text())
    assert report["memtracker_peak"] and "optimizer step 2" in report["breakdown_method"], report["breakdown_method"]
    assert_released("returned")
