"""Shared test setup: offline hub, the data directory, and tiny configs written into tmp_path.

The only allowed skip in the suite is a missing data directory (`data_dir` fixture).
"""

from __future__ import annotations

import importlib.util
import os
import sys

# Before anything imports huggingface_hub / transformers: no network, no tokenizer thread pools.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# Tiny models gain nothing from intra-op threads, and on a shared 2-core box thread contention made
# a tiny-debug run ~3x slower (10.0 s vs 3.7 s side by side); subprocesses inherit this too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
TINY = CONFIGS / "tiny-debug.yaml"
DATA_DIR = Path(os.environ.get("FINETUNE_DATA_DIR") or ROOT.parent / "shared" / "data").resolve()
# configs find their data through ${FINETUNE_DATA_DIR}; make it absolute so the cwd does not matter
os.environ["FINETUNE_DATA_DIR"] = str(DATA_DIR)


@pytest.fixture(scope="module")
def one_thread() -> Any:
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): on a
    shared 2-core machine OpenMP threads spin-waiting for a descheduled sibling make small runs
    several times slower (results are compared only within this setting)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def require_data() -> Path:
    """The real data directory; a missing one skips locally and fails under CI=true (never a silent skip there)."""
    if not (DATA_DIR / "sst2" / "train.tsv").is_file():
        message = (
            f"data directory not found: {DATA_DIR} "
            "(set FINETUNE_DATA_DIR to the folder holding sst2/, ag_news/, sms_spam/, trec/)"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    return DATA_DIR


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real data directory (env FINETUNE_DATA_DIR, default <repo>/../shared/data): `require_data`."""
    return require_data()


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module, registered in sys.modules first (a script's dataclasses look their module up)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    *parents, last = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


# A tiny run of any model family: 32 training rows, 2 optimizer steps of 8, a checkpoint at the end (the family's
# tokenizer and architecture added by the test)
TINY_FAMILY_RUN: dict[str, Any] = {
    "data.max_length": 32,
    "data.max_train_samples": 32,
    "data.max_eval_samples": 16,
    "train.micro_batch_size": 8,
    "train.gradient_accumulation_steps": 2,
    "train.max_steps": 2,
    "train.log_every_steps": 1,
    "checkpoint.every_steps": 2,
}


def write_tiny_config(directory: Path, updates: dict[str, Any] | None = None, name: str = "tiny.yaml") -> Path:
    """configs/tiny-debug.yaml with `run.output_dir=<directory>/run` and dotted `updates`, written to directory/name.

    A value of `...` (Ellipsis) deletes the key.
    """
    raw = yaml.safe_load(TINY.read_text())
    raw["run"]["output_dir"] = str(directory / "run")
    # small and quiet by default: evaluation and logging every few steps only cost time here
    raw["train"]["eval_every_steps"] = None
    raw["run"]["num_threads"] = 1  # tiny models gain nothing from threads (and the box is shared)
    # the plots take about 1 s of a tiny run's 2; the tests of the plots switch them back on
    raw.setdefault("log", {})["plots"] = False
    for key, value in (updates or {}).items():
        if value is ...:
            *parents, last = key.split(".")
            node = raw
            for p in parents:
                node = node[p]
            node.pop(last, None)
        else:
            _set_dotted(raw, key, value)
    path = directory / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture
def tiny_config(tmp_path: Path, data_dir: Path) -> Callable[..., Path]:
    """Factory: `tiny_config({"train.micro_batch_size": 4})` -> path of a tiny config writing into tmp_path/run."""

    def make(updates: dict[str, Any] | None = None, name: str = "tiny.yaml") -> Path:
        return write_tiny_config(tmp_path, updates, name)

    return make


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """One in-process tiny-debug training run shared by the tests that need an exported model; its run dir."""
    from finetune.train import main

    directory = tmp_path_factory.mktemp("tiny_run")
    cfg = write_tiny_config(directory, {"data.max_train_samples": 128, "data.max_eval_samples": 64, "log.plots": True})
    assert main(["--config", str(cfg)]) == 0
    return directory / "run"


# plain SGD (no momentum, decay, clipping or schedule) in windows of 16, 16 and 8 samples: every step is
# w <- w - 1.0 x (the window's full-batch gradient), computable by a plain-torch reference
PLAIN_SGD = {
    "train.optimizer": "sgd",
    "train.momentum": 0.0,
    "train.weight_decay": 0.0,
    "train.max_grad_norm": None,
    "train.lr_scheduler": "constant",
    "train.warmup_ratio": 0.0,
    "train.learning_rate": 1.0,
    "train.epochs": 1,
    "train.micro_batch_size": 8,
    "train.gradient_accumulation_steps": 2,
    "data.max_train_samples": 40,
}


def sgd_from_saved_start(directory: Path, updates: dict[str, Any], seed: int) -> tuple[Any, Any, Any, Any, Path]:
    """For exactness tests: build the tiny model of `updates` with `seed`, save it (and its tokenizer)
    to `directory/init`, write `directory/tiny.yaml` training from those weights, and return
    (config, tokenizer, tokenized data, the in-memory model, the config path) for a plain-torch reference."""
    import torch

    from finetune.config.files import load_config
    from finetune.data.build import build_data
    from finetune.model.load import build_model, build_tokenizer

    scratch = load_config(write_tiny_config(directory, updates, name="scratch.yaml"))
    tok = build_tokenizer(scratch)
    data = build_data(scratch, tok)
    torch.manual_seed(seed)
    model = build_model(scratch, data.label_names, tok)
    init = directory / "init"
    model.save_pretrained(init)
    tok.save_pretrained(init)
    saved = {**updates, "model.name_or_path": str(init), "model.architecture": None, "model.tokenizer": None}
    return scratch, tok, data, model, write_tiny_config(directory, saved)
