"""The Hub model card of final/: README.md (YAML metadata + a readable page) and the confusion matrix.

The metadata follows the Hub's model card format (`library_name`, `pipeline_tag`, `base_model`,
`datasets`, `metrics`, `model-index`); the `model-index` values are eval.json's numbers for the
weights in final/, copied, never recomputed. The page lists the labels, the problem type, the data
files with their sha256, precision, peak memory (the run's final memory summary) and the resolved
training config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from finetune.config import Config
from finetune.config_io import dump_config
from finetune.memory import MIB, at_peak
from finetune.sources import gguf_origin, hub_id

CONFUSION_PNG = "confusion_matrix.png"
# eval.json key -> (model-index metric type, display name, args)
HUB_METRICS: dict[str, tuple[str, str, dict[str, str] | None]] = {
    "accuracy": ("accuracy", "Accuracy", None),
    "macro_f1": ("f1", "Macro F1", {"average": "macro"}),
    "micro_f1": ("f1", "Micro F1", {"average": "micro"}),
    "subset_accuracy": ("accuracy", "Subset accuracy (exact match)", None),
    "pearson": ("pearsonr", "Pearson correlation", None),
    "spearman": ("spearmanr", "Spearman correlation", None),
    "mse": ("mse", "Mean squared error", None),
}
PROBLEM_TYPES = {
    "single_label_classification": "single-label classification: one label per text (softmax over the labels)",
    "multi_label_classification": "multi-label classification: any number of labels per text (a sigmoid per label, "
                                  "each with its decision threshold)",
    "regression": "regression: one real-valued score per text",
}


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


def _metrics(scores: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, (kind, name, args) in HUB_METRICS.items():
        if key in scores:
            entry: dict[str, Any] = {"type": kind, "value": scores[key], "name": name}
            if args:
                entry["args"] = args
            out.append(entry)
    return out


def card_metadata(cfg: Config, final: dict[str, Any], files: dict[str, Path], name: str) -> dict[str, Any]:
    """The card's YAML metadata; `model-index` holds `final`'s (eval.json's) validation and test values."""
    dataset = dataset_name(cfg, files)
    results = []
    for split, scores in (("validation", final), ("test", final.get("test") or {})):
        metrics = _metrics(scores)
        if metrics:
            results.append({
                "task": {"type": "text-classification", "name": "Text Classification"},
                "dataset": {"name": dataset, "type": dataset, "split": split},
                "metrics": metrics,
            })  # fmt: skip
    meta: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-classification"}
    if base_model(cfg) is not None:
        meta["base_model"] = base_model(cfg)
    meta["datasets"] = [dataset]
    meta["metrics"] = sorted({m["type"] for r in results for m in r["metrics"]})
    meta["tags"] = ["text-classification", "finetune", cfg.model.problem_type.replace("_", "-")]
    meta["model-index"] = [{"name": name, "results": results}]
    return meta


def plot_confusion_matrix(matrix: list[list[int]], label_names: list[str], out: Path) -> None:
    """The validation confusion matrix as a PNG (scikit-learn's display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from sklearn.metrics import ConfusionMatrixDisplay

    size = min(4 + 0.5 * len(label_names), 14)
    fig, ax = plt.subplots(figsize=(size, size))
    ConfusionMatrixDisplay(np.asarray(matrix), display_labels=label_names).plot(ax=ax, colorbar=False,
                                                                               xticks_rotation=45)
    ax.set_title("validation confusion matrix (rows: true label)")
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
    lines = [f"- peak during training: {_mib(report.get('run_peak_bytes'))} ({where}, the highest log interval; "
             f"device {report.get('device')})"]  # fmt: skip
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
        for k in (k for k in HUB_METRICS if k in scores):
            ci = scores.get(f"{k}_ci")
            rows.append(f"| {split} | {HUB_METRICS[k][1]} | {scores[k]:.4f} | "
                        + (f"{ci[0]:.4f} - {ci[1]:.4f} |" if ci else "- |"))  # fmt: skip
    return rows


def card_text(cfg: Config, final: dict[str, Any], label_names: list[str], files: dict[str, Path],
              sha256: dict[str, str], memory: dict[str, Any] | None, name: str, has_matrix: bool) -> str:
    """README.md of final/: metadata front matter, then the page."""
    meta = card_metadata(cfg, final, files, name)
    thresholds = final.get("thresholds")
    labels = ["| id | label |" + (" threshold |" if thresholds else ""), "|---:|---|" + ("---:|" if thresholds else "")]
    labels += [f"| {i} | {n} |" + (f" {thresholds[i]:.2f} |" if thresholds else "") for i, n in enumerate(label_names)]
    data = ["| split | file | sha256 |", "|---|---|---|"]
    data += [f"| {split} | `{path.name}` | `{sha256.get(split, '-')}` |" for split, path in files.items()]
    if cfg.data.hub_dataset is not None and not files:
        data.append(f"| all | hub dataset `{cfg.data.hub_dataset}` | - |")
    start = f"`{meta['base_model']}`" if "base_model" in meta else f"`{cfg.model.name_or_path}`"
    if cfg.model.architecture is not None:
        start = "a model built from scratch (`model.architecture`)"
    elif (gguf := gguf_origin(cfg.model.source)) is not None:
        start += f" (its weights read from the GGUF file `{gguf}` and dequantized: they carry that file's quantization)"
    body = [
        f"# {name}", "",
        f"A text classifier fine-tuned from {start} on {meta['datasets'][0]} with "
        f"finetune (final/ holds the {final.get('exported', 'last')} weights, "
        f"optimizer step {final.get('step')}).", "",
        "```python", "from transformers import pipeline", "",
        'classify = pipeline("text-classification", model="PATH_OR_HUB_ID", truncation=True)',
        'print(classify("a fine film"))', "```", "",
        "## Labels", "", f"Problem type: {PROBLEM_TYPES[cfg.model.problem_type]}.", "", *labels, "",
        "## Evaluation", "", "The numbers of eval.json for these weights (the model-index above holds the same).", "",
        *_scores_table(final), "",
        *([f"![confusion matrix]({CONFUSION_PNG})", ""] if has_matrix else []),
        "## Data", "", *data, "",
        "## Training", "",
        f"- precision: `{cfg.precision.mode}`; optimizer `{cfg.train.optimizer}`, learning rate "
        f"{cfg.train.learning_rate:g}, {cfg.train.epochs:g} epoch(s), max length {cfg.data.max_length} tokens",
        *memory_lines(memory), "",
        "The resolved training config (`finetune train --config` reproduces the run with the same data):", "",
        "```yaml", dump_config(cfg).rstrip(), "```", "",
    ]  # fmt: skip
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    return f"---\n{front}---\n\n" + "\n".join(body)


def write_model_card(out: Path, cfg: Config, final: dict[str, Any], label_names: list[str],
                     files: dict[str, Path], sha256: dict[str, str], memory: dict[str, Any] | None) -> None:
    """final/README.md, and final/confusion_matrix.png when the validation has a confusion matrix (and
    `log.plots` is on)."""
    matrix = final.get("confusion_matrix") if cfg.log.plots else None
    if matrix:
        plot_confusion_matrix(matrix, label_names, out / CONFUSION_PNG)
    name = Path(cfg.run.output_dir).resolve().name
    (out / "README.md").write_text(card_text(cfg, final, label_names, files, sha256, memory, name, bool(matrix)))


def read_front_matter(readme: Path) -> dict[str, Any]:
    """The YAML metadata of a model card (what the Hub reads)."""
    text = readme.read_text()
    _, front, _ = text.split("---\n", 2)
    return yaml.safe_load(front) or {}

