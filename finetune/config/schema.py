"""Typed config schema: the only home of defaults.

Every key with its type, default and description. Unknown keys are errors with a did-you-mean
suggestion; `finetune.config.files` reads a YAML file plus dotted overrides into a `Config` and
reports every problem at once in one `UserError`; `finetune.config.docs` renders this schema
as docs/CONFIG.md and configs/schema.json.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from finetune.config.tasks import METRICS, MULTI, PROBLEM_TYPES, REGRESSION, SINGLE

# ----------------------------------------------------------------------------------------------
# The schema.

# the names the schema accepts come from the registry (finetune.config.tasks): Literal[...] of these tuples
_PROBLEM_TYPES = tuple(PROBLEM_TYPES)
_METRICS = tuple(METRICS)


# Resume refuses any difference between the checkpoint's config and this one (`checkpoint.config_differences`), in
# a newly added key too: a changed value may change the weights. A key that cannot (where files are, intervals,
# workers, what a sweep searches) is declared `json_schema_extra=MAY_CHANGE_ON_RESUME` beside its default
# (`keys_that_may_change_on_resume()` collects them); a nested value (model.lora, sweep.space) compares as one.
MAY_CHANGE_ON_RESUME: dict[str, Any] = {"resume": "may_change"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    """`run`: where the run writes, its seed, and whether a non-empty output directory may be replaced."""

    output_dir: str = Field(
        description="the run directory: checkpoints, metrics.jsonl, eval.json, final/",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    seed: int = Field(42, description="seed of weights init, data order, dropout and the validation split")
    overwrite: bool = Field(
        False,
        description="replace a non-empty run directory of an earlier run (only a finetune run's: it holds config.yaml)",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    num_threads: PositiveInt | Literal["auto"] = Field(
        "auto",
        description="CPU threads per process for torch's intra-op work; auto = the cores this process may use "
        "divided among the processes on this machine (`accelerate launch` alone would leave 1)",
        # intra-op threads: the same arithmetic on CPU fp32 (reductions are per output)
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )


class LoraConfig(_Section):
    """`model.lora`: peft LoRA adapters (rank, scale, dropout, the modules they wrap)."""

    r: PositiveInt = Field(8, description="LoRA rank of the adapter matrices")
    alpha: PositiveFloat = Field(16.0, description="LoRA scale numerator (the update is scaled by alpha / r)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the LoRA input")
    target_modules: list[str] | None = Field(
        None,
        description="module names to wrap with adapters; unset = the family's query and value projections "
        "(query/value, q_proj/v_proj, q_lin/v_lin, Wqkv, qkv_proj); the classification head is never a target",
    )


class ModelConfig(_Section):
    """`model`: pretrained model or from-scratch architecture, tokenizer, memory switches, compile."""

    problem_type: Literal[_PROBLEM_TYPES] = Field(
        SINGLE,
        description="transformers' problem_type, written into final/config.json: one label per text (softmax), "
        "any number of labels per text (sigmoid, per-label thresholds), or a real-valued score (one output)",
    )
    name_or_path: str | None = Field(
        "minilm-l6",
        description="a local model directory, a package alias (minilm-l6; mpnet-base, needs the mpnet extra; "
        "smollm2-135m, a decoder), a .gguf file, or a hub id (needs network)",
    )
    gguf_file: str | None = Field(
        None,
        description="a GGUF file (llama.cpp) inside the model.name_or_path folder; a GGUF file is dequantized once "
        "into a cache folder ($FINETUNE_CACHE, else ~/.cache/finetune) and then trained as an ordinary checkpoint",
    )
    architecture: dict[str, Any] | None = Field(
        None,
        description="build a model from scratch from these config keys (model_type and sizes) instead of loading one",
    )
    plan_architecture: dict[str, Any] | None = Field(
        None,
        description="the pretrained model's dimensions (model_type and sizes, as model.architecture) for `finetune "
        "plan` without its weights or network; training ignores it",
    )
    tokenizer: str | None = Field(
        None,
        description="tokenizer directory/alias/hub id when it differs from model.name_or_path "
        "(required with architecture)",
    )
    trust_remote_code: bool = Field(
        False, description="let transformers run code shipped with a hub model (off: untrusted code never runs)"
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass (non-reentrant): less memory, ~30% more compute"
    )
    freeze_embeddings: bool = Field(
        False, description="train no embedding parameters (less gradient and optimizer memory)"
    )
    lora: LoraConfig | None = Field(
        None, description="train peft LoRA adapters instead of all weights (the classification head trains in full)"
    )
    quantization: Literal["4bit", "8bit"] | None = Field(
        None,
        description="load the frozen base quantized with bitsandbytes (4bit: NF4, double quantization, bf16 compute; "
        "8bit: LLM.int8) and train LoRA on it (QLoRA; needs model.lora); the head and norms stay unquantized, "
        "final/ is the unquantized base with the adapters merged",
    )
    head_init: Literal["prior", "probe", "random"] = Field(
        "prior",
        description="the output layer's starting point: prior sets its bias to each label's log-odds in the training "
        "data (multi-label) or to the target mean, with weights scaled by the target spread (regression), so the "
        "first steps learn the text rather than the base rate; single-label heads keep the model's random init; "
        "probe (single-label): a logistic regression fitted on the starting model's features of the training rows "
        "(what the output layer reads), written into the output layer, so fine-tuning starts from a linear probe "
        "(few rows a class: `finetune init` writes it); random: the model's own init everywhere",
        json_schema_extra=MAY_CHANGE_ON_RESUME,  # a resumed run's head comes from the checkpoint
    )
    pooling: Literal["first", "mean"] = Field(
        "first",
        description="what the classifier reads: first, the family's own (the first token's state, through its pooler "
        "where it has one); mean, a frozen layer appended to the encoder that puts the mean of the token states into "
        "the first position (the pooling sentence-transformers checkpoints were trained with), so final/ stays the "
        "family's own *ForSequenceClassification with one more layer (BERT, RoBERTa, ELECTRA and MPNet families; "
        "docs/ARCHITECTURE.md)",
    )
    pooler_init: Literal["auto", "checkpoint", "identity"] = Field(
        "auto",
        description="the pooler's dense layer (BERT-family: tanh(W h_CLS + b) feeds the classifier) as the checkpoint "
        "has it, or identity (W = I, b = 0): for sentence-transformers checkpoints (all-MiniLM-L6-v2), whose "
        "pooler was never trained and has near-zero weights (docs/ARCHITECTURE.md); auto: identity where the model has "
        "a pooler and its folder is a sentence-transformers checkpoint (modules.json), else the checkpoint's (MPNet's "
        "classifier has no pooler); final/ stays a stock model",
        json_schema_extra=MAY_CHANGE_ON_RESUME,  # a resumed run's pooler comes from the checkpoint
    )
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] | Literal["auto"] | None = Field(
        "auto",
        description="every dropout probability of the model (hidden, attention, classifier) set to this; null: the "
        "checkpoint's own (0.1 in BERT-family models); auto: 0 for regression (train-time dropout shifts the "
        "spread of a regression output that evaluation, without dropout, sees: docs/ARCHITECTURE.md), else null",
    )
    compile: bool = Field(
        False, description="torch.compile the model in place (clean state_dict keys); graphs counted in metrics.jsonl"
    )
    compile_mode: str | None = Field(None, description="torch.compile mode (e.g. max-autotune); null: the default")
    compile_dynamic: bool | None = Field(
        None, description="torch.compile dynamic: null lets the first new length make the graph dynamic (recommended)"
    )
    compile_backend: str = Field(
        "inductor", description="torch.compile backend (inductor; aot_eager for fast plumbing tests)"
    )

    @model_validator(mode="after")
    def _source(self) -> ModelConfig:
        if self.architecture is not None and self.tokenizer is None:
            raise ValueError("model.architecture builds a model from scratch and needs model.tokenizer")
        if self.architecture is None and self.name_or_path is None:
            raise ValueError("set model.name_or_path (or model.architecture with model.tokenizer)")
        if self.gguf_file is not None and (self.architecture is not None or self.name_or_path is None):
            raise ValueError("model.gguf_file names a file inside the model.name_or_path folder: set that folder")
        if self.quantization is not None and self.lora is None:
            raise ValueError(
                f"model.quantization={self.quantization} freezes the base in {self.quantization} weights, which cannot "
                "be trained: set model.lora (e.g. model.lora={r: 8}) to train adapters on it (QLoRA)"
            )
        return self

    @property
    def dropout_p(self) -> float | None:
        """The dropout probability `model.dropout` sets for this problem type; None keeps the checkpoint's."""
        if self.dropout == "auto":
            return 0.0 if self.problem_type == REGRESSION else None
        return self.dropout

    @property
    def source(self) -> str | None:
        """What the weights (and, unless model.tokenizer is set, the tokenizer) are read from."""
        if self.gguf_file is not None and self.name_or_path is not None:
            return str(Path(self.name_or_path) / self.gguf_file)
        return self.name_or_path


