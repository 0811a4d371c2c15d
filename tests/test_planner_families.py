"""The planner against the real training loop, for a tiny model of every family, and
planning a real-size model from its dimensions alone.

Truth here is not the planner's own harness: `main()` trains, and the loop's MemoryMonitor
samples the second optimizer window with MemTracker (memory.json of the checkpoint). The data are
SST-2 sentences of 20+ words cut to 16 tokens, so every batch is the planner's worst case.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_families import FAMILIES, NAMES, _sentences, family_config, train_tokenizer

from finetune.cli import main as cli_main
from finetune.config.files import load_config
from finetune.memory.peak import MiB
from finetune.memory.planner import predict_peak
from finetune.model.load import build_tokenizer
from finetune.train import main
from finetune.training import checkpoint as ckpt

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# the settings cycle over the families: every family planned once, every setting on several families
SETTINGS = [
    {},
    {"model.lora": {"r": 4}},
    {
        "model.lora": {"r": 4},
        "model.quantization": "4bit",
        "precision.mode": "bf16",
        "model.gradient_checkpointing": True,
    },
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    texts = _sentences(data_dir)
    return {k: train_tokenizer(texts, k, root / k) for k in ("decoder", "decoder_eos", "encoder")}


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    lines = (data_dir / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]
    rows = [x for x in lines if len(x.split("\t")[0].split()) >= 20][:32]
    path = tmp_path_factory.mktemp("data") / "long.tsv"
    path.write_text("sentence\tlabel\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return path


def _plan_against_loop(
    family: str, setting: dict[str, Any], tokenizers: dict[str, Path], long_rows: Path, tmp_path: Path
) -> None:
    cfg_path = family_config(
        tmp_path, family, tokenizers, **{"data.train_file": str(long_rows), "data.max_length": 16, **setting}
    )
    assert main(["--config", str(cfg_path)]) == 0
    report = json.loads((ckpt.list_checkpoints(tmp_path / "run")[-1] / "memory.json").read_text())
    assert report["breakdown_method"].startswith("MemTracker on optimizer step 2")
    cfg = load_config(cfg_path)
    planned = predict_peak(cfg, 8, 2, build_tokenizer(cfg), NAMES, seq_len=16)
    assert abs(planned.peak_bytes - report["peak_bytes"]) <= 0.05 * report["peak_bytes"], (planned, report)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_plan_matches_the_training_loops_measured_peak(
    family: str, tokenizers: dict[str, Path], long_rows: Path, tmp_path: Path
) -> None:
    _plan_against_loop(family, SETTINGS[list(FAMILIES).index(family) % len(SETTINGS)], tokenizers, long_rows, tmp_path)


@pytest.mark.slow
def test_an_8bit_plan_matches_the_training_loops_measured_peak(
    tokenizers: dict[str, Path], long_rows: Path, tmp_path: Path
) -> None:
    # bitsandbytes' 8-bit matmul keeps each layer's input until the whole backward ends (a ctx attribute,
    # not a saved tensor) and, under autocast, returns bf16 where Linear4bit casts back
    setting = {"model.lora": {"r": 4}, "model.quantization": "8bit", "precision.mode": "bf16"}
    _plan_against_loop("bert", setting, tokenizers, long_rows, tmp_path)


@pytest.mark.slow
def test_extrapolating_from_2_and_4_layers_equals_the_full_plan(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    from finetune.memory import planner

    over = {"model.architecture.num_hidden_layers": 7}
    cfg = load_config(family_config(tmp_path, "qwen2", tokenizers, **over))
    tok = build_tokenizer(cfg)
    fast = predict_peak(cfg, 2, 2, tok, NAMES, seq_len=8)
    planner.EXTRAPOLATE_ABOVE, saved = 100, planner.EXTRAPOLATE_ABOVE
    try:
        full = predict_peak(cfg, 2, 2, tok, NAMES, seq_len=8)
    finally:
        planner.EXTRAPOLATE_ABOVE = saved
    assert abs(fast.peak_bytes - full.peak_bytes) <= 16 and fast.categories.keys() == full.categories.keys()


@pytest.mark.slow
def test_a_1b_model_plans_from_its_dimensions_without_allocating(
    data_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """configs/llama-3.2-1b-qlora.yaml offline (QLoRA): no weights, no tokenizer, no network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = Path(__file__).parents[1] / "configs" / "llama-3.2-1b-qlora.yaml"
    before = psutil.Process().memory_info().rss
    assert (
        cli_main(["plan", "--config", str(config), "data.max_length=8", "--micro", "1", "--json", "--device", "cpu"])
        == 0
    )
    grown = psutil.Process().memory_info().rss - before
    (row,) = json.loads(capsys.readouterr().out)
    # 1.24B parameters: the 0.97B of the 16 layers in 4 bits (+ 1/64 absmax), the 263M embedding fp32
    assert 1400 < row["parameters_bytes"] / MiB < 1550
    assert row["optimizer_state_bytes"] / MiB < 0.02 * row["parameters_bytes"] / MiB  # adapters and head only
    assert grown < 300 * MiB  # a real fp32 copy would be 4.6 GiB


@pytest.mark.slow
def test_plan_grid_compares_the_settings(tiny_config: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny_config({"data.max_length": 16})
    assert (
        cli_main(["plan", "--config", str(path), "--grid", "--micro", "4", "--lengths", "16", "--device", "cpu"]) == 0
    )
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("fp32", "bf16", "LoRA", "QLoRA"))]
    assert len(rows) == 5 and "L16 x4" in out
    peak = {r[0]: float(r[-1].replace(",", "")) for r in rows}  # MiB at 16 tokens x 4
    # no gradients or AdamW state for the frozen base; the tiny model is mostly its 30k x 32 embedding,
    # which QLoRA keeps in fp32 (as peft's prepare_model_for_kbit_training would)
    assert peak["LoRA,"] < min(peak["bf16-true"], peak["fp32"]) and peak["QLoRA,"] < peak["fp32"]


@pytest.mark.slow
def test_mpnet_full_with_its_checkpointing_plans_as_the_loop_measures(
    tokenizers: dict[str, Path], long_rows: Path, tmp_path: Path
) -> None:
    """MPNet has no gradient checkpointing in transformers: its blocks go through torch.utils.checkpoint
    (finetune/model/families.py), which the planner must see as the loop does."""
    _plan_against_loop("mpnet", {"model.gradient_checkpointing": True}, tokenizers, long_rows, tmp_path)
