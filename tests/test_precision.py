"""Precision policy: modes, fp32 norms, fp32 loss, bf16 AdamW, dtype audit, non-finite handling,
fp16 loss scaling, torch.compile. CPU only, tiny models."""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

from finetune.core import faults
from finetune.core.errors import UserError
from finetune.model.precision import (
    Bf16AdamW,
    PrecisionMonitor,
    apply_precision_policy,
    check_audit,
    check_supported,
    compile_model,
    compiled_graphs,
    dtype_audit,
    effective_weight,
    find_norm_modules,
    format_audit,
    fp32_cross_entropy,
    fp32_per_sample_loss,
    recompile_limit_hits,
    release_cached_memory,
    stochastic_round_,
)
from finetune.train import main


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(cfg)


def batch(seed: int = 0, n: int = 4, length: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(1, 100, (n, length), generator=g),
        "attention_mask": torch.ones(n, length, dtype=torch.long),
    }


def assert_bf16_true_dtypes(model: nn.Module, extra_norms: tuple[str, ...] = ()) -> None:
    """Every norm parameter and every floating buffer fp32, every other floating parameter bf16."""
    norms = find_norm_modules(model, extra_norms)
    assert norms, "the model has norm modules"
    norm_tensors = {id(t) for m in norms.values() for t in m.parameters()} | {id(t) for t in model.buffers()}
    n_norm = n_other = 0
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if not t.is_floating_point():
            continue
        if id(t) in norm_tensors:
            assert t.dtype == torch.float32, name
            n_norm += 1
        else:
            assert t.dtype == torch.bfloat16, name
            n_other += 1
    assert n_norm >= 2 and n_other >= 10


# ----------------------------------------------------------------------------------------------
# Modes, fp32 loss.


def test_check_supported_refuses_fp16_on_cpu_and_bf16_without_support(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match="fp16 needs a CUDA GPU"):
        check_supported("fp16", torch.device("cpu"))
    check_supported("bf16-true", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    for mode in ("bf16", "bf16-true"):
        with pytest.raises(UserError, match="no bf16 support"):
            check_supported(mode, torch.device("cuda"))
    check_supported("fp16", torch.device("cuda"))


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-true"])
def test_each_mode_loss_is_fp32_and_finite(mode: str) -> None:
    """The loop's path for each mode: policy, the autocast Accelerate would add, fp32 loss."""
    model = tiny_bert()
    apply_precision_policy(model, mode, None)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16")
    with autocast:
        logits = model(**batch()).logits
    assert logits.dtype == (torch.float32 if mode == "fp32" else torch.bfloat16)
    loss = fp32_cross_entropy(logits, torch.tensor([0, 1, 1, 0]))
    assert loss.dtype == torch.float32 and loss.shape == (4,) and torch.isfinite(loss).all()
    loss.sum().backward()
    # fp32 cross-entropy of bf16 logits equals the fp32 computation on the same (upcast) values
    ref = nn.functional.cross_entropy(logits.detach().double(), torch.tensor([0, 1, 1, 0]), reduction="none")
    torch.testing.assert_close(loss.detach().double(), ref, rtol=1e-6, atol=1e-6)


def test_label_smoothing_is_the_mixed_target_cross_entropy_in_fp32() -> None:
    # (1 - e) x -log p_label + e x the mean over classes of -log p_k, written out in float64
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.1, 0.2, 3.0]], dtype=torch.bfloat16)
    labels, e = torch.tensor([0, 1]), 0.2
    loss = fp32_per_sample_loss(logits, labels, "single_label_classification", label_smoothing=e)
    logp = torch.log_softmax(logits.double(), -1)
    ref = (1 - e) * -logp[torch.arange(2), labels] + e * -logp.mean(-1)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)


def test_fp16_autocast_cpu_loss_is_fp32() -> None:
    model = tiny_bert()
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(**batch()).logits
    loss = fp32_cross_entropy(logits, torch.tensor([0, 1, 1, 0]))
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()


# ----------------------------------------------------------------------------------------------
# fp32 norms.