class DataConfig(_Section):
    """`data`: files or hub dataset, how to parse them, columns, labels, lengths and slices."""

    data_dir: str | None = Field(
        None,
        description="directory the relative data paths are resolved against",
        json_schema_extra=MAY_CHANGE_ON_RESUME,  # where the files are: resume compares their sha256 instead
    )
    train_file: str | None = Field(
        None,
        description="training data: a csv/tsv/json/jsonl/parquet/text file, a saved dataset, or a folder with "
        "one sub-folder per label",
    )
    validation_file: str | None = Field(
        None, description="validation data in the same layout (or use data.validation_split)"
    )
    test_file: str | None = Field(None, description="test data, evaluated once at the end on the weights in final/")
    hub_dataset: str | None = Field(None, description="a HuggingFace hub dataset name instead of files (needs network)")
    hub_config: str | None = Field(None, description="the hub dataset's configuration name")
    hub_train_split: str = Field("train", description="the hub split to train on")
    hub_validation_split: str | None = Field("validation", description="the hub split to validate on (null: none)")
    hub_test_split: str | None = Field(None, description="the hub split to test on (null: none)")
    format: Literal["auto", "csv", "tsv", "json", "jsonl", "parquet", "text"] = Field(
        "auto", description="file format; auto: from the extension"
    )
    delimiter: str | None = Field(None, description="csv/tsv field separator; null: comma for csv, tab for tsv")
    quoting: Literal["minimal", "none"] = Field(
        "minimal", description="csv/tsv quoting: minimal (quote-aware) or none (quotes are text: STS-B, MRPC, SST-2)"
    )
    header: bool = Field(True, description="the first csv/tsv line names the columns")
    column_names: list[str] | None = Field(None, description="column names for a file without a header (or to rename)")
    encoding: str = Field("utf-8", description="text encoding of the data files (utf-8-sig strips a BOM)")
    line_regex: str | None = Field(
        None, description="text files: a regular expression with named groups for the text and label columns"
    )
    text_column: str = Field("text", description="the column holding the text")
    text_pair_column: str | None = Field(
        None, description="a second text per row (sentence pairs: NLI, paraphrase, similarity)"
    )
    swap_pairs: bool = Field(
        False,
        description="pairs whose order carries no meaning (paraphrase, similarity): also train on every pair as "
        "(second, first), which doubles the training rows of an epoch; evaluation reads the pairs as given",
    )
    label_column: str = Field(
        "label",
        description="the column holding the label (single label, a list for multi-label, or a number for regression)",
    )
    label_delimiter: str | None = Field(
        None,
        description="multi-label: the label column holds names or ids joined by this string (e.g. ','); "
        'without it a JSON list (\'["a", "b"]\') or a list value is read',
    )
    label_columns: list[str] | None = Field(
        None, description="multi-label: one 0/1 column per label (the column names are the label names)"
    )
    labels_file: str | None = Field(
        None,
        description="label names, one per line; line number = label id (ids in the data are mapped to these names)",
    )
    label_files: dict[str, str] | None = Field(
        None,
        description="one text file per label, one text per line: {label: path}; replaces data.train_file "
        "(use data.validation_split for validation)",
    )
    encoding_errors: Literal["strict", "replace"] = Field(
        "strict",
        description="undecodable bytes: strict = one-line error naming the file; replace = U+FFFD (e.g. one "
        "odd file in a folder-per-label corpus)",
    )
    labels: list[str] | None = Field(None, description="label names in id order; labels outside it are an error")
    label_map: dict[str, str] | None = Field(
        None, description="raw label -> name (e.g. {0: negative, 1: positive}); the names' order gives the ids"
    )
    validation_split: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="fraction of train held out for validation (seeded, stratified for single-label; copies of a "
        "text stay together)",
    )
    max_length: PositiveInt = Field(
        128, description="tokens per row; longer texts are truncated (data.truncation) or windowed (data.chunk_stride)"
    )
    truncation: Literal["head", "tail", "head_tail"] | None = Field(
        None,
        description="what a text longer than max_length keeps: its start (head, the default), its end (tail), or "
        "both (head_tail: data.head_fraction of the tokens from the start, the rest from the end)",
    )
    head_fraction: float = Field(0.25, gt=0.0, lt=1.0, description="head_tail: the share of tokens kept from the start")
    chunk_stride: NonNegativeInt | None = Field(
        None,
        description="split long texts into windows of max_length overlapping by this many tokens instead of "
        "truncating: training sees every window (weighted 1/windows of its text), evaluation and predict "
        "aggregate the windows' logits per text (data.chunk_aggregate)",
    )
    chunk_aggregate: Literal["mean", "max"] = Field(
        "mean", description="how the windows' logits of one text are combined in evaluation and predict"
    )
    exclude_rows: str | None = Field(
        None,
        description="a CSV whose `row` column lists training rows to leave out (0-based data rows of the train file, "
        "the header not counted), e.g. `finetune audit`'s label_issues.csv or your edited copy; a path as given, not "
        "under data.data_dir; where it has a `text` column, each row's text must match the file's",
    )
    max_train_samples: PositiveInt | None = Field(
        None, description="use only the first N training rows (after the validation split)"
    )
    max_eval_samples: PositiveInt | None = Field(None, description="use only the first N validation and test rows")
    group_by_length: bool = Field(
        True, description="batch similar lengths together within shuffled windows (less padding, same samples per step)"
    )
    # several training sequences per row with block-diagonal attention (BERT/RoBERTa-family encoders);
    # evaluation and prediction stay unpacked
    packing: bool = Field(
        False, description="several training sequences per row with block-diagonal attention (BERT-family encoders)"
    )
    num_workers: int = Field(
        0,
        ge=0,
        description="DataLoader worker processes for training and evaluation",
        # workers only read and collate; the loaders have their own generators
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )

    @field_validator("labels", "label_map", mode="before")
    @classmethod
    def _int_labels_as_text(cls, value: Any) -> Any:
        # `label_map: {1: World}` and `labels: [0, 1]` are natural YAML; raw labels are compared as text
        def text(v: Any) -> Any:
            return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

        if isinstance(value, dict):
            return {text(k): text(v) for k, v in value.items()}
        if isinstance(value, list):
            return [text(v) for v in value]
        return value

    @model_validator(mode="after")
    def _sources(self) -> DataConfig:
        sources = [k for k in ("train_file", "hub_dataset", "label_files") if getattr(self, k) is not None]
        if not sources:
            raise ValueError("set data.train_file (or data.hub_dataset, or data.label_files)")
        if len(sources) > 1:
            raise ValueError(f"set only one of {', '.join('data.' + k for k in sources)}")
        if self.label_columns is not None and self.label_delimiter is not None:
            raise ValueError(
                "data.label_columns (one 0/1 column per label) and data.label_delimiter exclude each other"
            )
        if self.swap_pairs and self.text_pair_column is None:
            raise ValueError("data.swap_pairs swaps the two texts of a pair: set data.text_pair_column")
        if self.validation_split is not None and (self.validation_file is not None):
            raise ValueError(
                "data.validation_split carves a validation set from train: do not also set data.validation_file"
            )
        if self.line_regex is not None:
            try:
                rx = re.compile(self.line_regex)
            except re.error as exc:
                raise ValueError(f"data.line_regex is not a valid regular expression: {exc}") from None
            missing = {self.text_column, self.label_column} - set(rx.groupindex)
            if missing:
                raise ValueError(
                    f"data.line_regex needs named groups {sorted(missing)} (data.text_column / data.label_column)"
                )
        return self


