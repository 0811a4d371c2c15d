"""Packed training batches (data.packing): placement, logits equal to unpacked ones, and a packed
run that ends with the same weights as an unpacked one."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY
from safetensors.torch import load_file

from finetune.config.files import load_config
from finetune.data.collate import Collator
from finetune.data.packing import PackingCollator, attention_cost, pack_rows, packed_logits
from finetune.model.load import build_model, build_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_pack_rows_places_every_sequence_once_within_capacity() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(3, 60) for _ in range(rng.randint(1, 40))]
        capacity, place = pack_rows(lengths, 64, rng.choice([0.0, 1e-3, 0.05]))
        assert max(lengths) <= capacity <= max(64, max(lengths))
        used: dict[int, list[tuple[int, int]]] = {}
        for n, (row, offset) in zip(lengths, place, strict=True):
            assert 0 <= offset and offset + n <= capacity
            used.setdefault(row, []).append((offset, offset + n))
        for spans in used.values():  # no two sequences overlap in a row
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert sorted(used) == list(range(len(used)))  # no empty rows


def test_pack_rows_weighs_attention_against_padding() -> None:
    # equal lengths: nothing to gain, every sequence keeps a row of its own length
    assert pack_rows([14] * 8, 64, 4.3e-4) == (14, [(i, 0) for i in range(8)])
    # one long and many short: two balanced rows of 58 (40+9+9 and 4 x 10+9+9) beat 9 rows of 40
    capacity, place = pack_rows([40, 10, 10, 10, 10, 9, 9, 9, 9], 64, 4.3e-4)
    assert capacity == 58 and {r for r, _ in place} == {0, 1}
    # similar lengths pair up longest with shortest: rows of 43, not 46 (FFD) or 8 rows of 23
    assert pack_rows([23, 23, 22, 22, 21, 21, 20, 20], 64, 1 / 2304)[0] == 43
    # free attention: the padding-free layout, one row of all five (52 tokens, not 5 rows of 12)
    capacity, place = pack_rows([12, 10, 10, 10, 10], 64, 0.0)
    assert capacity == 52 and {r for r, _ in place} == {0}
    # MiniLM's attention cost (1/2304) still favours the one row: 52 x 1.023 < 60 x 1.005;
    # a costly attention keeps a row each: 5 x 12 x 1.6 < 52 x 3.6
    assert pack_rows([12, 10, 10, 10, 10], 64, 1 / 2304)[0] == 52
    capacity, place = pack_rows([12, 10, 10, 10, 10], 64, 0.05)
    assert capacity == 12 and len({r for r, _ in place}) == 5


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_equal_unpacked(model_type: str, attn: str) -> None:
    cfg = load_config(TINY, [f"model.architecture.model_type={model_type}"])
    tokenizer = build_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, ["negative", "positive"], tokenizer).eval()
    model.set_attn_implementation(attn)
    texts = [
        "a good movie",
        "terrible , just terrible and long and boring beyond words",
        "ok",
        "the best film of the year by far",
        "meh .",
    ] * 3
    features = [dict(tokenizer(t)) | {"labels": i % 2} for i, t in enumerate(texts)]
    packed = PackingCollator(tokenizer, 64, attention_cost(model))(features)
    assert packed["input_ids"].shape[0] < len(texts)  # some rows hold several sequences
    plain = Collator(tokenizer)(features)
    plain.pop("labels")
    with torch.no_grad():
        reference = model(**plain).logits
        got = packed_logits(model, packed)
        # the comparison can fail: restarting no positions changes the logits far beyond the tolerance
        wrong = packed_logits(
            model, {**packed, "position_ids": torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"])}
        )
    assert got.shape == reference.shape
    assert (got - reference).abs().max().item() <= 1e-6
    assert (wrong - reference).abs().max().item() > 1e-5


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


@pytest.mark.slow
def test_packed_run_ends_with_the_unpacked_weights(tmp_path: Path, tiny_config: Callable[..., Path]) -> None:
    """tiny-debug has dropout 0, so packing changes only the layout: same gradients, same weights."""
    from finetune.train import main

    common: dict[str, Any] = {
        "data.max_train_samples": 96,
        "data.max_eval_samples": 32,
        "data.group_by_length": False,
        "train.log_every_steps": 1,
        "train.micro_batch_size": 8,
        "train.gradient_accumulation_steps": 2,
    }
    runs = {}
    for packing in (False, True):
        cfg = tiny_config(
            {**common, "data.packing": packing, "run.output_dir": str(tmp_path / f"packing-{packing}")},
            name=f"p{packing}.yaml",
        )
        assert main(["--config", str(cfg)]) == 0
        runs[packing] = tmp_path / f"packing-{packing}"
    w0, w1 = _final_weights(runs[False]), _final_weights(runs[True])
    assert w0.keys() == w1.keys()
    assert max((w0[k] - w1[k]).abs().max().item() for k in w0) <= 1e-5

    def rows(run: Path) -> list[dict[str, Any]]:
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    r0, r1 = rows(runs[False]), rows(runs[True])
    assert [r["loss"] for r in r0] == pytest.approx([r["loss"] for r in r1], abs=1e-5)
    assert r0[0]["loss"] != pytest.approx(r0[-1]["loss"], abs=1e-3)  # it trained (no-op runs would also agree)
    # random (ungrouped) batches of SST-2 are mostly padding; packed rows much less
    pad0 = sum(r["padding_fraction"] for r in r0) / len(r0)
    pad1 = sum(r["padding_fraction"] for r in r1) / len(r1)
    assert pad1 < pad0 / 2, (pad0, pad1)


def test_packing_refuses_what_it_does_not_cover(
    tiny_config: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from finetune.train import main

    assert main(["--config", str(tiny_config({"data.packing": True, "model.compile": True}))]) == 2
    assert "data.packing and model.compile" in capsys.readouterr().err
    cfg = tiny_config(
        {
            "data.packing": True,
            "model.architecture.model_type": "distilbert",
            "model.architecture.dim": 32,
            "model.architecture.n_layers": 1,
            "model.architecture.n_heads": 2,
            "model.architecture.hidden_dim": 64,
        }
    )
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "data.packing supports model types" in err and "distilbert" in err
    assert not (Path(cfg).parent / "run").exists()  # nothing written


@pytest.mark.slow
def test_two_processes_packed_equal_one_process_packed(tmp_path: Path, data_dir: Path) -> None:
    """Each process packs its own share of a global micro-batch: 2 processes x micro 4 end with the
    weights of 1 process x micro 8 (90 rows, global batch 8: a short last window)."""
    from test_multiprocess import _launch_two

    from finetune.train import main

    common = [
        "run.overwrite=true",
        "data.packing=true",
        "data.group_by_length=false",
        "data.max_train_samples=90",
        "data.max_eval_samples=32",
        "train.gradient_accumulation_steps=1",
        "train.eval_every_steps=null",
    ]
    proc = _launch_two(TINY, [f"run.output_dir={tmp_path / 'two'}", "train.micro_batch_size=4", *common])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(["--config", str(TINY), f"run.output_dir={tmp_path / 'one'}", "train.micro_batch_size=8", *common]) == 0
    w1, w2 = _final_weights(tmp_path / "one"), _final_weights(tmp_path / "two")
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-5
