"""`finetune audit` and `data.exclude_rows`: flipped labels found by a tiny model's K-fold audit, a stopped audit
continued exactly, exclusions applied row for row, bad input refused in one line before anything is written.

The audit fixture is built so that a tiny BERT separates its classes: each class's texts draw their words from a
vocabulary of its own, so every flipped label contradicts the words of its text.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import write_tiny_config

from finetune.cli import main as cli_main
from finetune.config.files import load_config
from finetune.core import faults
from finetune.core.errors import UserError
from finetune.data.reading import load_raw_splits
from finetune.evaluation.issues import find_label_issues

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

WORDS = {
    "sports": "goal match team coach league score player season".split(),
    "science": "atom cell energy theory planet experiment physics molecule".split(),
    "music": "song guitar album melody concert piano rhythm singer".split(),
}
FLIPPED = [3, 17, 40, 58, 71, 95, 102, 130]  # data rows whose label the fixture gives wrong


def _fixture(directory: Path, rows: int = 144) -> tuple[Path, list[str]]:
    """A CSV of `rows` texts (three classes, words of the class's own vocabulary) with FLIPPED labels wrong;
    the true labels."""
    rng = random.Random(0)
    names = list(WORDS)
    truth = [names[i % 3] for i in range(rows)]
    path = directory / "topics.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i, label in enumerate(truth):
            text = " ".join(rng.choice(WORDS[label]) for _ in range(6))
            given = names[(names.index(label) + 1) % 3] if i in FLIPPED else label
            w.writerow([text, given])
    return path, truth


def _config(tmp_path: Path, data: Path, name: str = "tiny.yaml", **updates: object) -> Path:
    return write_tiny_config(
        tmp_path,
        {
            "run.output_dir": str(tmp_path / "audit"),
            "data.data_dir": None,
            "data.train_file": str(data),
            "data.validation_file": ...,
            "data.validation_split": 0.1,
            "data.format": "csv",
            "data.quoting": "minimal",
            "data.text_column": "text",
            "data.label_column": "label",
            "data.label_map": ...,
            "data.max_train_samples": ...,
            "data.max_eval_samples": ...,
            "data.max_length": 16,
            "train.micro_batch_size": 16,
            "train.gradient_accumulation_steps": 1,
            "train.learning_rate": 3e-3,
            "checkpoint.every_steps": 4,
            "audit.folds": 3,
            "audit.epochs": 8,
            **updates,
        },
        name,
    )


def _flagged(out: Path) -> list[int]:
    with open(out / "label_issues.csv", newline="") as f:
        return [int(r["row"]) for r in csv.DictReader(f)]


@pytest.mark.slow
def test_audit_finds_the_flipped_labels_and_a_stopped_audit_continues_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = _fixture(tmp_path)
    cfg = _config(tmp_path, data)
    assert cli_main(["audit", "--config", str(cfg)]) == 0
    out = tmp_path / "audit"
    flagged = _flagged(out)
    hit = len(set(flagged) & set(FLIPPED))
    assert hit >= 7 and len(flagged) - hit <= 2, flagged  # recall >= 7/8, at most two clean rows flagged
    with open(out / "label_issues.csv", newline="") as f:
        first = next(csv.DictReader(f))
    assert set(first) == {"row", "text", "given_label", "suggested_label", "score"}
    assert first["given_label"] != first["suggested_label"]
    summary = json.loads((out / "audit.json").read_text())
    assert summary["rows"] == 144 and summary["flagged"] == len(flagged)

    # stopped by SIGTERM inside the first fold's run, then the same command again: the same logits, bit for bit
    stopped = _config(tmp_path, data, "stopped.yaml", **{"run.output_dir": str(tmp_path / "stopped")})
    monkeypatch.setenv(faults.ENV, "sigterm_at_step:3")
    assert cli_main(["audit", "--config", str(stopped)]) == 143
    assert not (tmp_path / "stopped" / "fold-1" / "holdout.json").exists()
    monkeypatch.delenv(faults.ENV)
    assert cli_main(["audit", "--config", str(stopped)]) == 0
    for fold in ("fold-1", "fold-2", "fold-3"):
        a = json.loads((out / fold / "holdout.json").read_text())
        b = json.loads((tmp_path / "stopped" / fold / "holdout.json").read_text())
        assert a["rows"] == b["rows"] and np.array_equal(np.asarray(a["logits"]), np.asarray(b["logits"]))
    assert _flagged(tmp_path / "stopped") == flagged

    # finished folds are not trained again: only the ranking is redone
    weights = out / "fold-2" / "run" / "final" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    (out / "label_issues.csv").unlink()
    assert cli_main(["audit", "--config", str(cfg)]) == 0
    assert weights.stat().st_mtime_ns == before and _flagged(out) == flagged

    # the data changed since (a label fixed): the finished folds are not reused for it, nor anything overwritten
    lines = data.read_text().splitlines()
    lines[1 + FLIPPED[0]] = lines[1 + FLIPPED[0]].rsplit(",", 1)[0] + ",sports"
    data.write_text("\n".join(lines) + "\n")
    assert cli_main(["audit", "--config", str(cfg)]) == 2
    assert "holds an audit of other data" in capsys.readouterr().err

    # training without the flagged rows: the data report and the model card count them
    clean = tmp_path / "clean"
    argv = ["--config", str(cfg), f"data.exclude_rows={out / 'label_issues.csv'}", f"run.output_dir={clean}"]
    assert cli_main(["train", *argv, "train.epochs=1"]) == 0
    report = json.loads((clean / "data_report.json").read_text())
    assert report["splits"]["train"]["excluded_rows"] == len(flagged)
    assert f"{len(flagged)} training rows were left out" in (clean / "final" / "README.md").read_text()


def test_exclude_rows_leaves_out_exactly_the_listed_rows(tmp_path: Path) -> None:
    data, _ = _fixture(tmp_path, rows=30)
    listed = tmp_path / "drop.csv"
    listed.write_text("row,note\n4,x\n0,y\n29,z\n4,again\n")
    base = _config(tmp_path, data, **{"data.validation_split": ...})
    raw = load_raw_splits(load_config(base, [f"data.exclude_rows={listed}"]))
    all_rows = load_raw_splits(load_config(base)).train
    keep = [i for i in range(30) if i not in (0, 4, 29)]
    assert raw.train["text"][:] == [all_rows["text"][i] for i in keep]
    assert raw.train["label"][:] == [all_rows["label"][i] for i in keep]
    assert raw.excluded == 3 and raw.files["exclude_rows"] == listed
    assert raw.label_names == load_raw_splits(load_config(base)).label_names  # label ids of the whole file

    # a copy saved by a spreadsheet (a byte-order mark before the header) reads the same
    listed.write_text("\ufeffrow,note\n4,x\n0,y\n29,z\n", encoding="utf-8")
    assert load_raw_splits(load_config(base, [f"data.exclude_rows={listed}"])).train["text"][:] == raw.train["text"][:]

    # the exclusion list is part of the data a checkpoint is tied to: a changed list changes the recorded hash
    from finetune.core.fileio import file_sha256

    before = file_sha256(listed)
    listed.write_text("row\n5\n")
    assert file_sha256(listed) != before


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("index\n1\n", "has no column 'row'"),
        ("row\n30\n", "row '30' is not a data row"),
        ("row\n-1\n", "row '-1' is not a data row"),
        ("row,text\n2,not the text of row two\n", "row 2's text differs"),
    ],
)
def test_exclude_rows_refuses_a_list_that_does_not_fit(tmp_path: Path, content: str, message: str) -> None:
    data, _ = _fixture(tmp_path, rows=30)
    listed = tmp_path / "drop.csv"
    listed.write_text(content)
    with pytest.raises(UserError, match=message):
        load_raw_splits(load_config(_config(tmp_path, data), [f"data.exclude_rows={listed}"]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["audit.folds=40"], "audit.folds=40: every class needs at least 40 training rows"),
        (["model.problem_type=regression", "data.label_column=score"], "regression has none"),
        (["data.label_column=missing"], "has no column 'missing'"),
        (["--minutes", "5"], "--minutes 5 gives each fold a train.max_minutes"),  # no evaluations to pick final/ by
    ],
)
def test_audit_refuses_bad_input_in_one_line_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    data, _ = _fixture(tmp_path, rows=90)
    cfg = _config(tmp_path, data)
    assert cli_main(["audit", "--config", str(cfg), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "audit").exists()


def test_find_label_issues_flags_the_rows_the_probabilities_contradict() -> None:
    # 300 rows of 3 classes; the model is right and confident on every row, so the rows whose given label was
    # flipped are exactly those whose given label gets a low probability
    rng = np.random.default_rng(0)
    truth = np.arange(300) % 3
    probs = np.full((300, 3), 0.05)
    probs[np.arange(300), truth] = 0.9
    probs += rng.uniform(0, 0.01, probs.shape)
    probs /= probs.sum(1, keepdims=True)
    flipped = rng.choice(300, 30, replace=False)
    given = truth.copy()
    given[flipped] = (truth[flipped] + 1) % 3
    issues = find_label_issues(given.tolist(), probs, "single_label_classification")
    assert sorted(x.index for x in issues) == sorted(flipped.tolist())
    for x in issues:  # suggested = the argmax; score = the probability of the given label, ascending
        assert x.suggested == truth[x.index] and x.score == pytest.approx(probs[x.index, given[x.index]])
    assert [x.score for x in issues] == sorted(x.score for x in issues)

    # multi-label: a row whose set misses a label the model is sure of, or holds one it is sure is absent
    multi = np.where(rng.uniform(size=(200, 3)) < 0.4, 0.95, 0.03)
    sets = [[j for j in range(3) if multi[i, j] > 0.5] for i in range(200)]
    wrong = [5, 50, 120]
    for i in wrong:
        sets[i] = [j for j in range(3) if j not in sets[i]]
    found = find_label_issues(sets, multi, "multi_label_classification")
    assert sorted(x.index for x in found) == wrong


def test_every_copy_of_a_text_goes_to_one_fold_and_folds_stay_stratified() -> None:
    from finetune.audit import assign_folds

    texts = [f"text {i % 40}" for i in range(120)]  # each text three times
    labels = [i % 40 % 2 for i in range(120)]
    folds = assign_folds(labels, texts, "single_label_classification", 4, seed=0)
    for t in set(texts):
        assert len({folds[i] for i in range(120) if texts[i] == t}) == 1
    for k in range(4):  # 10 texts a fold, both classes in each
        held = [i for i in range(120) if folds[i] == k]
        assert len(held) == 30 and {labels[i] for i in held} == {0, 1}
    unique = assign_folds(labels, [f"t{i}" for i in range(120)], "single_label_classification", 4, seed=0)
    assert sorted(unique.count(k) for k in range(4)) == [30, 30, 30, 30]
