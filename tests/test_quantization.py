"""QLoRA: `model.quantization` through bitsandbytes on this CPU, for real.

Tiny random models of every family (tests/test_families.py) are quantized (4-bit NF4 and 8-bit)
and take a LoRA training step; a whole run through `main()` exports final/ as the unquantized
base with the adapters merged, which a pipeline loads and which equals peft's unmerged adapter
on the fp32 base (the independent reference); the one-line errors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import bitsandbytes as bnb
import pytest
import torch
from safetensors.torch import load_file
from test_families import FAMILIES, NAMES, TEXTS, _sentences, family_config, stopped_and_resumed, train_tokenizer

from finetune.config.files import load_config
from finetune.core.errors import UserError
from finetune.model.load import build_model, build_tokenizer, choose_pad_token, head_names, quiet_peft_deprecation
from finetune.train import main

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    texts = _sentences(data_dir)
    return {k: train_tokenizer(texts, k, root / k) for k in ("decoder", "decoder_eos", "encoder")}


def _quantized(family: str, kind: str, tokenizers: dict[str, Path], tmp_path: Path) -> tuple[Any, Any]:
    cfg = load_config(
        family_config(tmp_path, family, tokenizers, **{"model.lora": {"r": 4}, "model.quantization": kind})
    )
    tok = build_tokenizer(cfg)
    choose_pad_token(tok, [__import__("datasets").Dataset.from_dict(dict(tok(TEXTS)))])
    torch.manual_seed(0)
    return tok, build_model(cfg, NAMES, tok)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_quantizes_its_base_and_keeps_head_and_norms(
    family: str, tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    kind = "8bit" if family in ("distilbert", "qwen2") else "4bit"
    layer = bnb.nn.Linear8bitLt if kind == "8bit" else bnb.nn.Linear4bit
    tok, model = _quantized(family, kind, tokenizers, tmp_path)
    hf = model.base_model.model
    heads = head_names(hf)
    quantized = [n for n, m in hf.named_modules() if isinstance(m, layer)]
    assert quantized and not [n for n in quantized if n.split(".")[0] in heads]
    plain_linear = [n for n, m in hf.named_modules() if type(m) is torch.nn.Linear and n.split(".")[0] in heads]
    assert plain_linear  # the head: plain fp32 Linear layers, trained in full
    for n, p in hf.named_parameters():
        if "norm" in n.lower() or n.split(".")[0] in heads:
            assert p.dtype == torch.float32, n
    # a LoRA step on the quantized base moves the adapters and lowers the loss
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    labels = torch.tensor([1, 0, 0, 1])
    losses = []
    for _ in range(8):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(
        not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n and "modules_to_save" not in n
    )


@pytest.mark.slow
def test_qlora_run_exports_the_merge_into_the_unquantized_base(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    """A pretrained (saved) Llama, 4-bit, bf16 autocast, checkpointing: final/ = the fp32 base from disk
    with the adapters merged, equal to peft's unmerged adapter on that base; final/adapter loads with peft."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, pipeline

    arch = {**FAMILIES["llama"][1], "hidden_size": 64, "head_dim": 32, "vocab_size": 300, "num_labels": 2}
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("llama", **arch))
    base.save_pretrained(tmp_path / "m")
    cfg = family_config(
        tmp_path,
        "llama",
        tokenizers,
        **{
            "model.architecture": ...,
            "model.name_or_path": str(tmp_path / "m"),
            "model.lora": {"r": 4},
            "model.quantization": "4bit",
            "model.gradient_checkpointing": True,
            "precision.mode": "bf16",
            "train.learning_rate": 5e-3,
        },
    )
    assert main(["--config", str(cfg)]) == 0
    final = tmp_path / "run" / "final"
    config = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    weights = load_file(str(final / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert not any(s in k for k in weights for s in ("lora", "absmax", "quant", "base_layer", "modules_to_save"))
    adapter = load_file(str(final / "adapter" / "adapter_model.safetensors"))
    assert any("lora_B" in k and t.abs().max() > 0 for k, t in adapter.items())  # the adapters trained
    assert {k.split(".")[2] for k in adapter if "lora_" not in k} == {"score"}
    clf = pipeline("text-classification", model=str(final), top_k=None, function_to_apply="none")
    got = torch.tensor(
        [[next(d["score"] for d in row if d["label"] == n) for n in NAMES] for row in clf(TEXTS, batch_size=len(TEXTS))]
    )
    tok = AutoTokenizer.from_pretrained(final)
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "m", dtype=torch.float32)
    base.config.pad_token_id = tok.pad_token_id
    with torch.no_grad():
        plain = torch.cat([base(**tok(t, return_tensors="pt")).logits for t in TEXTS])
    with quiet_peft_deprecation():
        peft_model = PeftModel.from_pretrained(base, final / "adapter").eval()
    with torch.no_grad():
        want = torch.cat([peft_model(**tok(t, return_tensors="pt")).logits for t in TEXTS])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(want, plain, atol=1e-3)  # adapters and head changed the model
    # the base in final/ is the unquantized one from disk: layers without adapters are bit-identical
    stored = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"], stored["model.layers.0.mlp.up_proj.weight"])


def test_an_architecture_model_exports_after_8bit_training(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    """`model.architecture` (from_config does not quantize: saved and reloaded) with 8-bit DistilBERT,
    whose head is two modules: final/ loads in a pipeline and matches the merge recomputed by peft."""
    from transformers import pipeline

    cfg = family_config(tmp_path, "distilbert", tokenizers, **{"model.lora": {"r": 4}, "model.quantization": "8bit"})
    assert main(["--config", str(cfg)]) == 0
    final = tmp_path / "run" / "final"
    clf = pipeline("text-classification", model=str(final), top_k=None)
    assert {d["label"] for d in clf(TEXTS[0])[0]} == set(NAMES)
    adapter = load_file(str(final / "adapter" / "adapter_model.safetensors"))
    assert {k.split(".")[2] for k in adapter if "lora_" not in k} == {"pre_classifier", "classifier"}
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Linear8bitLt" not in log and "MatMul8bitLt" not in log


@pytest.mark.slow
def test_quantization_errors_are_one_line(
    tokenizers: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def one_line(cfg: Path, *overrides: str) -> str:
        assert main(["--config", str(cfg), *overrides]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    plain = family_config(tmp_path / "a", "llama", tokenizers, **{"model.quantization": "4bit"})
    assert "model.lora" in one_line(plain)  # quantized weights cannot train without adapters
    assert "CUDA" in one_line(plain, "model.lora={r: 4}", "train.optimizer=adamw8bit")
    deberta = family_config(
        tmp_path / "d", "deberta-v2", tokenizers, **{"model.quantization": "4bit", "model.lora": {"r": 4}}
    )
    assert "bf16-true" in one_line(deberta, "precision.mode=bf16")  # fails in its attention otherwise
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    assert "needs bitsandbytes" in one_line(plain, "model.lora={r: 4}")
    assert not (tmp_path / "a" / "run").exists()
    with pytest.raises(UserError, match="model.lora"):
        load_config(plain, ["model.quantization=8bit"])


@pytest.mark.slow
def test_qlora_resume_is_exact(tokenizers: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint holds bitsandbytes' quantization state beside each 4-bit weight: resume skips it
    (the base is rebuilt identically) and checks every other key strictly."""
    run = {
        "model.lora": {"r": 4},
        "model.quantization": "4bit",
        "train.max_steps": 4,
        "checkpoint.every_steps": 3,
        "data.max_train_samples": 64,
    }
    ref, got = stopped_and_resumed(tmp_path, "llama", tokenizers, monkeypatch, run)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_a_rank_other_than_0_still_writes_its_private_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers' save_pretrained writes nothing on a torch.distributed rank other than 0: QLoRA on a second
    # process then reloaded an empty folder ("Unrecognized model"); a GGUF conversion by that rank left a
    # cache folder without weights
    from transformers import BertConfig, BertForSequenceClassification

    from finetune.model.sources import save_on_this_process

    model = BertForSequenceClassification(
        BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    )
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    model.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "model.safetensors").exists()  # the failure this guards against
    save_on_this_process(model, tmp_path / "here")
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "here").iterdir()}
    saved = load_file(tmp_path / "here" / "model.safetensors")
    assert set(saved) == set(model.state_dict())
    assert all(torch.equal(saved[n], t) for n, t in model.state_dict().items())
    assert "should_save_on_this_rank" not in vars(model)  # the class's rank check is back
