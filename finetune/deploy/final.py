"""The exported model directory, final/: written at the end of a run (`export_final`: merged weights,
the LoRA adapter, the tokenizer at the run's max_length, the prediction settings from
`prediction_config`), checked before anything loads it (`check_final`) and loaded (`load_final`).

`predict`, `evaluate` and `export` read final/ through here, so a missing or truncated file is one line naming
it, never a traceback or another tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from safetensors import SafetensorError

from finetune.config.schema import Config
from finetune.core.errors import UserError
from finetune.data.reading import FileOptions, data_formats
from finetune.model.load import exportable, is_quantized, merge_adapter, quiet_peft_deprecation, unquantized_base
from finetune.training.checkpoint import TMP_PREFIX, remove_tree

# final/config.json's key for how the run read its data files: `finetune predict` reads inputs of those formats alike
DATA_READING = "data_reading"
# a tokenizer's vocabulary: tokenizer.json (fast, what export_final writes) or a slow tokenizer's own file
VOCAB_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "tokenizer.model",
    "sentencepiece.bpe.model",
)


def _check_json(path: Path) -> None:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(
            f"{path} is corrupt or truncated (not valid JSON: {exc}); export the run again or copy final/ anew"
        ) from None


def weight_files(final: Path) -> list[Path]:
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
    weights = weight_files(final)
    if not (final / "config.json").is_file() and not any(w.is_file() for w in weights):
        raise UserError(
            f"{final} is not an exported model directory (final/ holds config.json, model.safetensors "
            "and the tokenizer)"
        )
    vocab = next((final / v for v in VOCAB_FILES if (final / v).is_file()), None)
    for need in [final / "config.json", *weights, final / "tokenizer_config.json", vocab or final / VOCAB_FILES[0]]:
        if not need.is_file():
            raise UserError(
                f"{need} is missing: {final} is incomplete (an exported model directory holds "
                "config.json, model.safetensors and its tokenizer); export the run again or copy final/ "
                "anew"
            )
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        if (final / name).is_file():
            _check_json(final / name)
    from safetensors import safe_open

    for w in weights:
        try:
            with safe_open(str(w), framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise UserError(
                f"{w} is corrupt or truncated ({str(exc).splitlines()[0]}); export the run again or copy final/ anew"
            ) from None


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


# ----------------------------------------------------------------------------------------------
# Writing final/ at the end of a run.


def prediction_config(cfg: Config, label_names: list[str], thresholds: list[float] | None) -> dict[str, Any]:
    """final/config.json entries that make `finetune predict` read texts as evaluation did, and its input
    files as training read the run's (`DATA_READING`: the formats and the data keys that parse them)."""
    d, extra = cfg.data, {}
    if thresholds:
        extra["label_thresholds"] = dict(zip(label_names, thresholds, strict=True))
    if d.chunk_stride is not None:
        extra.update(chunk_stride=d.chunk_stride, chunk_aggregate=d.chunk_aggregate)
    if d.truncation is not None:
        extra.update(truncation=d.truncation, head_fraction=d.head_fraction)
    formats = data_formats(cfg)
    if formats:
        extra[DATA_READING] = {"formats": formats, **FileOptions.of(d).as_keys()}
    return extra


def recorded_reading(directory: Path) -> dict[str, Any] | None:
    """How the run read its data files, as final/config.json (or an ONNX export's copy) records it: `formats`
    and the `FileOptions` keys. None for a final/ written before the record, a run on a hub dataset, or a
    config.json that cannot be read (`check_final` names it)."""
    try:
        recorded = json.loads((directory / "config.json").read_text(encoding="utf-8")).get(DATA_READING)
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, dict) else None


def export_final(
    accelerator: Accelerator,
    model: torch.nn.Module,
    tokenizer: Any,
    out: Path,
    max_length: int,
    extra_config: dict[str, Any] | None = None,
) -> None:
    """`final/`: safetensors weights, config with label names, tokenizer (loads in a pipeline);
    with LoRA the weights are merged and `final/adapter/` holds the adapters and the trained head.

    The tokenizer carries the run's `data.max_length` as `model_max_length` (right truncation, as
    in training), so `finetune predict` and `pipeline(..., truncation=True)` on final/ alone cut
    texts where training did.
    """
    accelerator.wait_for_everyone()
    # written beside it, then renamed: a kill during the export never leaves a half-written final/
    tmp = out.with_name(f"{TMP_PREFIX}{out.name}")
    if accelerator.is_main_process:
        remove_tree(tmp)
    peft_model = accelerator.unwrap_model(model)
    if hasattr(peft_model, "peft_config"):  # LoRA: the adapters and the head first, as trained (unmerged)
        adapter_state = accelerator.get_state_dict(model)  # every rank: a collective under FSDP / ZeRO-3
        if accelerator.is_main_process:
            save_adapter(peft_model, adapter_state, tmp / "adapter")
    if is_quantized(peft_model):
        # QLoRA: the adapters merged into the base reloaded unquantized (a merge into NF4 / int8 weights
        # would round the update away); quantized runs are single-process (no FSDP / ZeRO gather)
        if accelerator.is_main_process:
            base = unquantized_base(peft_model, tokenizer)
            model = merge_adapter(base, str(tmp / "adapter"))
    # LoRA: merge the adapters into the base weights so final/ loads without peft
    elif hasattr(peft_model, "merge_and_unload"):
        model = exportable(peft_model)
    # every rank: under FSDP / DeepSpeed ZeRO-3 gathering the full state dict is a collective
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # no "Writing model shards 1/1" bar after the run
        try:
            unwrapped.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        side = "left" if (extra_config or {}).get("truncation") == "tail" else "right"
        tokenizer.model_max_length, tokenizer.truncation_side = max_length, side
        tokenizer.save_pretrained(tmp)
        # bf16-true weights are saved as trained (bf16, norms fp32), but a config saying "bfloat16"
        # makes from_pretrained/pipeline cast the fp32 norms down to bf16 on load. "float32" makes
        # loaders upcast everything instead, which is lossless.
        config_file = tmp / "config.json"
        config_json = json.loads(config_file.read_text())
        if config_json.get("dtype") not in (None, "float32"):
            config_json["dtype"] = "float32"
        # what prediction needs beyond transformers' keys (multi-label thresholds, the windowing of long
        # texts): `finetune predict` and `evaluate` read them from final/ alone
        config_json.update(extra_config or {})
        config_file.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        remove_tree(out)
        tmp.rename(out)
    accelerator.wait_for_everyone()


def save_adapter(peft_model: Any, state_dict: dict[str, Any], out: Path) -> None:
    """peft's adapter directory (adapter_config.json, adapter_model.safetensors): the LoRA weights and
    the whole classification head (`modules_to_save`, under peft's own key names), without the base
    weights. Embedding rows of an added pad token are not in it: final/'s tokenizer says how many
    rows the base needs (`resize_token_embeddings(len(tokenizer))` before `PeftModel.from_pretrained`)."""
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        with quiet_peft_deprecation():
            peft_model.save_pretrained(out, state_dict=state_dict, safe_serialization=True, save_embedding_layers=False)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