class TrainConfig(_Section):
    """`train`: length, batch sizes, optimizer, schedule, clipping, logging/eval intervals, early stopping."""

    epochs: PositiveFloat = Field(3, description="passes over the training data (fractions allowed)")
    max_steps: PositiveInt | None = Field(
        None, description="stop after this many optimizer steps (whichever of epochs and max_steps ends first)"
    )
    micro_batch_size: PositiveInt | Literal["auto"] = Field(
        32, description="samples per forward pass per process; auto: the largest that fits memory.budget_gb"
    )
    gradient_accumulation_steps: PositiveInt = Field(
        1, description="micro-batches summed per optimizer step (exact: the window's full-batch gradient)"
    )
    batch_size: PositiveInt | None = Field(
        None,
        description="the effective batch (micro-batch x accumulation x processes); alone it replaces "
        "micro_batch_size and gradient_accumulation_steps, which then follow the process count",
    )
    learning_rate: PositiveFloat = Field(5e-5, description="peak learning rate (after warmup)")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay (not on biases and norm weights)")
    warmup_ratio: float = Field(0.06, ge=0.0, lt=1.0, description="share of the optimizer steps with a linear warmup")
    warmup_steps: int | None = Field(None, ge=0, description="warmup in optimizer steps (overrides warmup_ratio)")
    lr_scheduler: Literal["linear", "cosine", "constant"] = Field(
        "linear", description="decay after warmup: linear, cosine or constant"
    )
    optimizer: Literal["adamw", "adamw8bit", "adafactor", "sgd"] = Field(
        "adamw",
        description="adamw (fused where possible), adamw8bit (CUDA, bitsandbytes), adafactor (factored state), sgd",
    )
    momentum: float = Field(0.0, ge=0.0, lt=1.0, description="sgd momentum")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Adam first-moment decay")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Adam second-moment decay")
    adam_epsilon: PositiveFloat = Field(1e-8, description="Adam denominator epsilon")
    max_grad_norm: PositiveFloat | None = Field(1.0, description="clip the global gradient norm (null: no clipping)")
    eval_every_steps: PositiveInt | None = Field(
        None,
        description="evaluate on validation every N optimizer steps (and always at the end)",
        # except with train.early_stopping_patience, where the evaluations decide the step training stops at
        # (checkpoint.config_differences)
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    log_every_steps: PositiveInt = Field(
        10, description="a metrics.jsonl training row every N optimizer steps", json_schema_extra=MAY_CHANGE_ON_RESUME
    )
    nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="NaN/inf loss or gradient: stop with a one-line error, or skip the step"
    )
    class_weights: Literal["auto"] | list[PositiveFloat] | None = Field(
        None,
        description="single-label: weight each sample's loss by its class (a list in label-id order, or auto = "
        "inverse class frequency in the training split, mean 1); each window is normalised by its summed weights",
    )
    loss: Literal["cross_entropy", "focal"] = Field(
        "cross_entropy",
        description="focal = cross-entropy x (1 - p_true)^focal_gamma (single-label; per label for multi-label)",
    )
    focal_gamma: float = Field(2.0, ge=0.0, description="train.loss=focal: how strongly easy samples are down-weighted")
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="single-label cross-entropy against (1 - e) x the label + e spread evenly over the classes "
        "(torch's label_smoothing); 0: none",
    )
    contrastive_steps: int = Field(
        0,
        ge=0,
        description="optimizer steps of contrastive tuning that open the run (single-label, few rows a class): the "
        "features the output layer reads, compared by cosine between every two rows of a micro-batch, pulled to 1 "
        "for rows of one label and to 0 for rows of different labels, same- and different-label pairs weighing "
        "alike (SetFit's objective, over the micro-batch's pairs); after the last of them the output layer is "
        "refitted as model.head_init=probe does, and the classification loss takes over; 0: none",
    )
    early_stopping_patience: PositiveInt | None = Field(
        None, description="stop after this many evaluations without improving checkpoint.best_metric"
    )
    max_minutes: PositiveFloat | None = Field(
        None,
        description="wall-time budget of the training loop in minutes (evaluations included, kept across resumes): "
        "the run ends at the first step past it, every process at the same step, with the best checkpoint as "
        "final/ (needs validation, train.eval_every_steps and checkpoint.export=best); a larger one on resume gives "
        "an interrupted run more time, not one the budget ended",
        json_schema_extra=MAY_CHANGE_ON_RESUME,  # how long a run may take, not what a step computes
    )
    layer_lr_decay: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="layer-wise learning-rate decay: the layer below the top gets learning_rate x decay, the one "
        "below x decay^2, down to the embeddings (the head and what sits above the last layer keep learning_rate); "
        "1: off",
    )
    head_learning_rate: PositiveFloat | None = Field(
        None, description="peak learning rate of the classification head (null: train.learning_rate)"
    )
    reinit_top_layers: int = Field(
        0, ge=0, description="re-initialise the top N transformer layers of a pretrained model before training"
    )
    bootstrap_resamples: int = Field(
        1000,
        ge=0,
        description="bootstrap resamples for the 95% confidence intervals of eval.json's headline metrics (0: none)",
    )
    calibrate: bool = Field(
        True,
        description="single-label with a validation set: fit a temperature on validation after training and fold "
        "it into final/'s output layer (calibrated probabilities; ECE, Brier and NLL before/after in eval.json, on "
        "validation, cross-fitted on its halves and on test); none from too few validation rows, and none kept "
        "where it does not lower the cross-fitted NLL; multi-label and regression are left as trained",
        # applied to final/ at the end only: the checkpoints hold the weights as trained
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )

    @model_validator(mode="after")
    def _patience(self) -> TrainConfig:
        # patience counts periodic evaluations: without them the run would silently never stop early
        if self.early_stopping_patience is not None and self.eval_every_steps is None:
            raise ValueError("train.early_stopping_patience counts evaluations: set train.eval_every_steps")
        return self


