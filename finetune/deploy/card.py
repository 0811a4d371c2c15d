"""The Hub model card of final/: README.md (YAML metadata + a readable page) and the confusion matrix.

huggingface_hub writes the card: `ModelCardData` holds the metadata (`library_name`, `pipeline_tag`,
`base_model`, `datasets`, `metrics`, `tags`) and one `EvalResult` per metric and split, from which it
builds the `model-index`; `ModelCard` joins that YAML and the page and saves README.md. The values are
eval.json's numbers for the weights in final/, copied, never recomputed; which metrics appear and
under which Hub names is the registry's (`tasks.METRICS`). `ModelCard.validate` posts the card to the
Hub, so it is never called here (training is offline); the checks that run offline are
`EvalResult`'s and the model-index parsing of `ModelCard.load`, which the tests apply to the card.
The page lists the labels, the problem type, the data files with their sha256, precision, peak
memory (the run's final memory summary) and the resolved training config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from finetune.config.files import dump_config
from finetune.config.schema import Config
from finetune.config.tasks import METRICS, PROBLEM_TYPES, Metric
from finetune.memory.monitor import MIB, at_peak
from finetune.model.sources import gguf_origin, hub_id

CONFUSION_PNG = "confusion_matrix.png"
TASK = ("text-classification", "Text Classification")  # the model-index task: type, name
# the metadata keys in the order the card lists them (huggingface_hub's own order would put base_model first)
KEY_ORDER = ["library_name", "pipeline_tag", "base_model", "datasets", "metrics", "tags"]


def base_model(cfg: Config) -> str | None:
    """The hub id the weights started from; None for a from-scratch architecture or a local directory."""
    name = cfg.model.name_or_path
    if cfg.model.architecture is not None or name is None:
        return None
    return hub_id(name)


def dataset_name(cfg: Config, files: dict[str, Path]) -> str:
    """The hub dataset, else the folder holding the training file (e.g. `sst2`)."""
    if cfg.data.hub_dataset is not None:
        return cfg.data.hub_dataset
    train = files.get("train") or next(iter(files.values()), None)
    return train.parent.name if train is not None else "local files"


def _on_card(scores: dict[str, Any]) -> list[Metric]:
    """The registry's card metrics that `scores` (eval.json, or its `test`) holds, in the registry's order."""
    return [m for m in METRICS.values() if m.hub_type is not None and m.name in scores]


def card_data(cfg: Config, final: dict[str, Any], files: dict[str, Path], name: str) -> ModelCardData:
    """The card's metadata; its `model-index` holds `final`'s (eval.json's) validation and test values.

    Raises:
        ValueError: huggingface_hub refuses the evaluation results (a bug here, not the user's).
    """
    dataset = dataset_name(cfg, files)
    results = [
        EvalResult(
            task_type=TASK[0],
            task_name=TASK[1],
            dataset_type=dataset,
            dataset_name=dataset,
            dataset_split=split,
            metric_type=m.hub_type,
            metric_value=scores[m.name],
            metric_name=m.hub_name,
            metric_args=dict(m.hub_args) if m.hub_args else None,
        )
        for split, scores in (("validation", final), ("test", final.get("test") or {}))
        for m in _on_card(scores)
    ]
    return ModelCardData(
        library_name="transformers",
        pipeline_tag=TASK[0],
        base_model=base_model(cfg),  # None: left out
        datasets=[dataset],
        metrics=sorted({r.metric_type for r in results}),
        tags=[TASK[0], "finetune", cfg.model.problem_type.replace("_", "-")],
        model_name=name,
        eval_results=results,
    )


def plot_confusion_matrix(
    matrix: list[list[int]],
    label_names: list[str],
    out: Path,
    title: str = "validation confusion matrix (rows: true label)",
    axes: tuple[str, str] = ("Predicted label", "True label"),
) -> None:
    """A confusion matrix as a PNG (scikit-learn's display): the validation's by default; `axes`: the x and y
    axis names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from sklearn.metrics import ConfusionMatrixDisplay

    size = min(4 + 0.5 * len(label_names), 14)
    fig, ax = plt.subplots(figsize=(size, size))
    ConfusionMatrixDisplay(np.asarray(matrix), display_labels=label_names).plot(
        ax=ax, colorbar=False, xticks_rotation=45
    )
    ax.set_title(title)
    ax.set_xlabel(axes[0])
    ax.set_ylabel(axes[1])
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v / MIB:,.1f} MiB"


def memory_lines(report: dict[str, Any] | None) -> list[str]:
    """The card's memory section from the run's final memory summary (memory.json)."""
    if not report:
        return ["No memory report was written for this run."]
    cuda, cpu = report.get("cuda") or {}, report.get("cpu") or {}
    where = "CUDA allocated" if cuda else "process RSS"
    lines = [
        f"- peak during training: {_mib(report.get('run_peak_bytes'))} ({where}, the highest log interval; "
        f"device {report.get('device')})"
    ]
    if cuda:
        lines.append(f"- peak CUDA reserved at the end of the run: {_mib(cuda.get('peak_reserved_bytes'))}")
    split = at_peak(report)
    if split is not None:
        parts = ", ".join(f"{k.replace('_', ' ')} {_mib(v)}" for k, v in split.items())
        lines.append(f"- the sampled window's peak, {_mib(report.get('peak_bytes'))}: {parts}")
    if report.get("gradients_bytes") is not None:
        lines.append(f"- all gradients at the optimizer step: {_mib(report['gradients_bytes'])}")
    if cpu.get("peak_rss_bytes") and not cuda:
        lines.append(f"- peak RSS of the final phase: {_mib(cpu['peak_rss_bytes'])}")
    return lines


def _scores_table(final: dict[str, Any]) -> list[str]:
    """Each split's metrics, with eval.json's bootstrap interval (`<metric>_ci`) where it has one."""
    rows = ["| split | metric | value | bootstrap interval (eval.json) |", "|---|---|---:|---|"]
    for split, scores in (("validation", final), ("test", final.get("test") or {})):
        for m in _on_card(scores):
            ci = scores.get(f"{m.name}_ci")
            rows.append(
                f"| {split} | {m.hub_name} | {scores[m.name]:.4f} | "
                + (f"{ci[0]:.4f} - {ci[1]:.4f} |" if ci else "- |")
            )
    return rows


def distill_lines(cfg: Config, unlabeled: int) -> list[str]:
    """The card's line on a distilled model's teacher (`distill.*`); none for a model trained on labels alone."""
    if (d := cfg.distill).teacher is None:
        return []
    soft = f"KL at temperature {d.temperature:g}" if d.loss == "kl" else "squared logit differences"
    return [
        f"- distilled from the teacher `{d.teacher}` ({soft}, alpha {d.alpha:g}: alpha x "
        "the loss against the labels + (1 - alpha) x the loss against the teacher's outputs), with "
        f"{unlabeled} unlabeled rows learnt from the teacher alone"
        + (f" (`{Path(d.unlabeled_file).name}`)" if d.unlabeled_file else "")
    ]


def fewshot_lines(cfg: Config) -> list[str]:
    """The card's lines on mean pooling, a probe head and a contrastive opening (the few-shot recipe's keys)."""
    m, lines = cfg.model, []
    if m.pooling == "mean":
        lines.append(
            "- mean pooling: the encoder's last layer is a frozen one that puts the mean of the token states into "
            "the first position, which the classifier reads (`model.pooling: mean`; `num_hidden_layers` counts it)"
        )
    if m.head_init == "probe":
        lines.append("- the output layer started from a logistic regression on the training rows' features")
    if cfg.train.contrastive_steps:
        lines.append(
            f"- the first {cfg.train.contrastive_steps} optimizer steps were contrastive (rows of one label pulled "
            "together, of different labels apart), the head refitted after them"
        )
    return lines


def model_card(
    cfg: Config,
    final: dict[str, Any],
    label_names: list[str],
    files: dict[str, Path],
    sha256: dict[str, str],
    memory: dict[str, Any] | None,
    name: str,
    has_matrix: bool,
    excluded: int = 0,
    unlabeled: int = 0,
) -> ModelCard:
    """README.md of final/: the metadata (`card_data`) as front matter, then the page.

    Raises:
        ValueError: huggingface_hub refuses the metadata (a bug here, not the user's).
    """
    meta = card_data(cfg, final, files, name)
    thresholds = final.get("thresholds")
    labels = ["| id | label |" + (" threshold |" if thresholds else ""), "|---:|---|" + ("---:|" if thresholds else "")]
    labels += [f"| {i} | {n} |" + (f" {thresholds[i]:.2f} |" if thresholds else "") for i, n in enumerate(label_names)]
    data = ["| split | file | sha256 |", "|---|---|---|"]
    data += [f"| {split} | `{path.name}` | `{sha256.get(split, '-')}` |" for split, path in files.items()]
    if cfg.data.hub_dataset is not None and not set(files) - {"exclude_rows"}:
        data.append(f"| all | hub dataset `{cfg.data.hub_dataset}` | - |")
    if excluded:
        data += ["", f"{excluded} training rows were left out, as `data.exclude_rows` (the file above) lists them."]
    start = f"`{meta.base_model}`" if meta.base_model is not None else f"`{cfg.model.name_or_path}`"
    if cfg.model.architecture is not None:
        start = "a model built from scratch (`model.architecture`)"
    elif (gguf := gguf_origin(cfg.model.source)) is not None:
        start += f" (its weights read from the GGUF file `{gguf}` and dequantized: they carry that file's quantization)"
    body = [
        f"# {name}",
        "",
        f"A text classifier fine-tuned from {start} on {meta.datasets[0]} with "
        f"finetune (final/ holds the {final.get('exported', 'last')} weights, "
        f"optimizer step {final.get('step')}).",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        'classify = pipeline("text-classification", model="PATH_OR_HUB_ID", truncation=True)',
        'print(classify("a fine film"))',
        "```",
        "",
        "## Labels",
        "",
        f"Problem type: {PROBLEM_TYPES[cfg.model.problem_type].description}.",
        "",
        *labels,
        "",
        "## Evaluation",
        "",
        "The numbers of eval.json for these weights (the model-index above holds the same).",
        "",
        *_scores_table(final),
        "",
        *([f"![confusion matrix]({CONFUSION_PNG})", ""] if has_matrix else []),
        "## Data",
        "",
        *data,
        "",
        "## Training",
        "",
        f"- precision: `{cfg.precision.mode}`; optimizer `{cfg.train.optimizer}`, learning rate "
        f"{cfg.train.learning_rate:g}, {cfg.train.epochs:g} epoch(s), max length {cfg.data.max_length} tokens",
        *distill_lines(cfg, unlabeled) + fewshot_lines(cfg) + memory_lines(memory),
        "",
        "The resolved training config (`finetune train --config` reproduces the run with the same data):",
        "",
        "```yaml",
        dump_config(cfg).rstrip(),
        "```",
        "",
    ]
    # ModelCard parses the front matter back into ModelCardData (the model-index into EvalResults) and
    # keeps the order of its keys when it writes the card
    return ModelCard(f"---\n{meta.to_yaml(original_order=KEY_ORDER)}\n---\n\n" + "\n".join(body))


def write_model_card(
    out: Path,
    cfg: Config,
    final: dict[str, Any],
    label_names: list[str],
    files: dict[str, Path],
    sha256: dict[str, str],
    memory: dict[str, Any] | None,
    excluded: int = 0,
    unlabeled: int = 0,
) -> None:
    """final/README.md, and final/confusion_matrix.png when the validation has a confusion matrix (and
    `log.plots` is on); `excluded`: the training rows `data.exclude_rows` left out; `unlabeled`: the rows of
    `distill.unlabeled_file` a distilled model learnt from its teacher alone."""
    matrix = final.get("confusion_matrix") if cfg.log.plots else None
    if matrix:
        plot_confusion_matrix(matrix, label_names, out / CONFUSION_PNG)
    name = Path(cfg.run.output_dir).resolve().name
    card = model_card(cfg, final, label_names, files, sha256, memory, name, bool(matrix), excluded, unlabeled)
    card.save(out / "README.md")