def test_bf16_true_norms_fp32_others_bf16_before_and_after_step() -> None:
    model = tiny_bert()
    names = apply_precision_policy(model, "bf16-true", None)
    assert "bert.embeddings.LayerNorm" in names and len(names) == 5
    assert_bf16_true_dtypes(model)
    opt = Bf16AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = fp32_cross_entropy(model(**batch()).logits, torch.tensor([0, 1, 1, 0])).mean()
    loss.backward()
    assert model.bert.embeddings.LayerNorm.weight.grad.dtype == torch.float32
    assert model.classifier.weight.grad.dtype == torch.bfloat16
    opt.step()
    assert_bf16_true_dtypes(model)
    assert all(s["exp_avg"].dtype == p.dtype for p, s in opt.state.items())
    assert not torch.equal(before["classifier.weight"], model.classifier.weight)


def test_fp32_norm_computes_in_fp32_returns_caller_dtype_and_keeps_keys() -> None:
    ln = nn.LayerNorm(16)
    nn.init.normal_(ln.weight)
    keys = list(ln.state_dict())
    ref = copy.deepcopy(ln)
    apply_precision_policy(ln, "bf16-true", None)
    x = torch.randn(3, 16) * 50 + 200  # large mean: bf16 variance would be badly off
    out = ln(x.bfloat16())
    assert out.dtype == torch.bfloat16 and ln.weight.dtype == torch.float32
    # computed on the fp32 upcast of the bf16 input, then rounded once
    torch.testing.assert_close(out, ref(x.bfloat16().float()).bfloat16(), rtol=0, atol=0)
    assert ln(x).dtype == torch.float32
    assert list(ln.state_dict()) == keys
    # a deep copy runs its own parameters, not the original's
    twin = copy.deepcopy(ln)
    with torch.no_grad():
        twin.weight.zero_()
    assert twin(x).abs().max() < 1e-2 <= ln(x).abs().max()
    # inside autocast the norm still runs in fp32 (CPU autocast would run layer_norm in bf16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(ln(x.bfloat16()), out, rtol=0, atol=0)


