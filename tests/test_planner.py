"""Memory planner: prediction vs a real MemTracker measurement and vs a plain-torch step measured here, the CLI
and auto micro-batch (the out-of-memory retry that keeps the effective batch is tested in tests/test_window.py)."""

from __future__ import annotations

import json
import os
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from finetune.config.files import load_config
from finetune.core.errors import UserError
from finetune.memory.peak import CATEGORIES, CUDA_ALLOCATOR_FRACTION, CUDA_CONTEXT_BYTES
from finetune.memory.planner import plan, predict_peak

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from benchlib import measure_real  # noqa: E402  (the real-tensor reference lives with the benchmarks)


def _real_rows(cfg: Any, n: int) -> tuple[list[str], list[int], list[str]]:
    from finetune.data.reading import load_raw_splits

    raw = load_raw_splits(cfg)
    texts = raw.train["text"][:n]
    labels = [raw.label_names.index(raw.raw_to_name[v]) for v in raw.train["label"][:n]]
    return texts, labels, raw.label_names


# ----------------------------------------------------------------------------------------------
# An independent reference: a plain torch/transformers training window, its live tensor bytes counted here.


class LiveStorageBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their peak, after every op (torch's CPU allocator does not cache:
    a storage is freed with its last tensor; scratch memory inside a kernel is not seen). Storages alive on entry
    (`held`: weights, optimizer state) count from the start; a storage an op returns counts once, until freed."""

    def __init__(self, held: list[torch.Tensor]) -> None:
        super().__init__()
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in held}
        self.alive = set(storages)
        self.live = self.peak = sum(storages.values())

    def _freed(self, key: int, nbytes: int) -> None:
        self.alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.alive:
                storage = t.untyped_storage()
                self.alive.add(storage._cdata)
                self.live += storage.nbytes()
                weakref.finalize(storage, self._freed, storage._cdata, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def plain_torch_peak(cfg: Any, tok: Any, micro: int, accumulation: int, padded: bool) -> tuple[int, int]:
    """(peak bytes, weight bytes) of the second optimizer window of cfg's model written in plain torch and
    transformers, none of finetune's harness: the model from its architecture, fused AdamW (training's on CPU),
    micro-batches of `data.max_length` random tokens, fp32 loss, clipping at 1, step, zero_grad(set_to_none).

    `padded`: the last row's last token is padding. transformers drops a mask of all ones (then CPU SDPA runs
    its flash kernel, which keeps no L x L probabilities); any padding keeps it, as fake tensors always do."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    arch = dict(cfg.model.architecture)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch, vocab_size=len(tok), num_labels=2)
    config.pad_token_id = tok.pad_token_id
    L, steps, bf16 = cfg.data.max_length, min(accumulation, 2), cfg.precision.mode == "bf16"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(config)
        if cfg.model.gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        model.train()

        def batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            ids = torch.randint(1, len(tok), (micro, L))  # no pad id: decoders pool at the last non-pad token
            mask = torch.ones(micro, L, dtype=torch.long)
            if padded:
                ids[-1, -1], mask[-1, -1] = tok.pad_token_id, 0
            inputs = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in tok.model_input_names:
                inputs["token_type_ids"] = torch.zeros(micro, L, dtype=torch.long)
            return inputs, torch.randint(0, 2, (micro,))

        def window(n: int) -> None:
            batches = [batch() for _ in range(n)]
            for inputs, labels in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logits = model(**inputs).logits
                loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum") / (micro * n)
                loss.backward()
                del logits, loss
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        window(1)  # creates the optimizer state; the second window is the one measured
        weights = [*model.parameters(), *model.buffers()]
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        with LiveStorageBytes([*weights, *state]) as counter:
            window(steps)
    return counter.peak, sum(w.untyped_storage().nbytes() for w in weights)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,micro,accumulation",
    [
        ([], 64, 1),  # fp32, no checkpointing, one micro-batch per window
        (
            ["precision.mode=bf16", "model.gradient_checkpointing=true"],
            32,
            2,
        ),  # bf16 autocast + checkpointing, accumulation
    ],
)
def test_prediction_within_5_percent_of_a_real_step(
    data_dir: Path, overrides: list[str], micro: int, accumulation: int
) -> None:
    """The plan against its own harness on real tensors (`measure_real`: fake and real tensors alike), and
    against a window written in plain torch whose live tensor bytes are counted here (`plain_torch_peak`)."""
    from finetune.model.load import build_tokenizer

    cfg = load_config(TINY, ["data.max_length=128", *overrides])
    tok = build_tokenizer(cfg)
    texts, labels, names = _real_rows(cfg, micro)
    predicted = predict_peak(cfg, micro, accumulation, tok, names)
    measured = measure_real(cfg, micro, accumulation, tok, names, texts, labels)
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes
    plain, weights = plain_torch_peak(cfg, tok, micro, accumulation, padded=True)
    assert predicted.categories["parameters"] == weights  # the same model
    # Measured: the plan equals the plain window to the byte in both settings (torch 2.13, transformers 5.23):
    # both sum the storages alive after each op. 2% leaves room for an op the two count differently after an
    # upgrade (a storage resized in place, a view of a fresh buffer); what a planning error costs is larger:
    # attention without its mask alone takes 6.2% (bf16, checkpointing) and 19% (fp32) off the peak (below).
    assert abs(predicted.peak_bytes - plain) <= 0.02 * plain, (predicted.peak_bytes, plain)
    # every row max_length tokens and no padding at all: the mask is dropped, and the plan, which cannot see
    # the mask's values on fake tensors, is an upper bound
    unmasked, _ = plain_torch_peak(cfg, tok, micro, accumulation, padded=False)
    assert unmasked < min(plain, predicted.peak_bytes)
    # the window measured is the second one: AdamW's two moments exist (fp32, same size as the weights)
    assert predicted.categories["optimizer_state"] >= 2 * predicted.categories["parameters"] * 0.99
    assert predicted.categories["activations"] > 0.1 * predicted.peak_bytes  # activations matter at this size
    assert sum(predicted.categories.values()) == predicted.peak_bytes


