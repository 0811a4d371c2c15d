"""The user's task and data layout: multi-label, regression, pairs, one folder or one file per label.

Exactness per problem type against a plain-torch full-batch reference (SGD), metrics against
independent numpy/scipy computations, layouts on small real files from ../shared/data, the bad
inputs of each new option (one line, exit 2), and final/ as pipeline, predict and evaluate read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import PLAIN_SGD, sgd_from_saved_start, write_tiny_config
from safetensors.torch import load_file
from sklearn.metrics import f1_score

from finetune.cli import main as cli_main
from finetune.config.files import load_config
from finetune.data.reading import load_raw_splits
from finetune.data.window import WindowedBatchSampler
from finetune.evaluation.metrics import compute_metrics, predictions, tune_thresholds
from finetune.train import main

pytestmark = pytest.mark.usefixtures("one_thread", "data_dir")  # conftest.py
ROOT = Path(__file__).resolve().parent.parent

GOEMOTIONS = {
    "model.problem_type": "multi_label_classification",
    # the smaller files stand in for train (43k rows take seconds to read): dev -> train, test -> validation and test
    "data.train_file": "goemotions/dev.tsv",
    "data.validation_file": "goemotions/test.tsv",
    "data.test_file": "goemotions/test.tsv",
    "data.format": "tsv",
    "data.header": False,
    "data.quoting": "minimal",
    "data.column_names": ["text", "labels", "id"],
    "data.text_column": "text",
    "data.label_column": "labels",
    "data.label_delimiter": ",",
    "data.labels_file": "goemotions/emotions.txt",
    "data.label_map": None,
}
STSB = {
    "model.problem_type": "regression",
    "data.train_file": "stsb/dev.tsv",
    "data.validation_file": "stsb/dev.tsv",
    "data.text_column": "sentence1",
    "data.text_pair_column": "sentence2",
    "data.label_column": "score",
    "data.label_map": None,
}
SGD = {**PLAIN_SGD, "data.max_eval_samples": 24}


def _run(tmp_path: Path, updates: dict[str, Any], name: str = "tiny.yaml") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = write_tiny_config(tmp_path, updates, name=name)
    assert main(["--config", str(cfg)]) == 0
    return tmp_path / "run"


def _one_line_error(capfd: pytest.CaptureFixture[str]) -> str:
    err = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


# ----------------------------------------------------------------------------------------------
# Exact accumulation per problem type.


@pytest.mark.slow
@pytest.mark.parametrize("shape", [GOEMOTIONS, STSB], ids=["multi_label", "regression"])
def test_accumulated_sgd_equals_full_batch_gradient(shape: dict[str, Any], tmp_path: Path) -> None:
    # windows of 16, 16 and 8 samples (the short tail): each step must be plain SGD on the mean loss
    # over the window's samples (mean BCE over labels and samples; mean squared error)
    scratch, tok, data, model, cfg = sgd_from_saved_start(tmp_path, {**shape, **SGD}, seed=7)
    init, run = tmp_path / "init", tmp_path / "run"
    assert main(["--config", str(cfg)]) == 0
    sampler = WindowedBatchSampler(
        data.train["length"][:],
        batch_size=8,
        accumulation=2,
        seed=scratch.run.seed,
        group_by_length=scratch.data.group_by_length,
    )
    sampler.set_epoch(0)
    batches = list(sampler)
    windows = [[i for b in batches[w : w + 2] for (i, _, _) in b] for w in range(0, len(batches), 2)]
    assert [len(w) for w in windows] == [16, 16, 8]
    model.train()
    for idx in windows:
        rows = [data.train[i] for i in idx]
        enc = tok.pad(
            [{k: r[k] for k in ("input_ids", "attention_mask", "token_type_ids")} for r in rows], return_tensors="pt"
        )
        labels = torch.tensor([r["labels"] for r in rows], dtype=torch.float32)
        logits = model(**enc).logits.float()
        if shape is STSB:
            loss = ((logits.squeeze(-1) - labels) ** 2).mean()
        else:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 1.0 * p.grad
    final = load_file(str(run / "final" / "model.safetensors"))
    ref = model.state_dict()
    diff = max(float((final[k] - ref[k]).abs().max()) for k in final)
    moved = max(float((final[k] - load_file(str(init / "model.safetensors"))[k]).abs().max()) for k in final)
    assert diff <= 1e-4 * moved and moved > 1e-3, (diff, moved)


# ----------------------------------------------------------------------------------------------
# Metrics against independent computations.


def test_metrics_against_numpy_and_scipy() -> None:
    rng = np.random.default_rng(0)
    y = rng.normal(size=50)
    pred = y + rng.normal(scale=0.5, size=50)
    m = compute_metrics("regression", y, pred[:, None], ["score"])
    assert m["pearson"] == pytest.approx(np.corrcoef(pred, y)[0, 1])
    ranks = lambda a: np.argsort(np.argsort(a))  # noqa: E731 - no ties in continuous data
    assert m["spearman"] == pytest.approx(np.corrcoef(ranks(pred), ranks(y))[0, 1])
    assert m["mse"] == pytest.approx(np.mean((pred - y) ** 2))

    truth = (rng.random((60, 3)) < [0.5, 0.2, 0.05]).astype(float)
    logits = rng.normal(size=(60, 3)) + 2 * (truth - 0.5)
    probs = 1 / (1 + np.exp(-logits))
    th = tune_thresholds(truth, probs)
    for j in range(3):  # the tuned threshold is the F1-best on the grid (brute force)

        def f1(t: float, j: int = j) -> float:
            tp = float(((probs[:, j] >= t) & (truth[:, j] == 1)).sum())
            return 2 * tp / max(1.0, (probs[:, j] >= t).sum() + truth[:, j].sum())

        assert f1(th[j]) == pytest.approx(max(f1(t) for t in np.arange(0.05, 0.951, 0.05)))
    m = compute_metrics("multi_label_classification", truth, logits, ["a", "b", "c"], [0.5, 0.5, 0.5])
    pred = probs >= 0.5
    tp, fp, fn = (pred & (truth == 1)).sum(), (pred & (truth == 0)).sum(), (~pred & (truth == 1)).sum()
    assert m["micro_f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert m["subset_accuracy"] == pytest.approx(float((pred == (truth == 1)).all(1).mean()))
    assert set(m["per_label"]) == {"a", "b", "c"} and m["thresholds"] == [0.5, 0.5, 0.5]


def test_predictions_against_plain_numpy() -> None:
    # the one rule from logits to predictions (metrics, predictions.jsonl, predict, evaluate, export, calibration)
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(40, 4)) * 3).astype(np.float32)
    z = logits.astype(np.float64)

    probs, predicted = predictions(logits, "single_label_classification")
    softmax = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    assert probs is not None and probs.dtype == np.float64
    np.testing.assert_allclose(probs, softmax, rtol=1e-12, atol=0)
    assert np.array_equal(predicted, z.argmax(1)) and np.array_equal(predicted, softmax.argmax(1))

    sigmoid = 1 / (1 + np.exp(-z))
    thresholds = [0.2, 0.5, 0.7, 0.95]
    for cut, per_label in ((thresholds, np.array(thresholds)), (None, np.full(4, 0.5))):
        probs, predicted = predictions(logits, "multi_label_classification", cut)
        assert probs is not None and probs.dtype == np.float64
        np.testing.assert_allclose(probs, sigmoid, rtol=1e-12, atol=0)
        assert predicted.dtype == bool and np.array_equal(predicted, sigmoid >= per_label[None, :])
    assert not np.array_equal(predictions(logits, "multi_label_classification", thresholds)[1], sigmoid >= 0.5)
    # a label exactly at its threshold is predicted (at or above): sigmoid(0) is 0.5
    _, at = predictions(np.zeros((1, 2), np.float32), "multi_label_classification", [0.5, 0.5000001])
    assert at.tolist() == [[True, False]]

    probs, predicted = predictions(logits[:, :1], "regression")
    assert probs is None and predicted.dtype == np.float64 and np.array_equal(predicted, z[:, 0])


# ----------------------------------------------------------------------------------------------
# Layouts.


def test_folder_per_label_reads_documents_and_skips_top_level_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus"
    for label, docs in {"sport": ["a goal\n\nlate in the game", "the match"], "tech": ["a chip", "new phone"]}.items():
        (corpus / label).mkdir(parents=True)
        for i, text in enumerate(docs):
            (corpus / label / f"{i}.txt").write_text(text)
    (corpus / "README.TXT").write_text("not a document")
    base = {
        "data.train_file": str(corpus),
        "data.validation_file": None,
        "data.validation_split": 0.5,
        "data.label_map": None,
        "data.max_train_samples": None,
        "data.max_eval_samples": None,
    }
    cfg = load_config(write_tiny_config(tmp_path, base))
    with caplog.at_level("INFO", logger="finetune"):
        raw = load_raw_splits(cfg)
    assert "skipped top-level files ['README.TXT']" in caplog.text
    assert raw.label_names == ["sport", "tech"]
    texts = sorted(raw.train["text"][:] + raw.validation["text"][:])
    assert texts == sorted(["a goal\n\nlate in the game", "the match", "a chip", "new phone"])
    # an undecodable document: strict names the file, replace reads it
    (corpus / "tech" / "2.txt").write_bytes(b"caf\xe9 latte")
    assert main(["--config", str(write_tiny_config(tmp_path, base))]) == 2
    line = _one_line_error(capfd)
    assert "tech/2.txt" in line and "data.encoding_errors=replace" in line
    raw = load_raw_splits(load_config(write_tiny_config(tmp_path, {**base, "data.encoding_errors": "replace"})))
    assert any("caf\ufffd latte" == t for t in raw.train["text"][:] + raw.validation["text"][:])
    (corpus / "empty").mkdir()
    assert main(["--config", str(write_tiny_config(tmp_path, {**base, "data.encoding_errors": "replace"}))]) == 2
    line = _one_line_error(capfd)
    assert "label folder" in line and "empty" in line


def test_label_files_and_duplicate_safe_validation_split(tmp_path: Path) -> None:
    (tmp_path / "pos.txt").write_text("great\nlovely\n\nsuperb\nsame text\n")
    (tmp_path / "neg.txt").write_text("awful\ndull\nsame text\nweak\n")
    cfg = load_config(
        write_tiny_config(
            tmp_path,
            {
                "data.train_file": None,
                "data.validation_file": None,
                "data.label_map": None,
                "data.label_files": {"positive": str(tmp_path / "pos.txt"), "negative": str(tmp_path / "neg.txt")},
                "data.validation_split": 0.3,
                "data.max_train_samples": None,
                "data.max_eval_samples": None,
            },
        )
    )
    raw = load_raw_splits(cfg)
    assert raw.label_names == ["negative", "positive"] and len(raw.train) + len(raw.validation) == 8
    assert not set(raw.train["text"][:]) & set(raw.validation["text"][:])  # "same text" on one side only
    assert set(raw.files) == {"train:positive", "train:negative"}


def test_multi_label_layouts_agree(tmp_path: Path) -> None:
    # the same three rows as ids joined by ',' (with a labels file), as JSON lists and as 0/1 columns
    (tmp_path / "names.txt").write_text("joy\nanger\nfear\n")
    (tmp_path / "ids.tsv").write_text("text\tlabels\nso happy\t0\nfurious and scared\t1,2\nhappy but scared\t0,2\n")
    (tmp_path / "lists.jsonl").write_text(
        "".join(
            json.dumps({"text": t, "labels": ls}) + "\n"
            for t, ls in [
                ("so happy", ["joy"]),
                ("furious and scared", ["anger", "fear"]),
                ("happy but scared", ["joy", "fear"]),
            ]
        )
    )
    (tmp_path / "cols.csv").write_text(
        "text,joy,anger,fear\nso happy,1,0,0\nfurious and scared,0,1,1\nhappy but scared,1,0,1\n"
    )
    common = {
        "model.problem_type": "multi_label_classification",
        "data.validation_file": None,
        "data.label_map": None,
        "data.text_column": "text",
        "data.quoting": "minimal",
        "data.format": "auto",
        "data.max_train_samples": None,
    }
    layouts = {
        "ids": {
            "data.train_file": str(tmp_path / "ids.tsv"),
            "data.label_column": "labels",
            "data.label_delimiter": ",",
            "data.labels_file": str(tmp_path / "names.txt"),
        },
        "lists": {
            "data.train_file": str(tmp_path / "lists.jsonl"),
            "data.label_column": "labels",
            "data.labels": ["joy", "anger", "fear"],
        },
        "cols": {"data.train_file": str(tmp_path / "cols.csv"), "data.label_columns": ["joy", "anger", "fear"]},
    }
    targets = {}
    for name, layout in layouts.items():
        raw = load_raw_splits(load_config(write_tiny_config(tmp_path, {**common, **layout}, name=f"{name}.yaml")))
        assert raw.label_names == ["joy", "anger", "fear"], name
        targets[name] = raw.targets(raw.train)
    assert targets["ids"] == targets["lists"] == targets["cols"] == [[1, 0, 0], [0, 1, 1], [1, 0, 1]]


@pytest.mark.parametrize(
    "updates, message",
    [
        (
            {
                "data.train_file": "goemotions/dev.tsv",
                "data.format": "tsv",
                "data.header": False,
                "data.column_names": ["text", "label", "id"],
                "data.text_column": "text",
                "data.label_column": "label",
                "data.quoting": "minimal",
                "data.label_map": None,
                "data.validation_file": None,
            },
            "joins other labels with ','",
        ),
        (
            {
                "data.train_file": "goemotions/dev.tsv",
                "data.format": "tsv",
                "data.header": False,
                "data.column_names": ["text", "label", "id"],
                "data.text_column": "text",
                "data.label_column": "text",
                "data.quoting": "minimal",
                "data.label_map": None,
                "data.validation_file": None,
                "model.problem_type": "regression",
            },
            "is not a number (model.problem_type=regression)",
        ),
        (
            {
                "data.train_file": None,
                "data.validation_file": None,
                "data.label_map": None,
                "data.validation_split": 0.2,
                "data.label_files": {"a": "nowhere/a.txt", "b": "nowhere/b.txt"},
            },
            "does not exist",
        ),
        ({**GOEMOTIONS, "data.labels_file": "goemotions/missing.txt"}, "data.labels_file"),
        (
            {**STSB, "data.train_file": "stsb/dev.tsv", "data.label_column": "genre", "data.max_train_samples": 5},
            "is not a number",
        ),
    ],
    ids=[
        "list_label_single_label",
        "regression_not_a_number",
        "label_file_missing",
        "labels_file_missing",
        "regression_text_label",
    ],
)
def test_bad_task_inputs_are_one_line(
    updates: dict[str, Any], message: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = write_tiny_config(tmp_path, updates)
    assert main(["--config", str(cfg)]) == 2
    assert message in _one_line_error(capfd)
    assert not (tmp_path / "run").exists()


def test_a_label_of_one_value_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "one.csv").write_text("text,score\na,1.0\nb,1.0\nc,1.0\n")
    base = {
        "data.train_file": str(tmp_path / "one.csv"),
        "data.validation_file": None,
        "data.label_map": None,
        "data.format": "auto",
        "data.quoting": "minimal",
        "data.text_column": "text",
    }
    assert (
        main(
            [
                "--config",
                str(
                    write_tiny_config(
                        tmp_path, {**base, "data.label_column": "score", "model.problem_type": "regression"}
                    )
                ),
            ]
        )
        == 2
    )
    assert "nothing to learn" in _one_line_error(capfd)
    assert main(["--config", str(write_tiny_config(tmp_path, {**base, "data.label_column": "score"}))]) == 2
    assert "at least 2 labels" in _one_line_error(capfd)


@pytest.mark.parametrize(
    "config, rows, labels",
    [
        ("goemotions-minilm.yaml", (43_410, 5_426, 5_427), 28),
        ("stsb-minilm.yaml", (5_749, 1_500, None), 1),
        ("mrpc-minilm.yaml", (3_667, 408, None), 2),
        ("bbc-minilm.yaml", (2_225, None, None), 5),
    ],
)
def test_shipped_task_configs_read_their_data(config: str, rows: tuple[int | None, ...], labels: int) -> None:
    # the counts of each dataset's SOURCE.md, read through the shipped config as a user would
    raw = load_raw_splits(load_config(ROOT / "configs" / config))
    got = tuple(len(s) if s is not None else None for s in (raw.train, raw.validation, raw.test))
    if config.startswith("bbc"):  # one folder per label, 10% held out
        assert got[0] + got[1] == rows[0] and got[2] is None
        assert not set(raw.train["text"][:]) & set(raw.validation["text"][:])
    else:
        assert got == rows
    assert len(raw.label_names) == labels


# ----------------------------------------------------------------------------------------------
# final/ as users read it.


@pytest.fixture(scope="module")
def multi_label_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("goemotions")
    return _run(
        d, {**GOEMOTIONS, "data.max_train_samples": 96, "data.max_eval_samples": 48, "train.learning_rate": 3e-3}
    )


@pytest.mark.slow
def test_multi_label_final_config_pipeline_predict_and_evaluate(
    multi_label_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    final = multi_label_run / "final"
    config = json.loads((final / "config.json").read_text())
    report = json.loads((multi_label_run / "eval.json").read_text())
    assert config["problem_type"] == "multi_label_classification" and len(config["id2label"]) == 28
    names = [config["id2label"][str(i)] for i in range(28)]
    assert config["label_thresholds"] == dict(zip(names, report["thresholds"], strict=True))
    assert {"micro_f1", "macro_f1", "subset_accuracy", "per_label"} <= set(report)
    assert config["id2label"]["27"] == "neutral"  # names from emotions.txt, ids by line
    texts = ["thank you so much, this is great", "I am so angry right now"]
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    with torch.no_grad():
        probs = torch.sigmoid(model(**tok(texts, padding=True, return_tensors="pt")).logits)
    clf = pipeline("text-classification", model=str(final), top_k=None, device="cpu")
    for row, out in zip(probs, clf(texts), strict=True):  # pipeline applies sigmoid by itself
        by_label = {o["label"]: o["score"] for o in out}
        assert [by_label[model.config.id2label[j]] for j in range(28)] == pytest.approx(row.tolist(), abs=1e-5)
    (tmp_path / "in.txt").write_text("\n".join(texts))
    assert (
        cli_main(
            [
                "predict",
                "--model",
                str(final),
                "--input",
                str(tmp_path / "in.txt"),
                "--output",
                str(tmp_path / "out.jsonl"),
            ]
        )
        == 0
    )
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    thresholds = config["label_thresholds"]
    for row, p in zip(rows, probs, strict=True):
        expected = [model.config.id2label[j] for j in range(28) if p[j] >= thresholds[model.config.id2label[j]]]
        assert row["labels"] == expected
    # evaluate reads the thresholds from final/: its test metrics are eval.json's
    assert cli_main(["evaluate", "--model", str(final), "--config", str(multi_label_run.parent / "tiny.yaml")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["test"]["micro_f1"] == pytest.approx(report["test"]["micro_f1"], abs=1e-6)
    assert result["test"]["thresholds"] == report["thresholds"]
    # predictions.jsonl: label sets at final/'s thresholds; F1 recomputed from the rows is eval.json's
    preds = [json.loads(x) for x in (multi_label_run / "predictions.jsonl").read_text().splitlines()]
    for split, metrics in (("validation", report), ("test", report["test"])):
        rows = [r for r in preds if r["split"] == split]
        assert len(rows) == metrics["num_samples"] and all(len(r["probabilities"]) == 28 for r in rows)
        for r in rows:
            assert r["prediction"] == [n for n in names if r["probabilities"][n] >= thresholds[n]]
        gold = np.array([[n in r["gold"] for n in names] for r in rows])
        pred = np.array([[n in r["prediction"] for n in names] for r in rows])
        assert f1_score(gold, pred, average="micro", zero_division=0) == pytest.approx(metrics["micro_f1"])
        assert metrics["micro_f1_ci"][0] <= metrics["micro_f1"] <= metrics["micro_f1_ci"][1]


@pytest.mark.slow
def test_regression_pairs_pipeline_and_predict(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    run = _run(tmp_path, {**STSB, "data.max_train_samples": 64, "data.max_eval_samples": 32, "train.max_steps": 3})
    final = run / "final"
    report = json.loads((run / "eval.json").read_text())
    assert {"pearson", "spearman", "mse"} <= set(report) and report["num_samples"] == 32
    assert json.loads((final / "config.json").read_text())["problem_type"] == "regression"
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    pair = ("A man is playing a flute.", "A man plays a flute.")
    with torch.no_grad():
        expected = float(model(**tok(*pair, return_tensors="pt")).logits[0, 0])
    out = pipeline("text-classification", model=str(final), device="cpu")({"text": pair[0], "text_pair": pair[1]})
    assert (out[0] if isinstance(out, list) else out)["score"] == pytest.approx(expected, abs=1e-5)  # identity
    (tmp_path / "pairs.csv").write_text(f"a,b\n{pair[0]},{pair[1]}\n")
    assert (
        cli_main(
            [
                "predict",
                "--model",
                str(final),
                "--input",
                str(tmp_path / "pairs.csv"),
                "--text-column",
                "a",
                "--pair-column",
                "b",
                "--output",
                str(tmp_path / "out.jsonl"),
            ]
        )
        == 0
    )
    row = json.loads((tmp_path / "out.jsonl").read_text())
    assert row["text_pair"] == pair[1] and row["score"] == pytest.approx(expected, abs=1e-5)
    rows = [json.loads(x) for x in (run / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and all(r["probabilities"] is None and r["text_pair"] for r in rows)
    gold, pred = np.array([r["gold"] for r in rows]), np.array([r["prediction"] for r in rows])
    assert [r["loss"] for r in rows] == pytest.approx(list((pred - gold) ** 2), rel=1e-5)  # squared error per row
    assert np.corrcoef(pred, gold)[0, 1] == pytest.approx(report["pearson"], abs=1e-6)
    assert report["pearson_ci"][0] <= report["pearson"] <= report["pearson_ci"][1]


def test_metric_registry_names_what_evaluation_computes() -> None:
    from finetune.config.tasks import HEADLINE, METRICS, PROBLEM_TYPES, direction

    # the names, orders and directions config, metrics, checkpoint and card each spelled out before the registry
    assert HEADLINE == ("accuracy", "micro_f1", "macro_f1", "subset_accuracy", "pearson", "spearman", "mse")
    assert {k: p.best_metrics for k, p in PROBLEM_TYPES.items()} == {
        "single_label_classification": ("accuracy", "macro_f1", "loss"),
        "multi_label_classification": ("micro_f1", "macro_f1", "subset_accuracy", "loss"),
        "regression": ("pearson", "spearman", "mse", "loss"),
    }
    assert [m for m in METRICS if direction(m) == "minimize"] == ["mse", "loss"] and direction("other") == "maximize"
    # each problem type's headline metrics are exactly the headline metrics compute_metrics returns for it
    rng = np.random.default_rng(0)
    cases = {
        "single_label_classification": (rng.integers(0, 3, 20), rng.normal(size=(20, 3))),
        "multi_label_classification": ((rng.random((20, 3)) < 0.4).astype(np.float32), rng.normal(size=(20, 3))),
        "regression": (rng.normal(size=20), rng.normal(size=(20, 1))),
    }
    for kind, (y, logits) in cases.items():
        out = compute_metrics(kind, y, logits, ["a", "b", "c"])
        assert tuple(k for k in HEADLINE if k in out) == PROBLEM_TYPES[kind].headline, kind
        assert all(METRICS[k].hub_type is not None for k in PROBLEM_TYPES[kind].headline)  # all on the card


def test_best_metric_defaults_and_directions(tmp_path: Path) -> None:
    from finetune.core.errors import UserError
    from finetune.training.checkpoint import is_better

    for shape, metric in ((GOEMOTIONS, "micro_f1"), (STSB, "pearson"), ({}, "accuracy")):
        assert load_config(write_tiny_config(tmp_path, shape)).checkpoint.best_metric == metric
    assert is_better("mse", 0.5, 0.7) and not is_better("mse", 0.7, 0.5) and is_better("pearson", 0.7, 0.5)
    with pytest.raises(UserError, match="not a metric of model.problem_type=regression"):
        load_config(write_tiny_config(tmp_path, {**STSB, "checkpoint.best_metric": "accuracy"}))