class ScaleNorm(nn.Module):
    """A custom norm whose class name no rule knows: covered only through precision.norm_class_names."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))
        self.register_buffer("eps", torch.tensor(1e-5))
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return self.gain * x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()


@pytest.mark.parametrize("listed", [True, False])
def test_custom_norm_class_listed_in_config_stays_fp32(listed: bool) -> None:
    model = tiny_bert()
    model.bert.encoder.layer[0].output.LayerNorm = ScaleNorm(32)
    extra = ["ScaleNorm"] if listed else []
    apply_precision_policy(model, "bf16-true", None, extra)
    sn = model.bert.encoder.layer[0].output.LayerNorm
    want = torch.float32 if listed else torch.bfloat16
    assert sn.gain.dtype == want and sn.eps.dtype == torch.float32  # float buffers stay fp32 in any case
    logits = model(**batch()).logits
    assert sn.seen == [want] and logits.dtype == torch.bfloat16
    audit = dtype_audit(model, "bf16-true", None, extra)
    assert audit["contradictions"] == []
    assert ("bert.encoder.layer.0.output.LayerNorm" in audit["norm_modules"]) == listed
    if listed:
        assert_bf16_true_dtypes(model, ("ScaleNorm",))


def test_batchnorm_buffers_fp32_and_int_counter_untouched() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.GroupNorm(2, 8), nn.Linear(8, 2))
    apply_precision_policy(model, "bf16-true", None)
    bn = model[1]
    assert bn.running_mean.dtype == bn.running_var.dtype == bn.weight.dtype == torch.float32
    assert bn.num_batches_tracked.dtype == torch.int64
    assert model[0].weight.dtype == torch.bfloat16 and model[2].weight.dtype == torch.float32
    out = model(torch.randn(5, 4, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and bn.running_mean.dtype == torch.float32 and int(bn.num_batches_tracked) == 1


def test_fp32_norms_off_and_mixed_modes() -> None:
    model = tiny_bert()
    assert apply_precision_policy(model, "bf16-true", False) == []
    assert model.bert.embeddings.LayerNorm.weight.dtype == torch.bfloat16
    model = tiny_bert()
    assert apply_precision_policy(model, "bf16", None) == []  # mixed: fp32 master weights already
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert len(apply_precision_policy(tiny_bert(), "bf16", True)) == 5


# ----------------------------------------------------------------------------------------------
# dtype audit.


def test_audit_flags_planted_wrong_dtype_tensors() -> None:
    model = tiny_bert()
    apply_precision_policy(model, "bf16-true", None)
    clean = dtype_audit(model, "bf16-true", None)
    assert clean["contradictions"] == []
    assert clean["totals"]["param"]["float32"]["count"] == 10  # 5 LayerNorms x (weight, bias)
    assert clean["by_module_type"]["LayerNorm"]["param:float32"]["bytes"] == 10 * 32 * 4
    assert "Linear" in clean["by_module_type"] and "param:bfloat16" in clean["by_module_type"]["Linear"]
    check_audit(clean, allow_mismatch=False)
    # plant: an fp32 weight that should be bf16, a norm left in bf16, a buffer cast by accident
    model.classifier.weight.data = model.classifier.weight.data.float()
    model.bert.encoder.layer[1].output.LayerNorm.bias.data = model.bert.encoder.layer[
        1
    ].output.LayerNorm.bias.data.bfloat16()
    model.bert.embeddings.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    audit = dtype_audit(model, "bf16-true", None)
    got = {(r["name"], r["kind"], r["dtype"], r["expected"]) for r in audit["contradictions"]}
    assert got == {
        ("classifier.weight", "param", "float32", "bfloat16"),
        ("bert.encoder.layer.1.output.LayerNorm.bias", "param", "bfloat16", "float32"),
        ("bert.embeddings.scale", "buffer", "float64", "float32"),  # buffers: fp32 in every mode
    }
    table = format_audit(audit)
    assert "3 tensor(s) contradict" in table and "classifier.weight" in table
    with pytest.raises(UserError, match="3 tensor\\(s\\) contradict.*classifier.weight"):
        check_audit(audit, allow_mismatch=False)
    check_audit(audit, allow_mismatch=True)  # allowed: a warning only
    json.dumps(audit)


def test_audit_mixed_mode_expects_fp32_master_weights() -> None:
    model = tiny_bert()
    model.classifier.half()
    audit = dtype_audit(model, "bf16", None)
    assert {r["name"] for r in audit["contradictions"]} == {"classifier.weight", "classifier.bias"}
    check_audit(audit, allow_mismatch=False)  # outside bf16-true: warned, not refused


# ----------------------------------------------------------------------------------------------
# bf16 AdamW.


def test_bf16_adamw_matches_torch_adamw_on_fp32_params() -> None:
    torch.manual_seed(0)
    w = torch.randn(32, 16)
    a, b = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    oa = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1)
    ob = Bf16AdamW([b], lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(32, 16)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step(), ob.step()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_adamw_keeps_small_steps_that_plain_rounding_loses() -> None:
    """A consistent gradient at lr 5e-5 on O(1) weights: each step is far below half a bf16 ulp."""
    torch.manual_seed(0)
    w = (torch.randn(64, 64) + 2).bfloat16().float()
    g = torch.randn(64, 64)
    ref = nn.Parameter(w.clone())
    oref = torch.optim.AdamW([ref], lr=5e-5, weight_decay=0.0)
    runs = {}
    for update in ("plain", "kahan", "stochastic"):
        p = nn.Parameter(w.bfloat16())
        runs[update] = (p, Bf16AdamW([p], lr=5e-5, weight_decay=0.0, update=update))
    for _ in range(30):
        ref.grad = g.clone()
        oref.step()
        for p, o in runs.values():
            p.grad = g.bfloat16()
            o.step()
    d = ref.detach() - w
    # share of the fp32 update each variant applied (projection on the fp32 update)
    kept = {u: ((effective_weight(o, p) - w) * d).sum().item() / (d * d).sum().item() for u, (p, o) in runs.items()}
    err = {u: ((effective_weight(o, p) - ref.detach()).norm() / d.norm()).item() for u, (p, o) in runs.items()}
    assert abs(kept["plain"]) < 0.1 and err["plain"] > 0.9  # nearly every update rounded away
    assert abs(kept["kahan"] - 1) < 0.02 and err["kahan"] < 0.02  # exact up to the last rounding
    assert abs(kept["stochastic"] - 1) < 0.2  # unbiased on average; each entry is noisy (err ~ 1 here)
    for p, o in runs.values():
        assert p.dtype == torch.bfloat16 and o.state[p]["exp_avg"].dtype == torch.bfloat16
    assert runs["kahan"][1].state[runs["kahan"][0]]["kahan_comp"].dtype == torch.bfloat16


def test_stochastic_round_is_unbiased_and_exact_on_representable_values() -> None:
    torch.manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2**-10)  # an eighth of the way from 1 to the next bf16, 1 + 2^-7
    out = stochastic_round_(torch.empty_like(x, dtype=torch.bfloat16), x)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(out.float().mean().item() - x[0].item()) < 2e-5
    neg = stochastic_round_(torch.empty_like(x, dtype=torch.bfloat16), -x)
    assert abs(neg.float().mean().item() + x[0].item()) < 2e-5
    exact = torch.tensor([0.5, -3.0, 1024.0, float("inf")])
    assert torch.equal(stochastic_round_(torch.empty(4, dtype=torch.bfloat16), exact).float(), exact)


def test_bf16_adamw_state_survives_accelerate_checkpoint(tmp_path: Path) -> None:
    """bf16-true round trip through Accelerate's save_state/load_state: dtypes and values."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = tiny_bert()
    apply_precision_policy(model, "bf16-true", None)
    opt = Bf16AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    fp32_cross_entropy(model(**batch()).logits, torch.tensor([0, 1, 1, 0])).mean().backward()
    opt.step()
    acc.save_state(str(tmp_path / "ck"), safe_serialization=True)
    on_disk = load_file(tmp_path / "ck" / "model.safetensors")
    assert on_disk["bert.embeddings.LayerNorm.weight"].dtype == torch.float32
    assert on_disk["classifier.weight"].dtype == torch.bfloat16
    assert not any("_orig_mod" in k for k in on_disk)

    acc2 = Accelerator(cpu=True)
    fresh = tiny_bert(seed=1)
    apply_precision_policy(fresh, "bf16-true", None)
    opt2 = Bf16AdamW(fresh.parameters(), lr=1e-3)
    fresh, opt2 = acc2.prepare(fresh, opt2)
    acc2.load_state(str(tmp_path / "ck"))
    assert_bf16_true_dtypes(fresh)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), n
    state = opt2.state[fresh.classifier.weight]
    assert state["exp_avg"].dtype == state["kahan_comp"].dtype == torch.bfloat16
    assert torch.equal(state["kahan_comp"], opt.state[model.classifier.weight]["kahan_comp"])