@pytest.mark.slow
def test_frozen_parameters_and_lora_are_planned(data_dir: Path) -> None:
    """MemTracker's hooks fail on frozen parameters and peft fails under FakeTensorMode: both are worked around."""
    from finetune.model.load import build_tokenizer

    base = load_config(TINY, ["data.max_length=128"])
    tok = build_tokenizer(base)
    texts, labels, names = _real_rows(base, 32)
    full = predict_peak(base, 32, 1, tok, names)
    frozen = predict_peak(
        load_config(TINY, ["data.max_length=128", "model.freeze_embeddings=true", "model.gradient_checkpointing=true"]),
        32,
        1,
        tok,
        names,
    )
    lora_cfg = load_config(TINY, ["data.max_length=128", "model.lora={r: 4}", "model.gradient_checkpointing=true"])
    lora = predict_peak(lora_cfg, 32, 2, tok, names)
    lora_real = measure_real(lora_cfg, 32, 2, tok, names, texts, labels)
    assert abs(lora.peak_bytes - lora_real.peak_bytes) <= 0.05 * lora_real.peak_bytes
    # the tiny model is mostly its 30k x 32 embedding: frozen, it has no Adam state
    assert frozen.categories["optimizer_state"] < 0.2 * full.categories["optimizer_state"]
    assert lora.categories["optimizer_state"] < 0.05 * full.categories["optimizer_state"]
    assert lora.peak_bytes < full.peak_bytes


