"""An exported model directory (final/) checked before anything loads it, and loaded: `check_final`, `load_final`.

`predict`, `evaluate` and `export` read final/ through here, so a missing or truncated file is one line naming
it, never a traceback or another tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError

from finetune.errors import UserError

# a tokenizer's vocabulary: tokenizer.json (fast, what export_final writes) or a slow tokenizer's own file
VOCAB_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "tokenizer.model",
               "sentencepiece.bpe.model")


def _check_json(path: Path) -> None:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is corrupt or truncated (not valid JSON: {exc}); export the run again or copy "
                        "final/ anew") from None


def _weight_files(final: Path) -> list[Path]:
    """final/'s safetensors files: model.safetensors, or the shards its index names."""
    index = final / "model.safetensors.index.json"
    if index.is_file():
        _check_json(index)
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return [final / s for s in shards]
    return [final / "model.safetensors"]


def check_final(final: Path) -> None:
    """Refuse an incomplete or corrupt exported model directory, naming the file, before anything loads
    it: transformers would otherwise raise a SafetensorError traceback on truncated weights, or build
    some other tokenizer where final/'s tokenizer files are gone (predictions made with the wrong
    vocabulary and nothing said). Reads the JSON files and the safetensors headers (which cover the
    whole file, so a truncation anywhere shows), not the weights themselves.

    Raises:
        UserError: missing, not a directory, or config.json / weights / tokenizer files missing or corrupt.
    """
    if not final.is_dir():
        what = "is a file" if final.exists() else "does not exist"
        raise UserError(f"{final} is not an exported model directory: it {what} (give a run's final/ directory)")
    weights = _weight_files(final)
    if not (final / "config.json").is_file() and not any(w.is_file() for w in weights):
        raise UserError(f"{final} is not an exported model directory (final/ holds config.json, model.safetensors "
                        "and the tokenizer)")
    vocab = next((final / v for v in VOCAB_FILES if (final / v).is_file()), None)
    for need in [final / "config.json", *weights, final / "tokenizer_config.json", vocab or final / VOCAB_FILES[0]]:
        if not need.is_file():
            raise UserError(f"{need} is missing: {final} is incomplete (an exported model directory holds "
                            "config.json, model.safetensors and its tokenizer); export the run again or copy final/ "
                            "anew")
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        if (final / name).is_file():
            _check_json(final / name)
    from safetensors import safe_open

    for w in weights:
        try:
            with safe_open(str(w), framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{w} is corrupt or truncated ({str(exc).splitlines()[0]}); export the run again or "
                            "copy final/ anew") from None


def load_final(final: Path) -> tuple[Any, Any]:
    """final/'s tokenizer and model (fp32, eval mode), after `check_final`.

    Raises:
        UserError: final/ is incomplete or corrupt, or transformers cannot load it.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    check_final(final)
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar around one-line errors
    try:
        tokenizer = AutoTokenizer.from_pretrained(final)
        model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load {final}: {first}") from None
    return tokenizer, model