class PrecisionConfig(_Section):
    """`precision`: fp32 / fp16 / bf16 / bf16-true and the numerical safeguards that go with them."""

    mode: Literal["fp32", "fp16", "bf16", "bf16-true"] = Field(
        "fp32",
        description="fp32; bf16 / fp16 mixed precision (fp16 on CUDA only); bf16-true: bf16 weights with fp32 norms",
    )
    fp32_norms: bool | None = Field(None, description="keep norm layers in fp32; null: on for bf16-true, off otherwise")
    norm_class_names: list[str] = Field(
        [], description="extra norm class names to keep in fp32 (a model's own norm classes)"
    )
    bf16_update: Literal["stochastic", "kahan", "plain"] = Field(
        "kahan",
        description="bf16-true optimizer update: kahan-compensated, stochastic rounding, or plain (loses small steps)",
    )
    allow_dtype_mismatch: bool = Field(
        False, description="run even when the dtype audit finds tensors contradicting the policy"
    )
    empty_cache: bool = Field(
        True,
        description="release cached CUDA blocks at epoch ends and before evaluation",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    deterministic: bool = Field(False, description="deterministic kernels (bitwise exact resume on CUDA; slower)")
    cudnn_attention: bool = Field(
        False,
        description="let scaled-dot-product attention use cuDNN's fused kernel on CUDA; off: it builds an execution "
        "graph for every new sequence length, and length-grouped batches bring many (flash and memory-efficient "
        "kernels have no such cost); fp32 never uses it",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )


class CheckpointConfig(_Section):
    """`checkpoint`: interval, resume, rotation, best metric and what `final/` holds."""

    every_steps: PositiveInt | None = Field(
        None,
        description="write a checkpoint every N optimizer steps (a preemption writes one regardless)",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    resume: str | None = Field(
        None,
        description="auto: continue from the newest complete checkpoint of run.output_dir; a path: that checkpoint",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    keep_last: PositiveInt = Field(
        2, description="keep the newest N checkpoints (and the best)", json_schema_extra=MAY_CHANGE_ON_RESUME
    )
    best_metric: Literal[_METRICS] | None = Field(
        None,
        description="the evaluation metric that picks the best checkpoint and drives early stopping ("
        + " and ".join(sorted(m.name for m in METRICS.values() if m.lower_is_better))
        + ": lower is better); default per model.problem_type: "
        + ", ".join(p.headline[0] for p in PROBLEM_TYPES.values()),
    )
    best_within_se: NonNegativeFloat = Field(
        0.0,
        description="rotation and final/ take the latest checkpoint within this many standard errors of the best "
        "best_metric seen (a small validation set cannot rank nearby checkpoints: the further-trained weights win); "
        "proportions only (accuracy, subset_accuracy); 0: the best, the earliest on ties",
    )
    export: Literal["last", "best"] = Field(
        "last",
        description="what final/ holds: the last weights or the best checkpoint's",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )

    @model_validator(mode="after")
    def _export(self) -> CheckpointConfig:
        if self.export == "best" and self.every_steps is None:
            raise ValueError("checkpoint.export=best chooses among checkpoints: set checkpoint.every_steps")
        return self


class MemoryConfig(_Section):
    """`memory`: the budget the planner fits into, the peak's breakdown, and CUDA allocator history recording."""

    budget_gb: PositiveFloat | None = Field(
        None, description="memory budget (GiB) the planner fits the micro-batch into (train.micro_batch_size: auto)"
    )
    record_history: bool = Field(
        False,
        description="record the CUDA allocator history into each checkpoint (memory_snapshot.pickle)",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    breakdown: bool = Field(
        True,
        description="split the peak by category (parameters, gradients, optimizer state, activations) with "
        "MemTracker on two training windows, step 2 and the epoch's heaviest; each sampled window runs several "
        "times slower (a fixed cost, not per step); false: memory.json has the measured peaks only",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    lean_heaviest_window: bool = Field(
        True,
        description="on a CPU with glibc, hand the heap's free pages back before each epoch's heaviest window and "
        "give its large blocks mappings of their own (freed at once): a lower peak RSS for that window's page "
        "faults; false: glibc's defaults throughout",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )


class LogConfig(_Section):
    """`log`: Accelerate trackers to log to, and the plots of a run."""

    # every tracker of Accelerate's `log_with` but "all" (whatever happens to be installed: a run should
    # log where its config says)
    trackers: list[
        Literal["tensorboard", "wandb", "trackio", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab"]
    ] = Field(
        [],
        description="Accelerate trackers that also receive metrics.jsonl's rows and the resolved config (its "
        "package must be installed: pip install mlflow, wandb, ...; each reads its own settings from the "
        "environment, e.g. MLFLOW_TRACKING_URI, WANDB_MODE); the tracker's run is named after run.output_dir",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    plots: bool = Field(
        True,
        description="draw curves.png, memory.png and final/confusion_matrix.png at the end of the run (matplotlib, "
        "about 1 s; `finetune report RUN --plots` draws the first two later)",
    )


class SweepRange(_Section):
    """One hyper-parameter of `sweep.space`: a range (`low`, `high`, `log`) or a list of `choices`."""

    low: float | None = Field(None, description="smallest value of a range")
    high: float | None = Field(None, description="largest value of a range")
    log: bool = Field(False, description="sample the range log-uniformly (learning rates)")
    choices: list[Any] | None = Field(None, description="sample one of these values instead of a range")

    @model_validator(mode="after")
    def _range(self) -> SweepRange:
        if self.choices is not None:
            if self.low is not None or self.high is not None or not self.choices:
                raise ValueError("give either choices (a non-empty list) or low and high, not both")
            return self
        if self.low is None or self.high is None or self.low > self.high:
            raise ValueError("a range needs low <= high (or give choices)")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        return self


# the search space of `finetune sweep` when a config has none (train.* keys)
DEFAULT_SWEEP_SPACE = {
    "train.learning_rate": {"low": 1e-5, "high": 1e-3, "log": True},
    "train.warmup_ratio": {"low": 0.0, "high": 0.2},
    "train.weight_decay": {"low": 0.0, "high": 0.1},
}


class SweepConfig(_Section):
    """`sweep`: what `finetune sweep` searches (Optuna TPE, median pruning); `finetune train` ignores it."""

    # every sweep.* key may change on resume: a trial's own values are in the other sections
    space: dict[str, SweepRange] = Field(
        default_factory=lambda: {k: SweepRange(**v) for k, v in DEFAULT_SWEEP_SPACE.items()},
        description="dotted config key -> {low, high, log} or {choices}; default: train.learning_rate log-uniform "
        "1e-5..1e-3, train.warmup_ratio 0..0.2, train.weight_decay 0..0.1",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    random_trials: NonNegativeInt = Field(
        10,
        description="trials sampled at random before TPE models the results (Optuna's n_startup_trials)",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    startup_trials: NonNegativeInt = Field(
        3,
        description="trials that run to the end before median pruning may stop a trial early",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    warmup_evaluations: NonNegativeInt = Field(
        0,
        description="evaluations of a trial before it may be pruned (pruning compares train.eval_every_steps "
        "evaluations)",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    baseline: bool = Field(
        True,
        description="the first trial of a new study runs the config's own values (when they are in the space)",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )


class AuditConfig(_Section):
    """`audit`: how `finetune audit` finds the training rows whose label is likely wrong; `train` ignores it."""

    folds: int = Field(
        5,
        ge=2,
        description="K of the K-fold cross-validation: each row's probabilities come from the run that trained on "
        "the other K-1 folds (at most the rows of the smallest class)",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    epochs: PositiveFloat | None = Field(
        None,
        description="passes over each fold's training rows; null: each class seen about 800 times over a fold's run "
        "(init's rule), at least 1 and at most train.epochs: large data trains one pass a fold (K passes in all), "
        "a few hundred rows a class the passes a model needs to learn them",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )
    filter_by: Literal[
        "low_self_confidence",
        "low_normalized_margin",
        "prune_by_noise_rate",
        "prune_by_class",
        "both",
        "confident_learning",
        "predicted_neq_given",
    ] = Field(
        "low_self_confidence",
        description="cleanlab's rule for which rows are label issues (cleanlab.filter.find_label_issues): "
        "low_self_confidence flags the rows whose given label gets the lowest probability, as many as cleanlab "
        "estimates are wrong (count.num_label_issues); it flagged fewer right labels than cleanlab's default "
        "prune_by_noise_rate at the same recall on the data sets measured (docs/RESULTS.md)",
        json_schema_extra=MAY_CHANGE_ON_RESUME,
    )


class DistillConfig(_Section):
    """`distill`: knowledge distillation from a trained teacher's final/ into the model this run trains."""

    teacher: str | None = Field(
        None,
        description="a run's final/ folder whose logits the student learns from (`finetune distill --teacher`); its "
        "label names and problem type must be the data's; null: no distillation",
    )
    temperature: PositiveFloat = Field(
        2.0,
        description="softens the teacher's and the student's distributions in the soft-target loss (single- and "
        "multi-label); that loss is scaled by temperature^2 so its gradients keep their size",
    )
    alpha: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="the weight of the loss against the gold labels; 1 - alpha weighs the loss against the teacher's "
        "outputs (unlabeled rows have the teacher's term only); 0, the student learns from the teacher alone, "
        "measured ahead of 0.5 with distill.loss=mse (docs/RESULTS.md)",
    )
    loss: Literal["kl", "mse"] = Field(
        "mse",
        description="the loss against the teacher's outputs: kl, the temperature-softened KL divergence (x T^2; "
        "binary cross-entropy per label for multi-label); mse, the squared difference of the logits (centred for "
        "single-label; the temperature does not enter); regression always matches the teacher's value squared",
    )
    unlabeled_file: str | None = Field(
        None,
        description="extra texts without labels that the student learns from the teacher's outputs alone, read with "
        "the data.* reading keys and data.text_column (and data.text_pair_column); a label column is ignored; a "
        "relative path is under data.data_dir",
        json_schema_extra=MAY_CHANGE_ON_RESUME,  # where the file is: resume compares its sha256 instead
    )


def closest_name(word: str, names: typing.Iterable[str]) -> str | None:
    """The one of `names` a mistyped `word` most likely meant, for a did-you-mean hint; None when none is close."""
    close = difflib.get_close_matches(word, list(names), n=1, cutoff=0.6)
    return close[0] if close else None


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The schema class inside a field's annotation (`LoraConfig | None` -> LoraConfig)."""
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _settable(key: str) -> Any:
    """The field a dotted key names, when a sweep trial may set it (not run.* or sweep.*); else None."""
    parts = key.split(".")
    if len(parts) < 2 or parts[0] in ("run", "sweep", "audit", "distill"):
        return None
    cls: Any = Config
    for part in parts[:-1]:
        field = cls.model_fields.get(part)
        cls = _section_class(field.annotation) if field is not None else None
        if cls is None:
            return None
    return cls.model_fields.get(parts[-1])


def _settable_keys() -> list[str]:
    return [
        f"{s}.{f}"
        for s, h in Config.model_fields.items()
        if s not in ("run", "sweep", "audit", "distill")
        for f in _section_class(h.annotation).model_fields
    ]


class Config(_Section):
    """The whole run: every section with its defaults."""

    run: RunConfig
    model: ModelConfig = ModelConfig()
    data: DataConfig
    train: TrainConfig = TrainConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    memory: MemoryConfig = MemoryConfig()
    log: LogConfig = LogConfig()
    sweep: SweepConfig = SweepConfig()
    audit: AuditConfig = AuditConfig()
    distill: DistillConfig = DistillConfig()

    @model_validator(mode="after")
    def _batch(self) -> Config:
        t = self.train
        if t.micro_batch_size == "auto" and self.memory.budget_gb is None:
            raise ValueError("train.micro_batch_size=auto needs memory.budget_gb")
        if t.micro_batch_size == "auto" and t.batch_size is None:
            raise ValueError("train.micro_batch_size=auto needs train.batch_size (the effective batch to keep)")
        # effective batch = micro-batch x accumulation x processes: batch_size alone replaces the two
        # keys; with both given they must agree (the process count is checked at launch, window.resolve_batch)
        given = t.model_fields_set
        if t.batch_size is not None and t.micro_batch_size != "auto" and "micro_batch_size" in given:
            g = t.gradient_accumulation_steps if "gradient_accumulation_steps" in given else None
            if t.batch_size % (int(t.micro_batch_size) * (g or 1)):
                raise ValueError(
                    f"train.batch_size={t.batch_size} must equal train.micro_batch_size ({t.micro_batch_size}) x "
                    f"train.gradient_accumulation_steps ({g or 'derived'}) x processes"
                )
        return self

    @model_validator(mode="after")
    def _problem_type(self) -> Config:
        kind, d = self.model.problem_type, self.data
        allowed = PROBLEM_TYPES[kind].best_metrics
        if self.checkpoint.best_metric is None:
            self.checkpoint.best_metric = allowed[0]
        elif self.checkpoint.best_metric not in allowed:
            raise ValueError(
                f"checkpoint.best_metric={self.checkpoint.best_metric} is not a metric of model.problem_type={kind}; "
                f"choose one of {list(allowed)}"
            )
        if (c := self.checkpoint).best_within_se and not METRICS[c.best_metric].proportion:
            raise ValueError(f"checkpoint.best_within_se counts standard errors of a proportion, not {c.best_metric}")
        if kind != MULTI and (d.label_columns is not None or d.label_delimiter is not None):
            raise ValueError(
                "data.label_columns / data.label_delimiter describe multi-label data: set "
                "model.problem_type=multi_label_classification"
            )
        if kind == REGRESSION and (d.labels is not None or d.label_map is not None or d.label_files is not None):
            raise ValueError(
                "model.problem_type=regression has one real-valued label: remove data.labels / "
                "data.label_map / data.label_files"
            )
        if kind != SINGLE and self.train.class_weights is not None:
            raise ValueError(f"train.class_weights weights classes of single-label data, not {kind}")
        if kind != SINGLE and self.train.contrastive_steps:
            raise ValueError(f"train.contrastive_steps pairs rows by their one label: single-label data, not {kind}")
        if self.train.contrastive_steps and (self.data.packing or self.distill.teacher is not None):
            raise ValueError(
                "train.contrastive_steps compares one row's features with another's: not with data.packing (rows "
                "share a sequence) nor distill.teacher (the student learns the teacher's outputs)"
            )
        if kind != SINGLE and self.model.head_init == "probe":
            raise ValueError(f"model.head_init=probe fits a single-label logistic regression, not {kind}")
        if kind == REGRESSION and self.train.loss == "focal":
            raise ValueError("train.loss=focal is a classification loss; model.problem_type=regression uses MSE")
        if self.train.label_smoothing and (kind != SINGLE or self.train.loss == "focal"):
            raise ValueError("train.label_smoothing smooths single-label cross-entropy, not focal, multi-label or MSE")
        if d.truncation is not None and d.chunk_stride is not None:
            raise ValueError("data.truncation and data.chunk_stride exclude each other: chunks keep every token")
        if d.chunk_stride is not None and d.chunk_stride >= d.max_length:
            raise ValueError(
                f"data.chunk_stride={d.chunk_stride} must be smaller than data.max_length ({d.max_length}) minus the "
                "special tokens, or no window would advance"
            )
        if d.text_pair_column is not None and (d.chunk_stride is not None or d.truncation not in (None, "head")):
            raise ValueError("data.chunk_stride and data.truncation=tail/head_tail take single texts, not pairs")
        if kind == MULTI and d.label_files is not None:
            raise ValueError(
                "data.label_files gives one label per text: use model.problem_type=single_label_classification"
            )
        return self

    @model_validator(mode="after")
    def _sweep_space(self) -> Config:
        for key in self.sweep.space:
            if _settable(key) is None:
                close = closest_name(key, _settable_keys())
                hint = f" (did you mean {close}?)" if close else ""
                raise ValueError(f"sweep.space: {key} is not a config key that a trial can set{hint}")
        return self

    @model_validator(mode="after")
    def _distill(self) -> Config:
        if self.distill.teacher is None:
            return self
        t = self.train
        if t.loss == "focal" or t.label_smoothing:
            # the soft-target term already replaces the hard one-hot target: a second reshaping of it is not defined
            raise ValueError(
                "distill.teacher trains on the teacher's outputs: set train.loss=cross_entropy and "
                "train.label_smoothing=0"
            )
        if self.data.swap_pairs:
            raise ValueError(
                "distill.teacher and data.swap_pairs do not go together: the teacher scored each pair in "
                "its given order"
            )
        return self

    @model_validator(mode="after")
    def _packing(self) -> Config:
        if self.data.packing and self.model.compile:
            # a packed batch's rows and capacity change every step; the pooling hook is per batch
            raise ValueError("data.packing and model.compile do not go together yet: turn one off")
        return self

    @model_validator(mode="after")
    def _recipes(self) -> Config:
        if self.train.reinit_top_layers and self.model.quantization is not None:
            # quantized blocks are frozen 4/8-bit weights: a fresh draw could never train
            raise ValueError("train.reinit_top_layers needs trainable blocks; model.quantization freezes them")
        if self.train.reinit_top_layers and self.model.name_or_path is None:
            raise ValueError(
                "train.reinit_top_layers re-draws layers of a pretrained model; model.architecture "
                "builds every layer fresh already"
            )
        # a time budget ends the run wherever it is: final/ must be the best weights seen, so something must rank them
        d, why = self.data, "train.max_minutes ends the run with the best checkpoint as final/"
        validation = d.validation_file or d.validation_split or (d.hub_dataset and d.hub_validation_split)
        if self.train.max_minutes and not validation:
            raise ValueError(f"{why}: give validation data (data.validation_file or data.validation_split)")
        if self.train.max_minutes and (self.train.eval_every_steps is None or self.checkpoint.export != "best"):
            raise ValueError(f"{why}: set train.eval_every_steps, checkpoint.every_steps and checkpoint.export=best")
        return self

    def resolved_path(self, path: str | None) -> Path | None:
        """A data path resolved against `data.data_dir` when relative."""
        if path is None:
            return None
        p = Path(path).expanduser()
        if not p.is_absolute() and self.data.data_dir is not None:
            p = Path(self.data.data_dir).expanduser() / p
        return p
