"""Bring your own model: every encoder and decoder family as a new user would try it.

Tiny random models (2 layers, hidden 32) from `model.architecture` with the family's model_type,
and byte-level BPE tokenizers trained here on SST-2 sentences and saved WITHOUT a pad token (as
Llama 3 and Mistral ship theirs). Every family once in fp32, full and LoRA, through `main()`:
the export in final/ is compared with an independent reference (the last checkpoint's weights
rebuilt in the training code's model, each text alone, no padding) through a batched pipeline.
bf16 / bf16-true on one encoder (DeBERTa-v2, v3-style relative attention) and one decoder
(Llama); exact resume on a decoder with LoRA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_FAMILY_RUN, write_tiny_config
from safetensors.torch import load_file

from finetune.config.files import load_config
from finetune.core import faults
from finetune.core.errors import UserError
from finetune.model.load import build_model, build_tokenizer, choose_pad_token, head_names, quiet_peft_deprecation
from finetune.train import main
from finetune.training import checkpoint as ckpt
from finetune.training import runtime

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

NAMES = ["negative", "positive"]
TEXTS = ["a fine film", "dull and far too long for what it is , and then some more", "bad", "the best of the year"]

_ENC = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}
_DEC = {**_ENC, "num_key_value_heads": 1, "head_dim": 16}
_DROP = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
# model_type -> (tokenizer kind, architecture); dropout 0 where the family has any by default
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "bert": ("encoder", {**_ENC, **_DROP}),
    "roberta": ("encoder", {**_ENC, **_DROP}),
    "electra": ("encoder", {**_ENC, **_DROP, "embedding_size": 32}),
    "deberta-v2": (
        "encoder",
        {  # DeBERTa-v3's layout: relative attention with buckets, no absolute positions
            **_ENC,
            **_DROP,
            "relative_attention": True,
            "pos_att_type": ["p2c", "c2p"],
            "position_buckets": 16,
            "max_relative_positions": -1,
            "norm_rel_ebd": "layer_norm",
            "share_att_key": True,
            "position_biased_input": False,
            "type_vocab_size": 0,
        },
    ),
    "modernbert": ("encoder", {**_ENC, "local_attention": 16, "global_attn_every_n_layers": 2}),
    "distilbert": (
        "encoder",
        {
            "dim": 32,
            "n_layers": 2,
            "n_heads": 2,
            "hidden_dim": 64,
            "max_position_embeddings": 128,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "seq_classif_dropout": 0.0,
        },
    ),
    "llama": ("decoder", _DEC),
    "qwen2": ("decoder", _DEC),
    "qwen3": ("decoder", _DEC),
    "mistral": ("decoder_eos", _DEC),  # a tokenizer that appends eos: pad = eos is refused, a new pad is added
    "gemma": ("decoder", _DEC),
    "phi3": ("decoder", _DEC),
    "phi": ("decoder", {**_ENC, "partial_rotary_factor": 0.5}),
    "mpnet": ("encoder", {**_ENC, **_DROP}),  # last: the planner's settings cycle by position (tests/test_mpnet.py)
}
DECODERS = [f for f, (kind, _) in FAMILIES.items() if kind.startswith("decoder")]
EXPECTED_HEADS = {
    "distilbert": ["pre_classifier", "classifier"],
    "deberta-v2": ["pooler", "classifier"],
    "modernbert": ["head", "classifier"],
    **{f: ["score"] for f in DECODERS},
}


# ----------------------------------------------------------------------------------------------
# Tokenizers: byte-level BPE trained offline, saved without a pad token.


def _sentences(data_dir: Path, n: int = 400) -> list[str]:
    with open(data_dir / "sst2" / "train.tsv", encoding="utf-8") as f:
        next(f)
        return [line.split("\t")[0] for _, line in zip(range(n), f, strict=False)]


def train_tokenizer(texts: list[str], kind: str, out: Path) -> Path:
    """`decoder`: bos prepended, nothing appended, no unk (Llama 3); `decoder_eos`: bos ... eos, no unk
    (a tokenizer that appends eos); `encoder`: <s> ... </s> with unk and mask (RoBERTa's layout)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = {
        "decoder": ["<|begin_of_text|>", "<|end_of_text|>"],
        "decoder_eos": ["<s>", "</s>"],
        "encoder": ["<s>", "</s>", "<unk>", "<mask>"],
    }[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    bos, eos = specials[:2]
    ids = [(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))]
    if kind == "decoder":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=ids[:1]
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B {eos}", special_tokens=ids
        )
    extra = {"unk_token": "<unk>", "mask_token": "<mask>", "cls_token": bos, "sep_token": eos}
    extra = extra if kind == "encoder" else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, **extra)
    assert fast.pad_token is None
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    texts = _sentences(data_dir)
    return {k: train_tokenizer(texts, k, root / k) for k in ("decoder", "decoder_eos", "encoder")}