# ----------------------------------------------------------------------------------------------
# fp16 loss scaling (CPU autocast + GradScaler, counted the way the loop counts it).


def test_fp16_scaler_skips_inf_gradient_step_and_counts_it() -> None:
    from accelerate.optimizer import AcceleratedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    # the loop reads accelerator.optimizer_step_was_skipped = AcceleratedOptimizer.step_was_skipped
    opt = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), device_placement=False, scaler=scaler)
    monitor = PrecisionMonitor("fp16", "stop", scaler=scaler)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    history = []
    for planted in (False, True, False):
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
        assert logits.dtype == torch.float16
        loss = fp32_cross_entropy(logits, y).mean()
        assert loss.dtype == torch.float32
        scaler.scale(loss).backward()
        if planted:
            model[0].weight.grad[0, 0] = float("inf")
        before = model[0].weight.detach().clone()
        assert monitor.step_ok(None, loss, len(history) + 1)  # fp16: the scaler decides, never the monitor
        opt.step()
        monitor.after_step(opt.step_was_skipped)
        history.append((opt.step_was_skipped, torch.equal(before, model[0].weight), monitor.fields()))
        opt.zero_grad()
    assert [h[0] for h in history] == [False, True, False]
    assert [h[1] for h in history] == [False, True, False]  # the inf step left the weights alone
    assert history[0][2] == {"loss_scale": 1024.0, "fp16_skipped_steps": 0}
    assert history[1][2] == {"loss_scale": 512.0, "fp16_skipped_steps": 1}  # backoff 0.5
    assert history[2][2]["fp16_skipped_steps"] == 1


def test_monitor_stops_or_skips_on_nonfinite(tmp_path: Path) -> None:
    finite, inf = torch.tensor(1.0), torch.tensor(float("inf"))
    stop = PrecisionMonitor("bf16-true", "stop", last_checkpoint=lambda: None)
    assert stop.step_ok(torch.tensor(2.0), finite, 1)
    stop.raise_if_nonfinite()  # nothing bad yet
    # stop defers: the step is taken, the first bad one recorded on the device and raised at the next check
    assert stop.step_ok(torch.tensor(float("nan")), finite, 3) and stop.step_ok(torch.tensor(1.0), inf, 4)
    with pytest.raises(UserError, match="non-finite values at optimizer step 3 .*no checkpoint was written yet"):
        stop.raise_if_nonfinite()
    late = PrecisionMonitor("bf16", "stop")
    assert late.step_ok(None, finite, 1) and late.step_ok(torch.tensor(1.0), inf, 2)
    with pytest.raises(UserError, match="step 2 \\(loss inf"):
        late.raise_if_nonfinite()
    skip = PrecisionMonitor("fp32", "skip")
    assert not skip.step_ok(None, inf, 1) and skip.fields() == {"nonfinite_skipped_steps": 1}


