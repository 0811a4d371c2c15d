"""optim.py: the learning-rate schedules against transformers' own, and what start-up imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import get_scheduler

from finetune.config.files import load_config
from finetune.training.optim import build_scheduler

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "shape, hf_name", [("linear", "linear"), ("cosine", "cosine"), ("constant", "constant_with_warmup")]
)
@pytest.mark.parametrize("warmup", [0, 3])
def test_schedules_match_transformers_get_scheduler(shape: str, hf_name: str, warmup: int) -> None:
    overrides = [f"train.lr_scheduler={shape}", f"train.warmup_steps={warmup}"]
    cfg = load_config(ROOT / "configs" / "tiny-debug.yaml", overrides)
    total = 11

    def lrs(make: object) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        sched = make(opt)  # type: ignore[operator]
        out = []
        for _ in range(total + 2):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    ours = lrs(lambda opt: build_scheduler(cfg, opt, total))
    theirs = lrs(lambda opt: get_scheduler(hf_name, opt, num_warmup_steps=warmup, num_training_steps=total))
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert len(set(ours)) > 1 or (shape, warmup) == ("constant", 0)


@pytest.mark.slow
def test_start_up_imports_no_optional_heavy_library() -> None:
    # peft (LoRA), bitsandbytes (8-bit/4-bit), matplotlib (plots at the end), tensorboard (a tracker)
    code = (
        "import sys, finetune.train, finetune.cli; "
        "print(sorted(m for m in ('peft', 'bitsandbytes', 'matplotlib', 'tensorboard') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
