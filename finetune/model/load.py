"""Model and tokenizer from the config: a source `finetune.model.sources` resolves (local dir, alias, GGUF
file, hub id), or an architecture config for a model built from scratch."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
import transformers
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from finetune.config.schema import Config
from finetune.core.errors import UserError
from finetune.model.families import enable_checkpointing, start_pooler
from finetune.model.pooling import append_mean_layer
from finetune.model.precision import apply_precision_policy, within
from finetune.model.sources import resolve_model_path, save_on_this_process

transformers.logging.set_verbosity_error()
# without network huggingface_hub logs every retry; the UserError below is the one line the user needs
huggingface_hub.utils.logging.set_verbosity_error()
# peft imports bitsandbytes when installed, whose CPU backend warns about an optional kernel package
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def _from_pretrained(factory: Any, name: str, what: str, **kwargs: Any) -> Any:
    path = resolve_model_path(name)
    try:
        return factory.from_pretrained(path, **kwargs)
    except OSError as exc:
        if not Path(path).is_dir():
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
            first = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
            if offline:
                reason = "the HuggingFace hub is unreachable (HF_HUB_OFFLINE=1)"
            elif "connect" in first.lower():  # no network: huggingface_hub gave up after its retries
                reason = f"the HuggingFace hub is unreachable ({first})"
            else:
                reason = f"it is not a local directory and the hub did not provide it ({first})"
            raise UserError(
                f"cannot load {what} {name!r}: {reason}; set model.name_or_path to a local directory, a .gguf file "
                "or an alias ('minilm-l6', 'mpnet-base', 'smollm2-135m')"
            ) from None
        raise UserError(f"cannot load {what} from {path}: {str(exc).splitlines()[0]}") from None


def build_tokenizer(cfg: Config) -> Any:
    """The tokenizer named by `model.tokenizer` (or `model.name_or_path`), with a pad token.

    A tokenizer without one (Llama 3 and Mistral ship none) gets a provisional pad here: its eos,
    else its unk, else a new `<|pad|>` token. `choose_pad_token` confirms or replaces it once the
    data is tokenized.

    Raises:
        UserError: the tokenizer cannot be loaded.
    """
    name = cfg.model.tokenizer or cfg.model.source
    assert name is not None
    tokenizer = _from_pretrained(AutoTokenizer, name, "tokenizer", trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.finetune_pad_candidates = pad_candidates(tokenizer)
        _set_pad_token(tokenizer, tokenizer.finetune_pad_candidates[0])
    return tokenizer


NEW_PAD_TOKEN = "<|pad|>"


def pad_candidates(tokenizer: Any) -> list[str]:
    """Pad tokens to try, in order, for a tokenizer that has none: eos, unk, a new `<|pad|>`."""
    found = [t for t in (tokenizer.eos_token, tokenizer.unk_token) if isinstance(t, str)]
    return list(dict.fromkeys([*found, NEW_PAD_TOKEN]))


def _set_pad_token(tokenizer: Any, token: str) -> None:
    if token in tokenizer.get_vocab():
        tokenizer.pad_token = token
    else:  # a new special token: build_model grows the embeddings to len(tokenizer)
        tokenizer.add_special_tokens({"pad_token": token})


def _ids_in_use(splits: list[Any]) -> set[int]:
    """Token ids that occur where `attention_mask` is 1 in tokenized datasets (arrow: no Python loop)."""
    import pyarrow.compute as pc

    used: set[int] = set()
    for ds in splits:
        if ds is None or len(ds) == 0:
            continue
        table = ds.with_format("arrow")[:]
        ids = table.column("input_ids").combine_chunks().flatten()
        if "attention_mask" in table.column_names:
            ids = pc.filter(ids, pc.equal(table.column("attention_mask").combine_chunks().flatten(), 1))
        used.update(pc.unique(ids).to_pylist())
    return used


def choose_pad_token(tokenizer: Any, splits: list[Any]) -> str | None:
    """Make sure the pad id never occurs where `attention_mask` is 1 in the tokenized `splits`.

    Decoder classifiers pool the last token that is not the pad id (transformers reads
    `config.pad_token_id`): an eos appended by the tokenizer with pad = eos would move the pooled
    token. A pad chosen by `build_tokenizer` moves on to the next candidate (unk, then a new
    token). A pad the tokenizer ships that is also its eos (SmolLM2, Qwen: a stand-in, not a token of
    its own) is treated the same way; any other shipped pad is refused. Returns the line to log about
    a chosen pad (logged once the run directory exists, so that an error stays the only line of a
    refused run).

    Raises:
        UserError: the tokenizer's own pad token (not its eos) occurs inside the texts.
    """
    used = _ids_in_use(splits)
    candidates = getattr(tokenizer, "finetune_pad_candidates", None)
    shipped = tokenizer.pad_token
    if candidates is None and tokenizer.pad_token_id in used and shipped == tokenizer.eos_token:
        candidates = [t for t in pad_candidates(tokenizer) if t != shipped]
    if candidates is None:
        if tokenizer.pad_token_id in used:
            raise UserError(
                f"the tokenizer's pad token {tokenizer.pad_token!r} (id {tokenizer.pad_token_id}) occurs inside the "
                "tokenized texts: padding could not be told from text (decoder classifiers pool the last non-pad "
                "token); remove it from the data or use a tokenizer whose pad token is not part of the texts"
            )
        return None
    vocab = tokenizer.get_vocab()
    if shipped is None or shipped in candidates:
        why = "has no pad token"
    else:
        why = f"pads with its eos {shipped!r}, which occurs inside the texts"
    for token in candidates:
        if vocab.get(token) not in used:  # a token not in the vocabulary yet never occurs
            _set_pad_token(tokenizer, token)
            return f"the tokenizer {why}: padding with {token!r} (id {tokenizer.pad_token_id})"
    raise AssertionError("a new pad token cannot occur in already tokenized data")


def build_model(
    cfg: Config,
    label_names: list[str],
    tokenizer: Any,
    empty: bool = False,
    targets: torch.Tensor | None = None,
    notes: list[str] | None = None,
) -> PreTrainedModel:
    """A sequence classifier with `num_labels`, `id2label` and `label2id` taken from the data.

    `empty=True` (the planner): parameters on the meta device, never allocated nor loaded (the
    config alone is read); `model.plan_architecture` stands in for a pretrained model's config.
    `targets` (the training labels): the head starts at their base rate (`init_head`) when
    `model.head_init` is prior; what it did is appended to `notes` (logged once the run's log exists).

    Raises:
        UserError: the model or tokenizer cannot be loaded or built, or bitsandbytes cannot quantize it.
    """
    id2label = {i: n for i, n in enumerate(label_names)}
    label2id = {n: i for i, n in enumerate(label_names)}
    m = cfg.model
    labels = {
        "num_labels": len(label_names),
        "id2label": id2label,
        "label2id": label2id,
        "problem_type": m.problem_type,
    }
    if empty:
        model = empty_model(cfg, labels, tokenizer)
    elif m.architecture is not None:
        config = architecture_config(m.architecture, tokenizer, labels)
        model = AutoModelForSequenceClassification.from_config(config)
        if m.quantization is not None:
            model = load_quantized(m.quantization, model, labels, m.trust_remote_code)
    elif m.quantization is not None:
        assert m.source is not None
        model = load_quantized(m.quantization, m.source, labels, m.trust_remote_code)
    else:
        assert m.source is not None
        model = _from_pretrained(
            AutoModelForSequenceClassification,
            m.source,
            "model",
            **labels,  # problem_type into final/config.json: pipeline picks softmax / sigmoid / identity
            ignore_mismatched_sizes=True,
            trust_remote_code=m.trust_remote_code,
            dtype=torch.float32,
        )
    use_pad_token(model, tokenizer)
    if m.pooling == "mean":
        note = append_mean_layer(model)
        if notes is not None:
            notes.append(note)
    if cfg.train.reinit_top_layers:
        reinit_top_layers(model, cfg.train.reinit_top_layers)
    if m.dropout_p is not None:  # before LoRA, whose adapters keep model.lora.dropout
        set_dropout(model, m.dropout_p)
    if m.pooler_init != "checkpoint":
        local = not empty and m.source is not None and m.architecture is None  # auto reads the folder's files
        start_pooler(model, m.pooler_init, resolve_model_path(m.source) if local and m.source else None)
    if targets is not None and m.head_init == "prior":
        note = init_head(model, m.problem_type, targets)
        if note and notes is not None:
            notes.append(note)
    if m.gradient_checkpointing:
        enable_checkpointing(model)
    if m.freeze_embeddings:
        freeze_embeddings(model)
    if m.gradient_checkpointing and (m.freeze_embeddings or m.lora is not None):
        # with frozen inputs to the checkpointed blocks, make the embedding output require grad so
        # that the blocks' recomputation is part of the graph (HF's recommended pairing)
        model.enable_input_require_grads()
    if m.lora is not None:
        model = add_lora(model, m.lora)
    return model


# Families whose learned positions start after the pad id (RoBERTa's `padding_idx + 1` offset): a table of
# 514 rows holds 512 positions
PADDED_POSITIONS = {
    "roberta",
    "xlm-roberta",
    "xlm-roberta-xl",
    "camembert",
    "data2vec-text",
    "longformer",
    "roberta-prelayernorm",
    "ibert",
    "mpnet",
}


def position_limit(config: Any) -> int | None:
    """The most tokens per row a model of this transformers `config` takes, or None where it has no
    absolute position table (DeBERTa-v3's relative attention, families without a position setting).

    Longer rows crash learned absolute positions mid-run (BERT: 512); rotary families are given their
    trained context (`max_position_embeddings`) too, past which quality falls off.
    """
    if getattr(config, "position_biased_input", True) is False:  # DeBERTa-v2/v3: relative positions only
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and limit > 0:
            if getattr(config, "model_type", None) in PADDED_POSITIONS:
                limit -= (getattr(config, "pad_token_id", None) or 0) + 1
            return limit
    return None


def model_config(cfg: Config, tokenizer: Any) -> tuple[Any, str]:
    """The transformers config of the configured model (no weights read) and how to name it in a message.

    Raises:
        UserError: the model config cannot be loaded or built.
    """
    m = cfg.model
    if m.architecture is not None:
        name = f"model.architecture ({m.architecture.get('model_type')})"
        return architecture_config(m.architecture, tokenizer, {}), name
    assert m.source is not None
    config = _from_pretrained(AutoConfig, m.source, "model config", trust_remote_code=m.trust_remote_code)
    return config, m.source


def row_limit(cfg: Config, tokenizer: Any) -> int | None:
    """The most tokens `finetune init` may suggest per row: the model's `position_limit` and the
    tokenizer's model_max_length, whichever is lower; None when neither says.

    Raises:
        UserError: the model config cannot be loaded.
    """
    positions = position_limit(model_config(cfg, tokenizer)[0])
    limits = [positions] if positions is not None else []
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < 1_000_000:  # unset: transformers' VERY_LARGE_INTEGER
        limits.append(tok_limit)
    return min(limits, default=None)


def check_max_length(cfg: Config, tokenizer: Any) -> None:
    """Refuse `data.max_length` above the model's position limit, before any text is tokenized.

    A refusal rather than a silent cap: the run's config.yaml (and resume's compatibility check, and
    the memory plan) would otherwise describe rows the model never saw, and a user who asks for more
    tokens than the model takes usually wants the whole long text, which `data.chunk_stride` gives.

    Raises:
        UserError: `data.max_length` is more than the model's positions.
    """
    config, name = model_config(cfg, tokenizer)
    limit = position_limit(config)
    if limit is not None and cfg.data.max_length > limit:
        raise UserError(
            f"data.max_length={cfg.data.max_length} is more than the {limit} token positions of {name}; set "
            f"data.max_length={limit} (or less), and data.chunk_stride (e.g. {limit // 4}) to read longer texts in "
            "overlapping windows"
        )


def empty_model(cfg: Config, labels: dict[str, Any], tokenizer: Any) -> PreTrainedModel:
    """The classifier with its parameters on the meta device (buffers real: they are small), from
    `model.architecture`, else `model.plan_architecture`, else the pretrained model's config.

    Raises:
        UserError: the config cannot be read or built.
    """
    from accelerate import init_empty_weights

    m = cfg.model
    arch = m.architecture or m.plan_architecture
    if arch is not None:
        config = architecture_config(arch, tokenizer, labels)
    else:
        assert m.source is not None
        config = _from_pretrained(AutoConfig, m.source, "model config", trust_remote_code=m.trust_remote_code, **labels)
    with init_empty_weights(include_buffers=False):
        return AutoModelForSequenceClassification.from_config(config, trust_remote_code=m.trust_remote_code)


def architecture_config(architecture: dict[str, Any], tokenizer: Any, labels: dict[str, Any]) -> Any:
    """The transformers config of `model.architecture` (vocabulary and special ids from the tokenizer).

    Raises:
        UserError: no model_type, or keys the family does not accept.
    """
    arch = dict(architecture)
    model_type = arch.pop("model_type", None)
    if model_type is None:
        raise UserError("model.architecture needs a model_type (e.g. bert)")
    arch.setdefault("vocab_size", len(tokenizer))
    for key in ("pad", "bos", "eos", "cls", "sep"):  # the family defaults may lie outside a small vocab
        arch.setdefault(f"{key}_token_id", getattr(tokenizer, f"{key}_token_id", None))
    try:
        return AutoConfig.for_model(model_type, **labels, **arch)
    except (ValueError, TypeError) as exc:
        raise UserError(f"model.architecture: {exc}") from None


# ----------------------------------------------------------------------------------------------
# Quantized bases (model.quantization: QLoRA).


def quantization_config(kind: str, skip: list[str]) -> Any:
    """transformers' BitsAndBytesConfig for `kind`: 4bit = NF4 with double quantization and bf16
    compute (QLoRA's recipe), 8bit = LLM.int8. `skip` names the modules kept unquantized: the
    classification head (transformers' default skips only the module owning the last parameter,
    right for Llama's `score` and wrong for BERT's `classifier` or DistilBERT's `pre_classifier`).
    Norms and embeddings are not `nn.Linear` and are never quantized."""
    from transformers import BitsAndBytesConfig

    if kind == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            llm_int8_skip_modules=skip,
        )
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)


def import_bitsandbytes(what: str) -> Any:
    """bitsandbytes, imported quietly (its CPU backend logs a warning about an optional kernel package).

    Raises:
        UserError: bitsandbytes is not installed or cannot load on this machine.
    """
    # LLM.int8 casts fp32 inputs to fp16 by design and says so on every call
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
    try:
        import bitsandbytes
    except ImportError:
        raise UserError(f"{what} needs bitsandbytes: pip install bitsandbytes (requirements.txt pins it)") from None
    except Exception as exc:  # a broken native library raises RuntimeError / OSError on import
        raise UserError(f"{what}: bitsandbytes cannot run on this machine ({type(exc).__name__}: {exc})") from None
    return bitsandbytes


def quantized_device() -> Any:
    """Where bitsandbytes puts the weights: this process's GPU (Accelerate refuses a quantized
    model on another device than the one it trains on), else the CPU."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def load_quantized(kind: str, source: str | PreTrainedModel, labels: dict[str, Any], remote: bool) -> PreTrainedModel:
    """The classifier with its base `nn.Linear` layers quantized by bitsandbytes (the head kept).

    `source` is a model name/path, or a model built from `model.architecture`: `from_config` does
    not quantize, so that one is saved to a temporary directory and reloaded from it. The model
    remembers where its unquantized weights are (`finetune_base_source`) for the export.

    Raises:
        UserError: bitsandbytes is missing or cannot run, or the model cannot be loaded.
    """
    what = f"model.quantization={kind}"
    import_bitsandbytes(what)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # the save and reload are internal: no bars
    try:
        return _load_quantized(kind, source, labels, remote, what)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _load_quantized(
    kind: str, source: str | PreTrainedModel, labels: dict[str, Any], remote: bool, what: str
) -> PreTrainedModel:
    keep = None
    if isinstance(source, PreTrainedModel):
        keep = tempfile.TemporaryDirectory(prefix="finetune-base-")
        skip = head_names(source)
        save_on_this_process(source, keep.name)
        path = keep.name
        del source
    else:
        path = resolve_model_path(source)
        config = _from_pretrained(AutoConfig, path, "model config", trust_remote_code=remote, **labels)
        with torch.device("meta"):  # the head's names, without weights
            skip = head_names(AutoModelForSequenceClassification.from_config(config, trust_remote_code=remote))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*cast from torch.float32.*")
        try:
            model = _from_pretrained(
                AutoModelForSequenceClassification,
                path,
                "model",
                **labels,
                ignore_mismatched_sizes=True,
                trust_remote_code=remote,
                dtype=torch.float32,
                quantization_config=quantization_config(kind, skip),
                device_map={"": quantized_device()},
            )
        except (RuntimeError, NotImplementedError, ImportError) as exc:
            first = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"{what}: bitsandbytes cannot quantize this model here ({first})") from None
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            # bitsandbytes' CPU eval path repacks the 4-bit weight in place on AVX512-BF16 CPUs, and fails
            # for layers narrower than its 64-element block: evaluation uses the training kernel instead
            module.support_avx512bf16_for_cpu = False
    # a checkpoint holds bitsandbytes' quantization state beside each weight; the frozen base is
    # rebuilt identically from its source, so loading a checkpoint (resume, best weights) skips it
    model.register_load_state_dict_post_hook(_skip_quantization_state)
    model.finetune_base_source = path
    model.finetune_trust_remote_code = remote
    model.finetune_base_tmp = keep  # the temporary directory lives as long as the model
    return model


QUANT_STATE = ("absmax", "quant_map", "quant_state", "nested_", "SCB", "weight_format")


def _skip_quantization_state(module: torch.nn.Module, result: Any) -> None:
    """Drop bitsandbytes' quantization-state keys from a load's unexpected keys (in place, as torch
    asks), so that a strict load of a QLoRA checkpoint checks every other key."""
    keep = [k for k in result.unexpected_keys if not any(q in k.rsplit("weight.", 1)[-1] for q in QUANT_STATE)]
    result.unexpected_keys[:] = keep


def check_quantized_autocast(cfg: Config) -> None:
    """Refuse what fails mid-run: DeBERTa-v2 on a quantized base under bf16/fp16 autocast.

    With a 4-bit base, bitsandbytes returns a quantized layer's output in its input's dtype (fp32
    under autocast), so DeBERTa's attention fills bf16 scores with fp32's minimum: an overflow error
    at the first step. An 8-bit base with LoRA stops at the same line (run on the tiny DeBERTa-v2).

    Raises:
        UserError: the combination cannot train.
    """
    m = cfg.model
    kind = (m.architecture or {}).get("model_type") or (m.plan_architecture or {}).get("model_type")
    if kind is None and m.architecture is None and m.quantization is not None:
        kind = getattr(_from_pretrained(AutoConfig, m.source or "", "model config"), "model_type", None)
    if m.quantization is not None and kind == "deberta-v2" and cfg.precision.mode in ("bf16", "fp16"):
        raise UserError(
            f"model.quantization with precision.mode={cfg.precision.mode} fails at the first step in DeBERTa-v2's "
            "attention (an overflow: half-precision scores filled with fp32's minimum); use precision.mode=bf16-true "
            "or fp32"
        )


def is_quantized(model: torch.nn.Module) -> bool:
    """The classifier inside `model` (peft, DDP wrappers) has bitsandbytes-quantized weights."""
    hf = classifier_of(model)
    return bool(
        getattr(hf, "is_loaded_in_4bit", False)
        or getattr(hf, "is_loaded_in_8bit", False)
        or getattr(hf.config, "quantization_config", None)
    )


def unquantized_base(model: torch.nn.Module, tokenizer: Any) -> PreTrainedModel:
    """The base of a quantized classifier reloaded unquantized, in the training dtype (bf16 outside
    the norms where bf16-true cast the unquantized weights, else fp32), with room for its pad token:
    what the adapters of `model` are merged into for final/ (merging into NF4 weights is lossy).

    Raises:
        UserError: the unquantized weights cannot be loaded.
    """
    hf = classifier_of(model)
    bf16_true = hf.get_input_embeddings().weight.dtype == torch.bfloat16
    c = hf.config
    base = _from_pretrained(
        AutoModelForSequenceClassification,
        hf.finetune_base_source,
        "model",
        num_labels=c.num_labels,
        id2label=c.id2label,
        label2id=c.label2id,
        problem_type=c.problem_type,
        ignore_mismatched_sizes=True,
        trust_remote_code=getattr(hf, "finetune_trust_remote_code", False),
        dtype=torch.float32,
    )
    use_pad_token(base, tokenizer)
    if bf16_true:
        apply_precision_policy(base, "bf16-true", None)
    return base


@contextlib.contextmanager
def quiet_peft_deprecation() -> Iterator[None]:
    """Around a peft call: peft reads transformers' deprecated `is_gradient_checkpointing`, one
    FutureWarning per call that is not the user's to fix. Other warnings still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def merge_adapter(base: PreTrainedModel, adapter_dir: str) -> PreTrainedModel:
    """peft's adapter directory (adapters and head) loaded onto `base` and merged (`exportable`)."""
    from peft import PeftModel

    with quiet_peft_deprecation():
        return exportable(PeftModel.from_pretrained(base, adapter_dir))


def use_pad_token(model: PreTrainedModel, tokenizer: Any) -> None:
    """The tokenizer's pad id into `model.config` (decoder pooling reads it; so do pipelines on
    final/), and room in the embeddings for a pad token `build_tokenizer` added."""
    if tokenizer.pad_token_id is None:
        return
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        # the new row is never attended to: plain initialisation is enough (mean_resizing would
        # compute a covariance over the whole vocabulary)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.pad_token_id = tokenizer.pad_token_id


# Classification heads of the families tested (tests/test_families.py): what `head_names` finds,
# trained in full under LoRA (peft `modules_to_save`), never LoRA-targeted, merged into final/; the
# names `head_names` falls back to for a model whose base model is not a direct child.
HEAD_NAMES = ("pre_classifier", "classifier", "score", "pooler", "head")


def output_layer(model: PreTrainedModel) -> torch.nn.Linear | None:
    """The head's last linear layer: the one that writes the `num_labels` logits (None if not found)."""
    found = None
    for name in head_names(model):
        for module in getattr(model, name).modules():
            if isinstance(module, torch.nn.Linear) and module.out_features == model.config.num_labels:
                found = module
    return found


def init_head(model: PreTrainedModel, problem_type: str, targets: torch.Tensor) -> str | None:
    """Start the output layer at the training data's base rate (`model.head_init=prior`); returns a log line.

    Multi-label: each bias at the log-odds of its label's positive rate, so the sigmoids start at the
    prior instead of 0.5. Regression: the bias at the target mean and the weights scaled by the target
    standard deviation, which is training on standardised targets with the scale folded into the layer
    (final/ predicts on the original scale). Without it, AdamW moves a bias by about the learning rate
    per step: reaching a mean of 2.7 or log-odds of -3.5 takes thousands of steps, and the first ones
    teach the body the base rate instead of the text. Single-label heads, and a head loaded from a
    classifier checkpoint (continued fine-tuning), are left alone.
    `targets`: multi-hot rows (multi-label) or scores (regression), one per training row.
    """
    layer = output_layer(model)
    if layer is None or layer.bias is None or problem_type == "single_label_classification" or len(targets) == 0:
        return None
    if any(a.endswith("ForSequenceClassification") for a in model.config.architectures or []):
        return "head init: the checkpoint brings its own classification head; kept as loaded"
    t = targets.double()
    with torch.no_grad():
        if problem_type == "regression":
            mean, std = float(t.mean()), float(t.std()) if len(t) > 1 else 1.0
            layer.bias.fill_(mean)
            layer.weight.mul_(std if std > 0 else 1.0)
            return f"head init: output bias at the target mean {mean:.4g}, weights scaled by its std {std:.4g}"
        rate = t.mean(0).clamp(1e-4, 1 - 1e-4)  # a label never (or always) seen keeps a finite logit
        layer.bias.copy_(torch.log(rate / (1 - rate)).to(layer.bias.dtype))
    low, high = float(rate.min()), float(rate.max())
    return f"head init: output biases at each label's log-odds (positive rates {low:.3g} to {high:.3g})"


def freeze_embeddings(model: PreTrainedModel) -> None:
    """Freeze the embedding block (word, position, token-type embeddings and their norm)."""
    block = getattr(model.base_model, "embeddings", None) or model.get_input_embeddings()
    for p in block.parameters():
        p.requires_grad_(False)


def head_names(model: PreTrainedModel) -> list[str]:
    """The classification head: the classifier's top-level modules with parameters outside its base
    model (`score`; `classifier`; DistilBERT's `pre_classifier` + `classifier`; DeBERTa's `pooler`
    + `classifier`; ModernBERT's `head` + `classifier`)."""
    base = getattr(model, "base_model_prefix", "")
    children = dict(model.named_children())
    if base not in children:  # a remote-code model without the usual layout: the known head names only
        return [n for n in HEAD_NAMES if isinstance(children.get(n), torch.nn.Module)]
    return [n for n, c in children.items() if n != base and any(True for _ in c.parameters())]


# A numbered transformer block in a parameter or module name: BERT-style `encoder.layer.3`, decoder and
# ModernBERT `layers.3`, GPT-2-style `h.3`, T5-style `block.3`.
LAYER_PATTERN = re.compile(r"(?:^|\.)(?:layer|layers|h|block|blocks)\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int | None:
    """The block number in a parameter or module name (`bert.encoder.layer.3.output.dense.weight` -> 3)."""
    found = LAYER_PATTERN.search(name)
    return int(found.group(1)) if found else None


def reinit_top_layers(model: PreTrainedModel, n: int) -> None:
    """Re-initialise the top `n` transformer blocks with the model's own initialiser (`_init_weights`).

    Pretrained weights are flagged as initialised, and transformers' initialiser skips flagged
    tensors, so the flags are cleared on the blocks first.

    Raises:
        UserError: the model has fewer than `n` numbered blocks.
    """
    blocks = {}
    for name, module in model.named_modules():
        found = LAYER_PATTERN.search(name)
        if found and found.end() == len(name):  # the block itself (its first number), not a module inside it
            blocks[int(found.group(1))] = module
    if n > len(blocks):
        raise UserError(f"train.reinit_top_layers={n}, but {type(model).__name__} has {len(blocks)} numbered layers")
    for index in sorted(blocks)[len(blocks) - n :]:
        block = blocks[index]
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor._is_hf_initialized = False  # type: ignore[attr-defined]
        for module in block.modules():
            module._is_hf_initialized = False
        block.apply(model._init_weights)


# config keys that hold a dropout probability across families (BERT's hidden_dropout_prob, Llama's
# attention_dropout, GPT-2's resid_pdrop, T5's dropout_rate)
DROPOUT_KEYS = ("dropout", "dropout_prob", "dropout_rate", "pdrop")


def set_dropout(model: PreTrainedModel, p: float) -> list[str]:
    """Every dropout of the model at `p`: its `nn.Dropout` modules, the attention probability the
    attention functions read from a module attribute (`attention_dropout`), and the config keys, so
    that final/config.json says what was trained. Returns the config keys it set."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
        elif isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = p
    keys = [
        k
        for k, v in model.config.to_dict().items()
        if k.endswith(DROPOUT_KEYS) and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    for k in keys:
        setattr(model.config, k, p)
    return keys


# LoRA targets when `model.lora.target_modules` is unset: the attention's query and value
# projections (fused qkv where the family fuses them); other families take peft's own table.
LORA_TARGETS = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "xlm-roberta": ["query", "value"],
    "electra": ["query", "value"],
    "deberta-v2": ["query_proj", "value_proj"],
    "distilbert": ["q_lin", "v_lin"],
    "modernbert": ["Wqkv"],
    "mpnet": ["q", "v"],
    "phi3": ["qkv_proj"],
    "phi": ["q_proj", "v_proj"],
}


def lora_targets(model: PreTrainedModel, configured: list[str] | None) -> list[str]:
    """`model.lora.target_modules`, or the family's default (query and value projections).

    Raises:
        UserError: no default is known for this family and none is configured.
    """
    if configured:
        return list(configured)
    kind = model.config.model_type
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    found = LORA_TARGETS.get(kind) or PEFT_TARGETS.get(kind)
    if not found:
        linear = sorted({n.rsplit(".", 1)[-1] for n, x in model.named_modules() if isinstance(x, torch.nn.Linear)})
        raise UserError(f"model.lora.target_modules: no default for model type {kind!r}; choose among {linear}")
    return list(found)


def add_lora(model: PreTrainedModel, lora: Any) -> Any:
    """Wrap in peft LoRA adapters on `lora.target_modules`; the classification head (`head_names`)
    trains in full (`modules_to_save`: saved with the adapters, merged into final/) and is never
    LoRA-targeted itself, even where its layers share a name with targets (`dense`, `out_proj`).

    Raises:
        UserError: peft is missing or the target modules do not exist outside the head.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    heads = head_names(model)
    in_head = [n for n, _ in model.named_modules() if n and within(n, heads)]
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n and not within(n, heads)}
    targets = lora_targets(model, lora.target_modules)
    head_only = [t for t in targets if t not in names and any(n.rsplit(".", 1)[-1] == t for n in in_head)]
    if head_only:
        raise UserError(
            f"model.lora.target_modules: {head_only} name only modules of the classification head {heads}, which "
            "trains in full without adapters: remove them"
        )
    missing = [t for t in targets if t not in names]
    if missing:
        example = ", ".join(LORA_TARGETS.get(model.config.model_type, ["query", "value"]))
        raise UserError(f"model.lora.target_modules: {missing} are not module names of this model (e.g. {example})")
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        exclude_modules=in_head or None,
        modules_to_save=heads,
    )
    with quiet_peft_deprecation():
        return get_peft_model(model, config)


def exportable(model: torch.nn.Module) -> PreTrainedModel:
    """The plain transformers model to export: LoRA adapters merged (so loading needs no peft).

    The adapted layers are merged in fp32: a bf16 base weight (bf16-true) would round the LoRA
    update, small next to the weight, partly or wholly away (8-bit mantissa); final/'s config says
    float32, so loaders upcast the rest.
    """
    if hasattr(model, "merge_and_unload"):
        from peft.tuners.lora import LoraLayer

        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.get_base_layer().float()
        return model.merge_and_unload()
    return model  # type: ignore[return-value]


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""

    def count(p: torch.Tensor) -> int:  # a 4-bit weight packs two values per uint8 element
        state = getattr(p, "quant_state", None)
        return int(math.prod(state.shape)) if state is not None else p.numel()

    total = sum(count(p) for p in model.parameters())
    trainable = sum(count(p) for p in model.parameters() if p.requires_grad)
    return trainable, total


def classifier_of(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers classifier inside DDP / peft / compile wrappers (the outermost one)."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"no transformers model inside {type(model).__name__}")