def test_release_cached_memory_only_on_cuda_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    release_cached_memory(True, torch.device("cpu"))
    release_cached_memory(False, torch.device("cuda"))
    assert calls == []
    release_cached_memory(True, torch.device("cuda"))
    assert calls == [1]


# ----------------------------------------------------------------------------------------------
# torch.compile.


@pytest.mark.slow
def test_compile_checkpoint_keys_load_both_ways_and_strip_orig_mod() -> None:
    torch._dynamo.reset()
    compiled = tiny_bert()
    apply_precision_policy(compiled, "bf16-true", None)
    compile_model(compiled, backend="aot_eager")
    out = compiled(**batch()).logits
    assert out.dtype == torch.bfloat16 and compiled_graphs() >= 1
    sd = compiled.state_dict()
    assert not any("_orig_mod" in k for k in sd)
    plain = tiny_bert(seed=1)
    apply_precision_policy(plain, "bf16-true", None)
    plain.load_state_dict(sd)  # compiled -> uncompiled (strict)
    torch.testing.assert_close(plain(**batch()).logits, out)
    compiled.load_state_dict(tiny_bert(seed=2).state_dict())  # uncompiled -> compiled (dtypes kept)
    assert_bf16_true_dtypes(compiled)
    # a checkpoint written through a torch.compile(model) wrapper elsewhere: `_orig_mod.` keys
    wrapped_sd = torch.compile(plain, backend="eager").state_dict()
    assert all(k.startswith("_orig_mod.") for k in wrapped_sd)
    fresh = tiny_bert(seed=3)
    apply_precision_policy(fresh, "bf16-true", None)
    fresh.load_state_dict(wrapped_sd)
    assert torch.equal(fresh.classifier.weight, plain.classifier.weight)