def family_config(directory: Path, family: str, tokenizers: dict[str, Path], **updates: Any) -> Path:
    """A tiny run of `family`: 32 training rows, 2 optimizer steps of 8, a checkpoint at the end."""
    kind, arch = FAMILIES[family]
    directory.mkdir(parents=True, exist_ok=True)
    base = {
        "model.tokenizer": str(tokenizers[kind]),
        "model.architecture": {"model_type": family, **arch},
        **TINY_FAMILY_RUN,
    }
    return write_tiny_config(directory, {**base, **updates})


# ----------------------------------------------------------------------------------------------
# Every family: fp32, full and LoRA, export, pipeline reload.


def _reference_logits(run: Path, cfg_path: Path) -> torch.Tensor:
    """Logits of the last checkpoint's weights in the training code's own model (LoRA unmerged),
    each text alone (no padding): what final/ must reproduce."""
    cfg = load_config(cfg_path)
    tok = build_tokenizer(cfg)
    final_tok = __import__("transformers").AutoTokenizer.from_pretrained(run / "final")
    # the pad the run chose after tokenizing (RoBERTa's positions and decoder pooling depend on it)
    if final_tok.pad_token in tok.get_vocab():
        tok.pad_token = final_tok.pad_token
    else:
        tok.add_special_tokens({"pad_token": final_tok.pad_token})
    model = build_model(cfg, NAMES, tok).eval()
    state = load_file(str(ckpt.list_checkpoints(run)[-1] / "model.safetensors"))
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return torch.cat([model(**tok(t, return_tensors="pt")).logits for t in TEXTS])


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_exports_and_reloads(
    family: str, lora: bool, tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import pipeline

    extra = {"model.lora": {"r": 4}} if lora else {}
    cfg = family_config(tmp_path, family, tokenizers, **extra)
    assert main(["--config", str(cfg)]) == 0
    run = tmp_path / "run"
    final = run / "final"
    # log.plots is off here (conftest): no figures, and the model card links none
    assert not list(run.glob("**/*.png")) and "![confusion matrix]" not in (final / "README.md").read_text()
    config = json.loads((final / "config.json").read_text())
    tok_cfg = json.loads((final / "tokenizer_config.json").read_text())
    kind = FAMILIES[family][0]
    want_pad = {"decoder": "<|end_of_text|>", "decoder_eos": "<|pad|>", "encoder": "<unk>"}[kind]
    assert tok_cfg["pad_token"] == want_pad and config["pad_token_id"] is not None
    weights = load_file(str(final / "model.safetensors"))
    assert not any("lora" in k or "modules_to_save" in k or "base_layer" in k for k in weights)
    # the memory report of the checkpoint, for every family
    memory = json.loads((ckpt.list_checkpoints(run)[-1] / "memory.json").read_text())
    assert memory["config"]["lora"] == lora
    # a batched pipeline on final/ alone (padding inside the batch) gives each text's own logits
    clf = pipeline("text-classification", model=str(final), top_k=None, function_to_apply="none")
    assert clf.tokenizer.pad_token_id == config["pad_token_id"]
    got = clf(TEXTS, batch_size=len(TEXTS))
    got = torch.tensor([[next(d["score"] for d in row if d["label"] == n) for n in NAMES] for row in got])
    want = _reference_logits(run, cfg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert want.std() > 0  # not a constant model
    if lora:  # final/adapter: adapters + the whole head, onto the base weights, give the same logits
        torch.testing.assert_close(_adapter_logits(run, cfg, family), want, rtol=1e-4, atol=1e-5)


def _adapter_logits(run: Path, cfg_path: Path, family: str) -> torch.Tensor:
    """final/adapter loaded with peft onto the frozen base weights (taken from the checkpoint), each text alone."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    adapter = load_file(str(run / "final" / "adapter" / "adapter_model.safetensors"))
    heads = EXPECTED_HEADS.get(family, ["classifier"])
    assert any("lora_A" in k for k in adapter) and not any("base_layer" in k for k in adapter)
    assert {k.split(".")[2] for k in adapter if "lora_" not in k} == set(heads)  # the head, all of it
    tok = AutoTokenizer.from_pretrained(run / "final")
    base = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(run / "final"))
    state = load_file(str(ckpt.list_checkpoints(run)[-1] / "model.safetensors"))
    state = {
        k.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", "."): v
        for k, v in state.items()
        if "lora_" not in k and ".modules_to_save." not in k
    }
    base.load_state_dict(state, strict=True)
    with quiet_peft_deprecation():
        model = PeftModel.from_pretrained(base, run / "final" / "adapter").eval()
    with torch.no_grad():
        return torch.cat([model(**tok(t, return_tensors="pt")).logits for t in TEXTS])


# ----------------------------------------------------------------------------------------------
# Pad token and pooling.


def _built(family: str, tokenizers: dict[str, Path], tmp_path: Path, **updates: Any) -> tuple[Any, Any]:
    """The training code's tokenizer and model for `family` (pad chosen on a few texts)."""
    cfg = load_config(family_config(tmp_path, family, tokenizers, **updates))
    tok = build_tokenizer(cfg)
    choose_pad_token(tok, [__import__("datasets").Dataset.from_dict(dict(tok(TEXTS)))])
    torch.manual_seed(0)
    return tok, build_model(cfg, NAMES, tok).eval()


@pytest.mark.parametrize("family", DECODERS)
def test_right_and_left_padding_give_the_text_alone(family: str, tokenizers: dict[str, Path], tmp_path: Path) -> None:
    tok, model = _built(family, tokenizers, tmp_path)
    assert model.config.pad_token_id == tok.pad_token_id is not None
    with torch.no_grad():
        alone = torch.cat([model(**tok(t, return_tensors="pt")).logits for t in TEXTS])
        for side in ("right", "left"):
            tok.padding_side = side
            batch = tok(TEXTS, padding=True, return_tensors="pt")
            assert (batch["attention_mask"] == 0).any()
            torch.testing.assert_close(model(**batch).logits, alone, rtol=1e-4, atol=1e-5, msg=side)
    # the reference is sensitive: pooling the first token instead of the last changes the logits
    with torch.no_grad():
        first = model(**tok([t + " and more" for t in TEXTS], padding=True, return_tensors="pt")).logits
    assert not torch.allclose(first, alone, atol=1e-4)


def test_pad_choice_skips_tokens_inside_the_texts(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    import datasets

    from finetune.model.load import NEW_PAD_TOKEN, pad_candidates

    # Llama 3's layout: eos never inside a text -> pad = eos, no new token
    tok, model = _built("llama", tokenizers, tmp_path / "a")
    assert tok.pad_token == tok.eos_token and len(tok) == 300 == model.config.vocab_size
    # eos appended to every text: pad = eos would move the pooled token -> a new pad, embeddings grown
    tok, model = _built("mistral", tokenizers, tmp_path / "b")
    assert tok.pad_token == NEW_PAD_TOKEN and tok.pad_token_id == 300
    assert model.get_input_embeddings().num_embeddings == 301 and model.config.pad_token_id == 300
    # a tokenizer with unk: eos appended -> unk
    cfg = load_config(family_config(tmp_path / "c", "roberta", tokenizers))
    tok = build_tokenizer(cfg)
    assert pad_candidates(tok) == ["</s>", "<unk>", NEW_PAD_TOKEN] and tok.pad_token == "</s>"  # provisional
    choose_pad_token(tok, [datasets.Dataset.from_dict(dict(tok(TEXTS)))])
    assert tok.pad_token == "<unk>"
    # only positions under attention_mask == 1 count
    tok = build_tokenizer(cfg)
    masked = datasets.Dataset.from_dict({"input_ids": [[5, 1]], "attention_mask": [[1, 0]]})
    choose_pad_token(tok, [masked])
    assert tok.pad_token == "</s>"


def test_a_pretrained_decoder_gets_the_pad_and_room_for_it(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    """A saved model (as from the hub: no pad_token_id, embeddings = vocabulary) and a tokenizer that
    appends eos: the new pad grows the embeddings by one row and lands in the config."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    arch = {**FAMILIES["llama"][1], "vocab_size": 300, "num_labels": 2}
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("llama", **arch))
    model.save_pretrained(tmp_path / "m")
    cfg = family_config(
        tmp_path, "mistral", tokenizers, **{"model.architecture": ..., "model.name_or_path": str(tmp_path / "m")}
    )
    assert main(["--config", str(cfg)]) == 0
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert config["pad_token_id"] == 300 and config["vocab_size"] == 301


def test_a_shipped_pad_inside_the_texts_moves_off_the_eos_and_is_refused_otherwise(
    tokenizers: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizers["decoder_eos"])
    tok.pad_token = tok.eos_token  # shipped as pad = eos (SmolLM2, Qwen), and eos is appended to every text
    tok.save_pretrained(tmp_path / "eos")
    cfg = family_config(tmp_path / "a", "mistral", {"decoder_eos": tmp_path / "eos"})
    assert main(["--config", str(cfg)]) == 0
    log = (tmp_path / "a" / "run" / "train.log").read_text()
    assert "pads with its eos '</s>', which occurs inside the texts: padding with '<|pad|>'" in log
    # any other pad the tokenizer ships that occurs inside the texts: refused, nothing written
    word = tok.convert_ids_to_tokens(tok(" the")["input_ids"])[0]  # in nearly every SST-2 sentence
    tok.pad_token = word
    tok.save_pretrained(tmp_path / "word")
    cfg = family_config(tmp_path / "b", "mistral", {"decoder_eos": tmp_path / "word"})
    capfd.readouterr()
    assert main(["--config", str(cfg)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: the tokenizer's pad token {word!r}"), err
    assert not (tmp_path / "b" / "run").exists()


# ----------------------------------------------------------------------------------------------
# LoRA.


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_trains_the_whole_head_and_never_targets_it(
    family: str, tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    _, plain = _built(family, tokenizers, tmp_path / "plain")
    heads = head_names(plain)
    assert heads == EXPECTED_HEADS.get(family, ["classifier"])
    # every Linear name outside the head as a target (dense, out_proj, ... shared with the head): the head
    # stays plain; a name found only in the head is refused
    linear = sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in plain.named_modules()
            if isinstance(m, torch.nn.Linear) and n.split(".")[0] not in heads
        }
    )
    head_only = sorted(
        {n.rsplit(".", 1)[-1] for n, m in plain.named_modules() if n.split(".")[0] in heads}
        - {n.rsplit(".", 1)[-1] for n, m in plain.named_modules() if n.split(".")[0] not in heads}
    )
    if head_only:
        with pytest.raises(UserError, match="only modules of the classification head"):
            _built(family, tokenizers, tmp_path / "bad", **{"model.lora": {"target_modules": head_only}})
    _, model = _built(family, tokenizers, tmp_path / "lora", **{"model.lora": {"r": 4, "target_modules": linear}})
    hf = model.base_model.model
    assert sorted(n for n, m in hf.named_modules() if isinstance(m, ModulesToSaveWrapper)) == sorted(heads)
    lora_layers = [n for n, m in hf.named_modules() if isinstance(m, LoraLayer)]
    assert lora_layers and not [n for n in lora_layers if n.split(".")[0] in heads]
    trainable = {n for n, p in hf.named_parameters() if p.requires_grad}
    for head in heads:  # every parameter of the head (DistilBERT's pre_classifier, ModernBERT's norm) in full
        params = [n for n, _ in getattr(hf, head).modules_to_save["default"].named_parameters()]
        assert params and {f"{head}.modules_to_save.default.{n}" for n in params} <= trainable
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)


def _lora_steps(family: str, tokenizers: dict[str, Path], tmp_path: Path, checkpointing: bool) -> dict[str, Any]:
    tok, model = _built(
        family, tokenizers, tmp_path, **{"model.lora": {"r": 4}, "model.gradient_checkpointing": checkpointing}
    )
    model.train()
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    for _ in range(3):
        model(**batch, labels=torch.tensor([1, 0, 0, 1])).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: (init[n], p.detach().clone()) for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["llama", "distilbert"])
def test_lora_with_gradient_checkpointing_trains_as_without(
    family: str, tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    with_ckpt = _lora_steps(family, tokenizers, tmp_path / "a", True)
    without = _lora_steps(family, tokenizers, tmp_path / "b", False)
    assert with_ckpt.keys() == without.keys()
    lora_a = [n for n in with_ckpt if "lora_A" in n]
    assert lora_a and all(not torch.equal(*with_ckpt[n]) for n in lora_a)  # every adapter (layer 0 too) moved
    for n, (_, after) in with_ckpt.items():
        torch.testing.assert_close(after, without[n][1], rtol=1e-5, atol=1e-6, msg=n)


def stopped_and_resumed(
    tmp_path: Path, family: str, tokenizers: dict[str, Path], monkeypatch: pytest.MonkeyPatch, run: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """final/ weights of an uninterrupted run (tmp_path/ref) and of the same run stopped by SIGTERM after
    step 2 and resumed from its checkpoint (tmp_path/cut)."""
    ref_cfg = family_config(tmp_path / "ref", family, tokenizers, **run)
    assert main(["--config", str(ref_cfg)]) == 0
    cfg = family_config(tmp_path / "cut", family, tokenizers, **run)
    monkeypatch.setenv(faults.ENV, "sigterm_at_step:2")
    assert main(["--config", str(cfg)]) == runtime.EXIT_CODES["SIGTERM"]
    monkeypatch.delenv(faults.ENV)
    assert main(["--config", str(cfg), "checkpoint.resume=auto"]) == 0
    ref, got = (load_file(str(d / "run" / "final" / "model.safetensors")) for d in (tmp_path / "ref", tmp_path / "cut"))
    return ref, got


@pytest.mark.slow
def test_lora_resume_on_a_decoder_is_exact(
    tokenizers: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = {"model.lora": {"r": 4}, "train.max_steps": 4, "checkpoint.every_steps": 3, "data.max_train_samples": 64}
    ref, got = stopped_and_resumed(tmp_path, "qwen2", tokenizers, monkeypatch, run)
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    # the checkpoint holds the adapters and the trained head (peft's own name for it), bit for bit
    state = load_file(str(ckpt.list_checkpoints(tmp_path / "cut" / "run")[-1] / "model.safetensors"))
    assert any("lora_A" in k for k in state) and any("score.modules_to_save" in k for k in state)
    losses = [
        json.loads(x)["loss"]
        for d in (tmp_path / "ref", tmp_path / "cut")
        for x in (d / "run" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in x
    ]
    assert losses[:4] == losses[4:]


# ----------------------------------------------------------------------------------------------
# Precision: bf16 and bf16-true on one encoder and one decoder; buffers; fp16 per family.


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "bf16-true"])
@pytest.mark.parametrize("family", ["deberta-v2", "llama"])
def test_bf16_modes_train_and_keep_buffers_fp32(
    family: str, mode: str, tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    extra = {"model.lora": {"r": 4}} if family == "llama" else {}
    cfg = family_config(tmp_path, family, tokenizers, **{"precision.mode": mode, **extra})
    assert main(["--config", str(cfg)]) == 0
    run = tmp_path / "run"
    audit = json.loads((run / "dtype_audit.json").read_text())
    assert audit["contradictions"] == []
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 2 and all(0.3 < x < 1.2 for x in losses)
    if family == "llama":  # the rotary buffers, counted per module type, fp32 in every mode
        assert set(audit["by_module_type"]["LlamaRotaryEmbedding"]) == {"buffer:float32"}
        assert "buffer:bfloat16" not in json.dumps(audit["by_module_type"])
    if mode == "bf16-true":
        assert "param:bfloat16" in audit["by_module_type"]["Linear"]
        saved = load_file(str(ckpt.list_checkpoints(run)[-1] / "model.safetensors"))
        assert any(t.dtype == torch.bfloat16 for t in saved.values())
    if family == "llama":  # final/ (LoRA merged in fp32) = the checkpoint's unmerged model, text by text
        from transformers import pipeline

        clf = pipeline("text-classification", model=str(run / "final"), top_k=None, function_to_apply="none")
        got = torch.tensor([[next(d["score"] for d in row if d["label"] == n) for n in NAMES] for row in clf(TEXTS)])
        torch.testing.assert_close(got, _reference_logits(run, cfg), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "modernbert", "gemma"])
def test_bf16_true_buffers_stay_fp32_and_the_audit_checks_them(
    family: str, tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    from finetune.model.precision import apply_precision_policy, check_audit, dtype_audit

    tok, model = _built(family, tokenizers, tmp_path)
    with torch.no_grad():
        want = model(**tok(TEXTS[1], return_tensors="pt")).logits
    norms = apply_precision_policy(model, "bf16-true", None)
    buffers = {n: b for n, b in model.named_buffers() if b.is_floating_point()}
    assert any("inv_freq" in n for n in buffers) and all(b.dtype == torch.float32 for b in buffers.values())
    assert dtype_audit(model, "bf16-true", None, norm_names=norms)["contradictions"] == []
    with torch.no_grad():  # and the bf16 model still computes about what the fp32 one did
        got = model(**tok(TEXTS[1], return_tensors="pt")).logits.float()
    torch.testing.assert_close(got, want, rtol=0.1, atol=0.02)
    # what bf16-true did before: cast the rotary buffer down. The audit names it; bf16-true refuses.
    name = next(n for n in buffers if "inv_freq" in n)
    owner, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
    setattr(owner, attr, getattr(owner, attr).bfloat16())
    audit = dtype_audit(model, "bf16-true", None, norm_names=norms)
    assert [(r["name"], r["kind"], r["expected"]) for r in audit["contradictions"]] == [(name, "buffer", "float32")]
    with pytest.raises(UserError, match="inv_freq"):
        check_audit(audit, allow_mismatch=False)


def test_fp16_is_refused_for_gemma_and_accepted_elsewhere(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    from finetune.model.precision import FP16_REFUSED, apply_precision_policy, check_family_precision

    for family in FAMILIES:
        if family in FP16_REFUSED:
            with pytest.raises(UserError, match="precision.mode=fp16: Gemma"):
                check_family_precision(family, "fp16")
        else:
            check_family_precision(family, "fp16")
        check_family_precision(family, "bf16-true")
    _, model = _built("gemma", tokenizers, tmp_path)
    with pytest.raises(UserError, match="use precision.mode=bf16"):  # the planner and training both apply it
        apply_precision_policy(model, "fp16", None)


# ----------------------------------------------------------------------------------------------
# Packing stays BERT-family only; the planner runs for every family.


def test_packing_is_refused_for_a_decoder(
    tokenizers: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = family_config(tmp_path, "llama", tokenizers, **{"data.packing": True})
    assert main(["--config", str(cfg)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.packing supports model types" in err[0] and "'llama'" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_planner_runs_for_every_family(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    from finetune.memory.planner import plan

    peaks = {}
    for family in FAMILIES:
        lora = {"model.lora": {"r": 4}, "model.gradient_checkpointing": True} if family == "llama" else {}
        layers = "n_layers" if family == "distilbert" else "num_hidden_layers"  # 1 layer: the cost is per op
        arch = {"model_type": family, **FAMILIES[family][1], layers: 1}
        cfg = load_config(
            family_config(
                tmp_path / family, family, tokenizers, **lora, **{"data.max_length": 8, "model.architecture": arch}
            )
        )
        result = plan(cfg, device="cpu", micro_sizes=[16], label_names=NAMES)  # one micro-batch a window
        peaks[family] = result.rows[0].peak_bytes
        assert result.rows[0].categories["parameters"] > 0
    assert all(p > 0 for p in peaks.values()), peaks


def test_fp16_gemma_is_one_line_through_main(
    tokenizers: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """On a GPU the device check passes and the family refusal speaks; simulated here by lifting the CPU check."""
    monkeypatch.setattr(runtime, "check_supported", lambda mode, device: None)
    cfg = family_config(tmp_path, "gemma", tokenizers, **{"precision.mode": "fp16"})
    assert main(["--config", str(cfg)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [
        "error: precision.mode=fp16: Gemma's activations exceed fp16's range (its checkpoints are bf16); "
        "use precision.mode=bf16 or fp32"
    ], err
    assert not (tmp_path / "run").exists()


def test_head_names_fall_back_to_known_names(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    _, model = _built("distilbert", tokenizers, tmp_path)
    assert head_names(model) == ["pre_classifier", "classifier"]
    model.base_model_prefix = "not_a_child"  # a remote-code model without the usual layout
    assert head_names(model) == ["pre_classifier", "classifier"]