@pytest.mark.slow
def test_optimizers_change_the_state_category(data_dir: Path) -> None:
    from finetune.model.load import build_tokenizer

    # micro 64 x 128 tokens: the peak is in backward (activations dominate), so the optimizer
    # state at the peak is the persistent state (during step() its temporaries would count too)
    over = ["data.max_length=128"]
    cfg = load_config(TINY, over)
    tok = build_tokenizer(cfg)
    names = ["negative", "positive"]
    adamw_m = predict_peak(cfg, 64, 1, tok, names)
    assert adamw_m.categories["activations"] > adamw_m.categories["optimizer_state"]
    adamw = adamw_m.categories["optimizer_state"]
    adafactor = predict_peak(load_config(TINY, [*over, "train.optimizer=adafactor"]), 64, 1, tok, names).categories[
        "optimizer_state"
    ]
    sgd = predict_peak(load_config(TINY, [*over, "train.optimizer=sgd"]), 64, 1, tok, names).categories[
        "optimizer_state"
    ]
    assert adafactor < 0.1 * adamw  # factored second moment, no first moment
    assert sgd == 0  # momentum 0: no state
    with pytest.raises(UserError, match="adamw8bit.*CUDA"):
        plan(
            load_config(TINY, ["train.optimizer=adamw8bit"]),
            device="cpu",
            micro_sizes=[4],
            tokenizer=tok,
            label_names=names,
        )
    eight = plan(
        load_config(TINY, [*over, "train.optimizer=adamw8bit"]),
        device="cuda",
        micro_sizes=[64],
        tokenizer=tok,
        label_names=names,
    )
    assert (
        0.2 * adamw < eight.rows[0].categories["optimizer_state"] < 0.3 * adamw
    )  # 2 bytes (+ absmax) per parameter instead of 8