class TwoLayer(nn.Module):
    """Defined here: dynamo does not trace a top-level frame inside torch.nn (nn.Sequential.forward)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lin1, self.norm, self.lin2 = nn.Linear(dim, dim), nn.LayerNorm(dim), nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.norm(self.lin1(x)))


def test_recompile_limit_hit_is_detected_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    model = TwoLayer(4)
    compile_model(model, backend="eager", dynamic=False)
    monitor = PrecisionMonitor("fp32", "stop", compiled=True)
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in range(1, 6):  # static shapes: one graph per batch size until the limit
            model(torch.randn(n, 4))
    assert recompile_limit_hits() >= 1
    with caplog.at_level(logging.WARNING, logger="finetune"):
        logging.getLogger("finetune").propagate = True
        fields = monitor.fields()
    assert fields["compile_graphs"] == 2 and fields["compile_recompile_limit_hits"] >= 1
    assert "recompile_limit" in caplog.text


@pytest.mark.slow
def test_inductor_compiles_bf16_true_model_with_fp32_norms() -> None:
    """The one inductor test: a small bf16 model with an fp32 LayerNorm, forward and backward."""
    torch.manual_seed(0)
    model = TwoLayer(16)
    apply_precision_policy(model, "bf16-true", None)
    eager = copy.deepcopy(model)
    compile_model(model, backend="inductor")
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    out = model(x)
    assert out.dtype == torch.bfloat16 and compiled_graphs() >= 1
    torch.testing.assert_close(out, eager(x), rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert model.norm.weight.grad.dtype == torch.float32 and model.lin1.weight.grad.dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# The loop, end to end (tiny model, small slices).


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_bf16_true_audit_files_and_checkpoint_dtypes(tiny_config: Callable[..., Path]) -> None:
    cfg = tiny_config(
        {
            "precision.mode": "bf16-true",
            "data.max_train_samples": 96,
            "train.max_steps": 2,
            "checkpoint.every_steps": 2,
            "data.max_eval_samples": 16,
        }
    )
    assert main(["--config", str(cfg)]) == 0
    run = cfg.parent / "run"
    audit = json.loads((run / "dtype_audit.json").read_text())
    assert audit["mode"] == "bf16-true" and audit["contradictions"] == [] and len(audit["norm_modules"]) == 5
    ck = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert json.loads((ck / "dtype_audit.json").read_text())["totals"] == audit["totals"]
    for path in (ck / "model.safetensors", run / "final" / "model.safetensors"):
        sd = load_file(path)
        assert {k for k, v in sd.items() if v.dtype == torch.float32} == {k for k in sd if "LayerNorm" in k}
        assert all(v.dtype == torch.bfloat16 for k, v in sd.items() if "LayerNorm" not in k and v.is_floating_point())
    assert "dtype audit (bf16-true" in (run / "train.log").read_text()
    # loading final/ must not cast the fp32 norms down: its config asks loaders for float32 (lossless upcast)
    from transformers import AutoModelForSequenceClassification

    loaded = AutoModelForSequenceClassification.from_pretrained(run / "final")
    assert {p.dtype for n, p in loaded.named_parameters() if "LayerNorm" in n} == {torch.float32}


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_planted_inf_loss_stops_or_skips_and_keeps_checkpoint(
    policy: str, tiny_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny_config(
        {
            "train.nonfinite": policy,
            "data.max_train_samples": 96,
            "train.max_steps": 3,
            "checkpoint.every_steps": 2,
            "train.log_every_steps": 1,
            "data.max_eval_samples": 16,
        }
    )
    monkeypatch.setenv(faults.ENV, "nonfinite_at_step:3")
    run = cfg.parent / "run"
    code = main(["--config", str(cfg)])
    step2 = run / "checkpoints" / "step_00000002"
    saved = load_file(step2 / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in saved.values() if v.is_floating_point())
    if policy == "stop":
        assert code == 2
        # the progress bar shares stderr (no newline before the message)
        errors = [line[line.index("error:") :] for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1
        err = errors[0]
        assert (
            err.startswith("error: training stopped: non-finite values at optimizer step 3")
            and "step_00000002 is intact" in err
        )
        assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002"]
        model = tiny_bert()  # loadable: the keys and shapes of the run's model (vocab from the tokenizer)
        assert saved["classifier.weight"].shape == model.classifier.weight.shape
    else:
        assert code == 0
        rows = _rows(run)
        assert [r.get("nonfinite_skipped_steps", 0) for r in rows if "loss" in r] == [0, 0, 1]
        assert all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in rows if "loss" in r)
        final = load_file(run / "final" / "model.safetensors")
        assert all(torch.isfinite(v).all() for v in final.values() if v.is_floating_point())
        # the skipped step changed nothing: step 3's weights are step 2's
        last = load_file(run / "checkpoints" / "step_00000003" / "model.safetensors")
        assert all(torch.equal(last[k], saved[k]) for k in saved)


@pytest.mark.slow
def test_compiled_run_records_graphs_and_writes_clean_keys(tiny_config: Callable[..., Path]) -> None:
    """An epoch of real SST-2 lengths (max_length 128, length-grouped) stays a few graphs."""
    cfg = tiny_config(
        {
            "model.compile": True,
            "model.compile_backend": "aot_eager",
            "data.max_length": 128,
            "data.max_train_samples": 160,
            "checkpoint.every_steps": 2,
            "train.log_every_steps": 1,
            "train.eval_every_steps": 2,
            "data.max_eval_samples": 32,
        }
    )
    assert main(["--config", str(cfg)]) == 0
    run = cfg.parent / "run"
    rows = _rows(run)
    assert len(rows) >= 6 and all("compile_graphs" in r for r in rows)
    graphs = rows[-1]["compile_graphs"]
    assert 1 <= graphs <= 8 and not any("compile_recompile_limit_hits" in r for r in rows)
    ck = sorted((run / "checkpoints").glob("step_*"))[-1]
    for path in (ck / "model.safetensors", run / "final" / "model.safetensors"):
        sd = load_file(path)
        assert not any("_orig_mod" in k for k in sd)
    # the compiled run's checkpoint loads strictly into an uncompiled model of the same shape
    from finetune.config.files import load_config
    from finetune.model.load import build_model, build_tokenizer

    c = load_config(cfg)
    model = build_model(c, ["negative", "positive"], build_tokenizer(c))
    model.load_state_dict(load_file(ck / "model.safetensors"))


@pytest.mark.parametrize("update", ["kahan", "stochastic", "plain"])
def test_bf16_adamw_chunked_update_equals_whole_tensor_update(update: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slicing a large tensor's update (bounded fp32 temporaries) changes nothing: the weights and
    every state buffer are bit for bit those of the whole-tensor update. Slices draw the random
    bits of stochastic rounding in another order, so the rounding is made deterministic here
    (round to nearest) to compare the arithmetic exactly."""
    import finetune.model.precision as precision

    monkeypatch.setattr(precision, "stochastic_round_", lambda dst, src: dst.copy_(src))
    torch.manual_seed(0)
    start = torch.randn(3000, 7).to(torch.bfloat16)
    grads = [torch.randn(3000, 7).to(torch.bfloat16) for _ in range(3)]
    results = []
    for chunk in (1 << 20, 1024):  # whole tensor (21,000 elements) vs 21 slices, the last one short
        monkeypatch.setattr(Bf16AdamW, "CHUNK", chunk)
        p = torch.nn.Parameter(start.clone())
        opt = Bf16AdamW([p], lr=1e-3, weight_decay=0.1, update=update)
        torch.manual_seed(1)  # the same random stream for the stochastic roundings
        for g in grads:
            p.grad = g.clone()
            opt.step()
        results.append((p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}))
    (p1, s1), (p2, s2) = results
    assert not torch.equal(p1, start)  # it moved
    assert torch.equal(p1, p2)
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def _reference_adamw_step(p: torch.Tensor, state: dict[str, torch.Tensor], group: dict[str, Any]) -> None:
    """One Bf16AdamW step of one tensor, written per tensor in plain torch (no foreach, no buckets, no slices),
    with round-to-nearest write-backs: the reference the bucketed step must equal bit for bit."""
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    if not state:
        state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        if p.dtype == torch.bfloat16:
            state["kahan_comp"] = torch.zeros_like(p)
    state["step"] += 1
    t = float(state["step"])
    grad = p.grad.float()
    m = state["exp_avg"].float().lerp_(grad, 1 - beta1)
    v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    state["exp_avg"].copy_(m)
    state["exp_avg_sq"].copy_(v)
    denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
    p32 = p.detach().float()
    delta = (m / denom).mul_(-lr / (1 - beta1**t)).add_(p32, alpha=-lr * wd)
    if p.dtype == torch.float32:
        p.data.add_(delta)
        return
    delta.add_(state["kahan_comp"])
    p.data.copy_(p32 + delta)
    state["kahan_comp"].copy_(delta.sub_(p.detach().float() - p32))


