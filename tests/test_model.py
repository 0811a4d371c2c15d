"""Model building: frozen embeddings, LoRA through peft (head in full, merged export), optimizers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY

from finetune.config.files import load_config
from finetune.core.errors import UserError
from finetune.model.load import build_model, build_tokenizer, exportable

NAMES = ["negative", "positive"]


def _model(*overrides: str) -> tuple[Any, Any]:
    cfg = load_config(TINY, list(overrides))
    tok = build_tokenizer(cfg)
    torch.manual_seed(0)
    return build_model(cfg, NAMES, tok), tok


def _batch(tok: Any) -> dict[str, torch.Tensor]:
    return dict(tok(["a fine film", "dull and far too long for what it is"], padding=True, return_tensors="pt"))


def test_freeze_embeddings_with_checkpointing_still_trains_the_encoder() -> None:
    model, tok = _model("model.freeze_embeddings=true", "model.gradient_checkpointing=true")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith("bert.embeddings.") for n in frozen)
    assert {n for n, _ in model.named_parameters() if n.startswith("bert.embeddings.")} == frozen
    model.train()
    out = model(**_batch(tok), labels=torch.tensor([1, 0]))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "layer.0." in n and "weight" in n)
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)


def test_lora_trains_adapters_and_the_full_head_and_exports_merged(tmp_path: Path) -> None:
    model, tok = _model("model.lora={r: 4, alpha: 8, target_modules: [query, value]}")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any("lora_B" in n for n in trainable)
    assert any("classifier" in n and "modules_to_save" in n for n in trainable)  # the head, in full
    assert not any(("query" in n or "value" in n) and "base_layer" in n for n in trainable)
    assert not any("key" in n or "embeddings" in n for n in trainable)
    # make the adapters do something, then merge: same outputs, plain transformers weights
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    batch = _batch(tok)
    with torch.no_grad():
        want = model(**batch).logits
    merged = exportable(model)
    assert not any("lora" in k or "modules_to_save" in k or "base_layer" in k for k in merged.state_dict())
    merged.save_pretrained(tmp_path / "final")
    tok.save_pretrained(tmp_path / "final")
    from transformers import AutoModelForSequenceClassification

    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final").eval()
    with torch.no_grad():
        got = loaded(**batch).logits
    assert torch.allclose(got, want, atol=1e-5)


def test_lora_and_checkpointing_print_no_library_warning() -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = _model("model.lora={r: 4}", "model.gradient_checkpointing=true")
    assert not [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    assert model.base_model.model.bert.encoder.layer[0].gradient_checkpointing  # still switched on


def test_lora_bad_target_module_is_a_user_error() -> None:
    with pytest.raises(UserError, match="target_modules"):
        _model("model.lora={target_modules: [q_proj]}")


def test_optimizer_choices() -> None:
    from transformers.optimization import Adafactor

    from finetune.training.optim import build_optimizer

    model, tok = _model()
    assert isinstance(build_optimizer(load_config(TINY, ["train.optimizer=adafactor"]), model), Adafactor)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="adamw8bit needs a CUDA GPU"):
            build_optimizer(load_config(TINY, ["train.optimizer=adamw8bit"]), model)
    # Adafactor steps the weights (a fixed learning rate: no relative step)
    opt = build_optimizer(load_config(TINY, ["train.optimizer=adafactor", "train.learning_rate=1e-2"]), model)
    before = model.classifier.weight.detach().clone()
    model(**_batch(tok), labels=torch.tensor([1, 0])).loss.backward()
    opt.step()
    assert not torch.equal(before, model.classifier.weight)


@pytest.mark.slow
def test_lora_run_end_to_end_loads_in_a_pipeline(tiny_config: Callable[..., Path], tmp_path: Path) -> None:
    from transformers import pipeline

    from finetune.train import main

    cfg = tiny_config(
        {
            "model.lora": {"r": 4},
            "model.gradient_checkpointing": True,
            "data.max_train_samples": 64,
            "data.max_eval_samples": 16,
        }
    )
    assert main(["--config", str(cfg)]) == 0
    final = tmp_path / "run" / "final"
    import safetensors.torch as st

    assert not any("lora" in k for k in st.load_file(str(final / "model.safetensors")))
    out = pipeline("text-classification", model=str(final))("a great movie")
    assert out[0]["label"] in NAMES


def test_model_dropout_sets_every_dropout_of_the_model() -> None:
    """model.dropout: 0 makes a train-mode forward equal the eval-mode one (the reference: no dropout
    anywhere) on a model whose checkpoint config has dropout; a non-zero value reaches every module
    and the config keys final/config.json is written from; Llama's attention reads a float attribute."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from finetune.model.load import set_dropout

    drop = ("model.architecture.hidden_dropout_prob=0.3", "model.architecture.attention_probs_dropout_prob=0.3")
    model, tok = _model(*drop, "model.dropout=0")
    batch = _batch(tok)
    with torch.no_grad():
        trained = model.train()(**batch).logits
        assert torch.equal(trained, model.eval()(**batch).logits)
    assert model.config.hidden_dropout_prob == 0.0 and model.config.attention_probs_dropout_prob == 0.0
    model, _ = _model(*drop, "model.dropout=0.5")
    assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.5}
    with torch.no_grad():
        assert not torch.equal(model.train()(**batch).logits, model.eval()(**batch).logits)
    arch = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    llama = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("llama", vocab_size=64, **arch))
    assert "attention_dropout" in set_dropout(llama, 0.2)
    attentions = [m for m in llama.modules() if hasattr(m, "attention_dropout")]
    assert len(attentions) == 2 and all(m.attention_dropout == 0.2 for m in attentions)
    assert llama.config.attention_dropout == 0.2


def test_model_dropout_auto_is_zero_for_regression_only() -> None:
    regression = load_config(TINY, ["model.problem_type=regression", "data.label_map=null"])
    assert regression.model.dropout == "auto" and regression.model.dropout_p == 0.0
    assert load_config(TINY).model.dropout_p is None  # single-label keeps the checkpoint's dropout
    assert (
        load_config(
            TINY, ["model.problem_type=regression", "data.label_map=null", "model.dropout=null"]
        ).model.dropout_p
        is None
    )


def test_pooler_init_identity_passes_the_cls_state_through_tanh() -> None:
    """model.pooler_init: identity makes BERT's pooled output tanh(h_CLS) (the reference: the encoder's last
    hidden state at position 0 through torch.tanh); the default keeps the initialised weights; a family without
    a pooler is a one-line error."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from finetune.model.families import identity_pooler

    model, tok = _model("model.pooler_init=identity")
    batch = _batch(tok)
    model.eval()
    with torch.no_grad():
        hidden = model.bert(**batch).last_hidden_state
        pooled = model.bert.pooler(hidden)
    torch.testing.assert_close(pooled, torch.tanh(hidden[:, 0]), rtol=0, atol=1e-6)
    default, _ = _model()
    eye = torch.eye(default.bert.pooler.dense.in_features)
    assert not torch.allclose(default.bert.pooler.dense.weight, eye)
    arch = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    llama = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("llama", vocab_size=64, **arch))
    with pytest.raises(UserError, match="pooler_init=identity: LlamaForSequenceClassification has no pooler"):
        identity_pooler(llama)