@pytest.mark.slow
def test_plan_cli_json_and_cuda_margin(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from finetune.cli import main

    assert (
        main(
            ["plan", "--config", str(TINY), "data.max_length=128", "--budget-gb", "0.025", "--device", "cpu", "--json"]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [r["micro_batch_size"] for r in rows] == [1, 2, 4, 8, 16, 32]  # effective batch 16 x 2
    assert all(r["micro_batch_size"] * r["gradient_accumulation_steps"] == 32 for r in rows)
    for r in rows:
        assert {f"{c}_bytes" for c in CATEGORIES} <= set(r)
        assert r["peak_bytes_with_margin"] == r["peak_bytes"]  # no margin on CPU
        assert r["fits"] == (r["peak_bytes"] <= 0.025 * 2**30)
    peaks = [r["peak_bytes"] for r in rows]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]
    assert any(r["fits"] for r in rows) and not all(r["fits"] for r in rows)  # the budget splits the ladder
    assert (
        main(["plan", "--config", str(TINY), "data.max_length=64", "--device", "cuda", "--micro", "8", "--json"]) == 0
    )
    (row,) = json.loads(capsys.readouterr().out)
    assert row["peak_bytes_with_margin"] == row["peak_bytes"] + CUDA_CONTEXT_BYTES + int(
        CUDA_ALLOCATOR_FRACTION * row["peak_bytes"]
    )
    assert row["fits"] is None  # no budget given
    assert main(["plan", "--config", str(TINY), "--micro", "5"]) == 2  # does not divide the effective batch
    assert "micro" in capsys.readouterr().err


@pytest.mark.slow
def test_auto_micro_batch_picks_a_fitting_setting(tiny_config: Callable[..., Path], tmp_path: Path) -> None:
    from finetune.model.load import build_tokenizer
    from finetune.train import main

    budget_gb = 0.025
    path = tiny_config(
        {
            "train.micro_batch_size": "auto",
            "train.gradient_accumulation_steps": ...,
            "train.batch_size": 32,
            "memory.budget_gb": budget_gb,
            "data.max_length": 128,
            "data.max_train_samples": 64,
            "data.max_eval_samples": 16,
        }
    )
    cfg = load_config(path)
    p = plan(cfg, device="cpu", tokenizer=build_tokenizer(cfg), label_names=["negative", "positive"])
    best = p.best()
    assert best is not None and best.fits and best.micro_batch_size < 32  # the budget rules out the biggest
    assert main(["--config", str(path)]) == 0
    log = (tmp_path / "run" / "train.log").read_text()
    assert (
        f"micro-batch {best.micro_batch_size} x accumulation {best.gradient_accumulation_steps} = effective batch 32"
        in log
    )


@pytest.mark.slow
def test_cuda_plan_counts_attention_as_cuda_kernels_keep_it() -> None:
    """A CUDA plan keeps no L x L attention probabilities (flash / memory-efficient kernels) and
    counts two cuBLAS workspaces; a CPU plan of the same step keeps them: with attention dropout
    the CPU's SDPA takes its math path (its flash kernel has no dropout), as for MiniLM."""
    from finetune.memory.peak import MiB
    from finetune.memory.planner import predict_peak
    from finetune.model.load import build_tokenizer

    cfg = load_config(TINY, ["data.max_length=64", "model.architecture.attention_probs_dropout_prob=0.1"])
    tok = build_tokenizer(cfg)
    names = ["negative", "positive"]
    B, L = 16, 64
    cpu = predict_peak(cfg, B, 1, tok, names)
    cuda = predict_peak(cfg, B, 1, tok, names, device="cuda")
    arch = cfg.model.architecture or {}
    probabilities = arch["num_hidden_layers"] * B * arch["num_attention_heads"] * L * L * 4  # fp32, saved by softmax
    assert cpu.categories["activations"] - cuda.categories["activations"] >= 0.9 * probabilities
    from finetune.memory.peak import cublas_workspace_bytes

    # two workspaces: 2 x 32 MiB (Hopper, or a CPU planning for CUDA) unless CUBLAS_WORKSPACE_CONFIG says otherwise
    assert (
        cuda.categories["cublas_workspace"] == cublas_workspace_bytes() > 0 and cpu.categories["cublas_workspace"] == 0
    )
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not torch.cuda.is_available():
        assert cublas_workspace_bytes() == 64 * MiB


@pytest.mark.slow
def test_a_deep_decoder_without_checkpointing_is_planned_as_measured() -> None:
    """A 16-layer decoder is planned at 2 and 4 layers and extrapolated (a plan that
    gets this wrong puts Qwen2.5-0.5B without checkpointing at its checkpointed peak, 0.81 of the allocator's). At 2
    and 4 layers this window peaks below the layer stack (the 30k-row embedding's dense gradient), at 16 in the
    backward through the layers; the truth is MemTracker on real tensors of all 16 layers, no extrapolation, and
    the same window in plain torch (`plain_torch_peak`)."""
    from finetune.memory.peak import measure_window
    from finetune.memory.planner import build_for_planning, fake_batch_factory, with_layers
    from finetune.model.load import build_tokenizer

    arch = (
        "{model_type: qwen2, hidden_size: 64, num_hidden_layers: 16, num_attention_heads: 2, "
        "num_key_value_heads: 1, intermediate_size: 128, max_position_embeddings: 64}"
    )
    cfg = load_config(TINY, [f"model.architecture={arch}", "data.max_length=32"])
    tok, names, micro = build_tokenizer(cfg), ["negative", "positive"], 8
    planned = predict_peak(cfg, micro, 2, tok, names)
    with torch.random.fork_rng(devices=[]):
        model, optimizer = build_for_planning(cfg, names, tok)
        batches = fake_batch_factory(tok, micro, 32, 2)  # real tensors here: every row 32 tokens, as planned
        measured = measure_window(model, optimizer, batches, 2, "fp32", cfg.train.max_grad_norm)
    assert abs(planned.peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes, (planned, measured)
    # equal to the byte, extrapolated from 2 and 4 layers; 2% as in test_prediction_within_5_percent_of_a_real_step
    plain, weights = plain_torch_peak(cfg, tok, micro, 2, padded=True)
    assert abs(planned.peak_bytes - plain) <= 0.02 * plain and planned.categories["parameters"] == weights

    def peaking(phases: dict[str, dict[str, int]]) -> str:
        return max(phases, key=lambda name: sum(phases[name].values()))

    shallow = predict_peak(with_layers(cfg, 2), micro, 2, tok, names)
    assert peaking(shallow.phases) == "embeddings" and peaking(measured.phases) == peaking(planned.phases) == "layers"
    # checkpointing keeps one input per layer: the same model plans lower with it (on the GPU both planned alike)
    checkpointed = load_config(
        TINY, [f"model.architecture={arch}", "data.max_length=32", "model.gradient_checkpointing=true"]
    )
    assert predict_peak(checkpointed, micro, 2, tok, names).peak_bytes < 0.9 * planned.peak_bytes