def test_bf16_adamw_foreach_buckets_equal_a_per_tensor_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16-true's optimizer step runs `torch._foreach_*` over buckets of tensors; a plain per-tensor loop
    gives the same weights and state bit for bit over several steps: bf16 and fp32 (norm) parameters mixed,
    two groups with their own lr and weight decay, a tensor larger than a bucket (sliced), one without a
    gradient."""
    import finetune.model.precision as precision

    monkeypatch.setattr(precision, "stochastic_round_", lambda dst, src: dst.copy_(src))
    monkeypatch.setattr(Bf16AdamW, "CHUNK", 1000)
    torch.manual_seed(0)
    shapes = [(40, 30), (30,), (7,), (5, 3), (2500,), (12,)]  # 1,200 and 2,500 elements: sliced
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    start = [torch.randn(s).to(d) for s, d in zip(shapes, dtypes, strict=True)]
    ours = [nn.Parameter(x.clone()) for x in start]
    ref = [nn.Parameter(x.clone()) for x in start]
    groups = [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.0}]
    opt = Bf16AdamW([{"params": ours[:3], **groups[0]}, {"params": ours[3:], **groups[1]}], lr=1.0, update="kahan")
    ref_state: list[dict[str, torch.Tensor]] = [{} for _ in ref]
    for step in range(4):
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            if i == 5 and step == 1:  # no gradient this step: not updated, its step count lags
                a.grad = b.grad = None
                continue
            g = torch.randn(a.shape).to(a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        for i, b in enumerate(ref):
            if b.grad is not None:
                _reference_adamw_step(b, ref_state[i], {**groups[i >= 3], "betas": (0.9, 0.999), "eps": 1e-8})
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert not torch.equal(a.detach(), start[i])
        assert a.dtype == dtypes[i] and torch.equal(a.detach(), b.detach()), i
        state = opt.state[a]
        assert state.keys() == ref_state[i].keys(), i
        assert all(torch.equal(state[k], ref_state[i][k]) for k in state), i
