"""`finetune init DATA`: a config that trains as written, from the layouts of ../shared/data."""

from __future__ import annotations

import gzip
import json
import random
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune.cli import main as cli_main
from finetune.config.files import load_config
from finetune.config.tasks import MULTI, REGRESSION, SINGLE
from finetune.data.build import build_data
from finetune.data.reading import load_raw_splits
from finetune.init.recipe import recipe
from finetune.init.write import load_config_for_tokenizer
from finetune.model.load import build_tokenizer, resolve_model_path
from finetune.train import main as train_main

pytestmark = pytest.mark.usefixtures("one_thread")


def _init(data: Path, out: Path, *extra: str) -> int:
    # no timed training step (tests/test_recipe.py covers the budget): seconds of model building per call
    return cli_main(["init", str(data), "-o", str(out), "--no-budget", *extra])


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, problem_type, rows, labels, keys",
    [
        ("sms_spam/SMSSpamCollection", "single_label_classification", 5_574, ["ham", "spam"], {"quoting": "none"}),
        ("goemotions", "multi_label_classification", 43_410, 28, {"label_delimiter": ",", "quoting": "minimal"}),
        ("stsb", "regression", 5_749, ["score"], {"text_pair_column": "sentence2", "quoting": "none"}),
        ("bbc_news", "single_label_classification", 2_225, 5, {"encoding_errors": "replace"}),
    ],
)
def test_init_reads_each_layout(
    name: str,
    problem_type: str,
    rows: int,
    labels: list[str] | int,
    keys: dict[str, str],
    tmp_path: Path,
    data_dir: Path,
) -> None:
    out = tmp_path / "c.yaml"
    assert _init(data_dir / name, out) == 0
    text = out.read_text()
    assert text.startswith("# accelerate launch") and "# written by `finetune init`" in text
    cfg = load_config(out)
    assert cfg.model.problem_type == problem_type
    assert all(getattr(cfg.data, k) == v for k, v in keys.items()), cfg.data
    raw = load_raw_splits(cfg)
    total = len(raw.train) + (len(raw.validation) if cfg.data.validation_split else 0)
    assert total == rows
    assert raw.label_names == labels if isinstance(labels, list) else len(raw.label_names) == labels


@pytest.mark.slow
def test_init_config_trains_as_written(tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "sms.yaml"
    assert _init(data_dir / "sms_spam" / "SMSSpamCollection", out) == 0
    run = tmp_path / "run"
    assert (
        train_main(
            [
                "--config",
                str(out),
                f"run.output_dir={run}",
                "data.max_train_samples=64",
                "data.max_eval_samples=32",
                "train.max_steps=2",
                "run.num_threads=1",
            ]
        )
        == 0
    )
    assert (run / "final" / "config.json").is_file()


def test_init_refuses_overwrite_and_ambiguous_input(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], data_dir: Path
) -> None:
    out = tmp_path / "c.yaml"
    out.write_text("mine")
    assert _init(data_dir / "stsb", out) == 2
    assert "exists" in capfd.readouterr().err and out.read_text() == "mine"
    assert _init(data_dir / "stsb", out, "--force") == 0
    capfd.readouterr()
    (tmp_path / "one.csv").write_text("id,value\n" + "".join(f"{i},{i * 3}\n" for i in range(50)))
    assert _init(tmp_path / "one.csv", tmp_path / "x.yaml") == 2
    err = capfd.readouterr().err
    assert err.startswith("error:") and "'id'" in err and "'value'" in err and not (tmp_path / "x.yaml").exists()


# ----------------------------------------------------------------------------------------------
# Layouts on small fixtures written to tmp_path: what init chose, and that the config it
# wrote reads through the app's data path as written.

WORDS = (
    "the",
    "film",
    "cat",
    "market",
    "rose",
    "slowly",
    "after",
    "a",
    "long",
    "quiet",
    "storm",
    "city",
    "river",
    "team",
    "won",
    "lost",
    "bright",
    "dark",
    "old",
    "new",
    "music",
    "played",
    "under",
    "green",
)


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def _flags(tmp_path: Path, rng: random.Random) -> Path:
    # SemEval-2018 E-c: tab-separated .txt, CRLF, an ID column, one 0/1 column per emotion; and a column
    # of 1s (no label: nothing to learn from it, and data/build.py refuses a label in every row)
    rows = ["ID\tTweet\tanger\tanticipation\tdisgust\tjoy\tchecked"]
    for i in range(40):
        flags = [(i + k) % (k + 2) == 0 for k in range(4)]  # every label in some rows, absent from others
        rows.append(f"2018-En-{i:05d}\t{_sentence(rng, 12)}\t" + "\t".join(str(int(f)) for f in flags) + "\t1")
    path = tmp_path / "2018-E-c-En-train.txt"
    path.write_bytes(("\r\n".join(rows) + "\r\n").encode())
    return path


def _score(tmp_path: Path, rng: random.Random) -> Path:
    path = tmp_path / "scores.csv"
    path.write_text("text,label\n" + "".join(f"{_sentence(rng, 9)},{rng.uniform(0, 5):.2f}\n" for _ in range(40)))
    return path


def _toxicity(tmp_path: Path, rng: random.Random) -> Path:
    # real numbers under a name init does not know, beside an integer id: the one column of scores
    path = tmp_path / "toxicity.csv"
    rows = "".join(f"{i},{_sentence(rng, 9)},{rng.random():.3f}\n" for i in range(40))
    path.write_text("id,comment,toxicity\n" + rows)
    return path


def _joined(tmp_path: Path, rng: random.Random) -> Path:
    names = ["joy", "anger", "fear", "love"]
    path = tmp_path / "emotions.tsv"
    cells = ["|".join(rng.sample(names, 1 + i % 3)) for i in range(40)]
    path.write_text("text\tlabels\n" + "".join(f"{_sentence(rng, 9)}\t{c}\n" for c in cells))
    return path


def _json_lists(tmp_path: Path, rng: random.Random) -> Path:
    # a column of JSON lists under a name init does not know: found by content, read as lists (no delimiter)
    path = tmp_path / "tags.csv"
    cells = [json.dumps(rng.sample(["sports", "politics", "tech"], 1 + i % 2)).replace('"', '""') for i in range(40)]
    path.write_text("body,tags\n" + "".join(f'{_sentence(rng, 9)},"{c}"\n' for c in cells))
    return path


def _rte(tmp_path: Path, rng: random.Random) -> Path:
    # GLUE RTE: an index column, a long premise, a short hypothesis sharing some of its words
    path = tmp_path / "rte.tsv"
    rows = []
    for i in range(40):
        premise = _sentence(rng, 30)
        rows.append(f"{i}\t{premise}\t{' '.join(premise.split()[:5])}\t{['entailment', 'not_entailment'][i % 2]}\n")
    path.write_text("index\tsentence1\tsentence2\tlabel\n" + "".join(rows))
    return path


def _nli(tmp_path: Path, rng: random.Random) -> Path:
    # the hypothesis comes first in the file (and sorts first): the premise is still the first text
    path = tmp_path / "nli.jsonl"
    labels = ["entailment", "neutral", "contradiction"]
    path.write_text(
        "".join(
            json.dumps({"hypothesis": _sentence(rng, 5), "premise": _sentence(rng, 20), "label": labels[i % 3]}) + "\n"
            for i in range(40)
        )
    )
    return path


def _paraphrase(tmp_path: Path, rng: random.Random) -> Path:
    # no header, no telling names: two sentences per row that share most of their words
    path = tmp_path / "para.tsv"
    rows = []
    for i in range(40):
        first = _sentence(rng, 12)
        second = " ".join(first.split()[:9]) + " " + _sentence(rng, 3)
        rows.append(f"{i % 2}\t{first}\t{second}\n")
    path.write_text("".join(rows))
    return path


def _news(tmp_path: Path, rng: random.Random) -> Path:
    # a headline and its story share words, but a headline is no second sentence: one text, the longest
    path = tmp_path / "news.csv"
    rows = []
    for i in range(40):
        story = _sentence(rng, 30)
        rows.append(f"{i % 4 + 1},{' '.join(story.split()[:6])},{story}\n")
    path.write_text("".join(rows))
    return path


def _label_files(tmp_path: Path, rng: random.Random) -> Path:
    # rt-polarity: one text per line, one file per label (one of them latin-1), a README beside them
    folder = tmp_path / "rt"
    folder.mkdir()
    pos = "\n".join(_sentence(rng, 8) + " café" for _ in range(25))
    (folder / "rt-polarity.pos").write_bytes(pos.encode("latin-1"))
    (folder / "rt-polarity.neg").write_text("\n".join(_sentence(rng, 8) for _ in range(20)) + "\n\n")
    (folder / "README").write_text("sentence polarity dataset v1.0\n")
    return folder


LAYOUTS = {
    # name: (fixture, problem type, config keys, label names, what the notes say)
    "flags": (
        _flags,
        "multi_label_classification",
        {"label_columns": ["anger", "anticipation", "disgust", "joy"], "text_column": "Tweet", "format": "tsv"},
        ["anger", "anticipation", "disgust", "joy"],
        "4 columns hold only 0/1",
    ),
    "flags_left_out": (
        _flags,
        "multi_label_classification",
        {"text_column": "Tweet"},
        ["anger", "anticipation", "disgust", "joy"],
        "['checked'] hold 1 in every row",
    ),
    "score": (_score, "regression", {"label_column": "label"}, ["label"], "not all whole: a score, regression"),
    "toxicity": (
        _toxicity,
        "regression",
        {"label_column": "toxicity", "text_column": "comment"},
        ["toxicity"],
        "not all whole: a score, regression",
    ),
    "joined": (
        _joined,
        "multi_label_classification",
        {"label_delimiter": "|", "label_column": "labels"},
        ["anger", "fear", "joy", "love"],
        "joined by '|'",
    ),
    "json_lists": (
        _json_lists,
        "multi_label_classification",
        {"label_delimiter": None, "label_column": "tags"},
        ["politics", "sports", "tech"],
        "holds lists",
    ),
    "rte": (
        _rte,
        "single_label_classification",
        {"text_column": "sentence1", "text_pair_column": "sentence2"},
        ["entailment", "not_entailment"],
        "as a sentence pair (numbered names",
    ),
    "nli": (
        _nli,
        "single_label_classification",
        {"text_column": "premise", "text_pair_column": "hypothesis"},
        ["contradiction", "entailment", "neutral"],
        "named 'premise' and 'hypothesis'",
    ),
    "paraphrase": (
        _paraphrase,
        "single_label_classification",
        {"text_column": "column1", "text_pair_column": "column2", "header": False},
        ["0", "1"],
        "by content",
    ),
    "news": (
        _news,
        "single_label_classification",
        {"text_column": "column2", "text_pair_column": None},
        list("1234"),
        "not used: text column(s) ['column1']",
    ),
    "label_files": (
        _label_files,
        "single_label_classification",
        {"label_files": {"neg": "rt-polarity.neg", "pos": "rt-polarity.pos"}, "encoding": "latin-1"},
        ["neg", "pos"],
        "one text file per label",
    ),
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(load_config_for_tokenizer("minilm-l6"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_init_recognises_each_layout_and_its_config_reads_as_written(
    layout: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], tokenizer: Any
) -> None:
    make, problem_type, keys, labels, said = LAYOUTS[layout]
    data = make(tmp_path, random.Random(0))
    out = tmp_path / "c.yaml"
    assert _init(data, out) == 0
    err = capfd.readouterr().err
    assert said in err and said in out.read_text(), err
    cfg = load_config(out)
    assert cfg.model.problem_type == problem_type
    assert {k: getattr(cfg.data, k) for k in keys} == keys
    raw = load_raw_splits(cfg)
    assert raw.label_names == labels
    held = len(raw.validation) if raw.validation is not None else 0  # few rows a class: no slice (few-shot)
    assert len(raw.train) + held == (45 if layout == "label_files" else 40)
    if layout == "label_files":  # the latin-1 file decodes as written, blank lines skipped
        assert any(t.endswith("café") for t in raw.train["text"]) and "" not in raw.train["text"]
    data = build_data(cfg, tokenizer)  # the whole data path of `finetune train`, tokenized as written
    seps = data.train["input_ids"][0].count(tokenizer.sep_token_id)
    assert seps == (2 if cfg.data.text_pair_column else 1)  # a pair is one row of both texts
    assert max(len(x) for x in data.train["input_ids"]) <= cfg.data.max_length


def test_init_flags_config_trains_two_steps(tmp_path: Path) -> None:
    # one 0/1 column per label through the whole loop on the tiny model: multi-hot targets, BCE, final/
    out = tmp_path / "flags.yaml"
    assert _init(_flags(tmp_path, random.Random(0)), out) == 0
    tiny = yaml.safe_load((Path(__file__).parent.parent / "configs" / "tiny-debug.yaml").read_text())["model"]
    raw = yaml.safe_load(out.read_text())
    raw["model"] = {**tiny, "problem_type": raw["model"]["problem_type"]}
    out.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    assert (
        train_main(
            [
                "--config",
                str(out),
                f"run.output_dir={run}",
                "train.max_steps=2",
                "run.num_threads=1",
                "train.micro_batch_size=8",
                "log.plots=false",
            ]
        )
        == 0
    )
    assert json.loads((run / "final" / "config.json").read_text())["problem_type"] == "multi_label_classification"


def test_recipe_per_problem_type_matches_the_shipped_configs() -> None:
    # multi-label and regression take their recipe from configs/goemotions-minilm.yaml and stsb-minilm.yaml
    for name, problem_type, rows in (("goemotions", MULTI, 43_410), ("stsb", REGRESSION, 5_749)):
        shipped = yaml.safe_load((Path(__file__).parent.parent / "configs" / f"{name}-minilm.yaml").read_text())
        got = recipe(problem_type, rows)
        assert {k: float(shipped["train"][k]) for k in got} == {k: float(v) for k, v in got.items()}, name
    assert recipe(SINGLE, 500)["epochs"] > recipe(SINGLE, 50_000)["epochs"]


def test_init_writes_the_recipe_and_leaves_schema_defaults_out(tmp_path: Path) -> None:
    out = tmp_path / "s.yaml"
    assert _init(_score(tmp_path, random.Random(0)), out) == 0
    train = yaml.safe_load(out.read_text())["train"]
    assert train["warmup_ratio"] == 0.1 and train["epochs"] == 10  # regression, 40 rows
    assert _init(_flags(tmp_path, random.Random(0)), out, "--force") == 0
    text = out.read_text()
    assert "warmup_ratio" not in yaml.safe_load(text)["train"] and "warmup_ratio 0.06" in text  # default: said, not set


def _zip(path: Path, members: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, content in members.items():
            z.writestr(name, content)
    return path


UNREADABLE = {
    # file name, its bytes (or a zip's members), the words of the error
    "data.xlsx": ({"[Content_Types].xml": "<Types/>", "xl/workbook.xml": "<workbook/>"}, "an Excel workbook (xlsx)"),
    "data.csv": ({"[Content_Types].xml": "<Types/>", "xl/workbook.xml": "<workbook/>"}, "an Excel workbook (xlsx)"),
    "sheet.ods": ({"mimetype": "application/vnd.oasis.opendocument.spreadsheet"}, "OpenDocument spreadsheet (ods)"),
    "data.zip": ({"train.csv": "text,label\n"}, "a zip archive (zip)"),
    "old.xls": (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504), "Excel 97-2003 workbook (xls)"),
    "paper.pdf": (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n", "a PDF document (pdf)"),
    "data.csv.gz": (gzip.compress(b"text,label\nhello,1\n"), "is gzip-compressed (gz), which"),
    "noname.xlsx": (bytes(range(256)), "an Excel workbook (xlsx)"),  # no magic: the extension names it
    "unicode.txt": ("text\tlabel\nhello\t1\n".encode("utf-16"), "UTF-16"),
    "blob.bin": (b"\x00\x01\x02text", "a binary file"),
}


@pytest.mark.parametrize("name", UNREADABLE)
def test_init_names_formats_it_cannot_read(name: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    content, words = UNREADABLE[name]
    path = tmp_path / name
    _zip(path, content) if isinstance(content, dict) else path.write_bytes(content)
    assert _init(path, tmp_path / "x.yaml") == 2
    err = capfd.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and words in err, err
    assert "finetune init" in err and not (tmp_path / "x.yaml").exists()


def test_init_names_an_unreadable_train_file_in_a_folder(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _zip(tmp_path / "train.xlsx", {"xl/workbook.xml": "<workbook/>"})
    assert _init(tmp_path, tmp_path / "x.yaml") == 2
    assert "train.xlsx is an Excel workbook" in capfd.readouterr().err


def test_init_reads_parquet_under_another_name(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    path = tmp_path / "export.csv"  # parquet bytes behind a .csv name: PAR1 decides
    pq.write_table(pa.table({"text": [_sentence(rng, 8) for _ in range(40)], "label": ["a", "b"] * 20}), path)
    out = tmp_path / "p.yaml"
    assert _init(path, out) == 0
    cfg = load_config(out)
    assert cfg.data.format == "parquet" and len(load_raw_splits(cfg).train) == 40  # few-shot: every row trains


def test_init_max_length_stays_within_the_models_positions(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # a model of 64 positions and texts of ~150 tokens: max_length is the model's limit, not 160
    from transformers import AutoTokenizer, BertConfig

    model = tmp_path / "model"
    AutoTokenizer.from_pretrained(resolve_model_path("minilm-l6")).save_pretrained(model)
    BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    ).save_pretrained(model)
    rng = random.Random(0)
    path = tmp_path / "long.csv"
    path.write_text("text,label\n" + "".join(f"{_sentence(rng, 140)},{i % 2}\n" for i in range(40)))
    out = tmp_path / "l.yaml"
    assert _init(path, out, "--model", str(model)) == 0
    assert load_config(out).data.max_length == 64
    assert "cut to 64 (the model's position limit)" in capfd.readouterr().err


def test_init_sees_every_label_of_a_records_file_sorted_by_label(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    # 5 labels x 1,000 rows in label order: the first 4,000 records (what init once read) hold only 4 of them
    rows = [{"text": f"item {i} of {label}", "label": label} for label in "abcde" for i in range(1000)]
    path = tmp_path / "sorted.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sorted.yaml"
    assert cli_main(["init", str(path), "-o", str(out), "--no-budget"]) == 0
    err = capfd.readouterr().err
    assert "5 classes, one per text" in err and "5 classes, 900 training rows a class" in err


def test_init_sees_a_table_as_training_reads_it(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    # quotes that are text and a header cell with spaces around it: the columns init chooses from and the rows
    # it counts are training's (one reader, with the keys init writes)
    from finetune.data.reading import read_file
    from finetune.init.sniff import sniff_data

    rng = random.Random(0)
    rows = [f'"{_sentence(rng, 6)}" she said\t{["pos", "neg"][i % 2]}' for i in range(50)]
    path = tmp_path / "train.tsv"
    path.write_text(" review \tlabel\n" + "\n".join(rows) + "\n")
    out = tmp_path / "t.yaml"
    assert _init(path, out) == 0
    cfg = load_config(out)
    assert (cfg.data.quoting, cfg.data.text_column) == ("none", " review ")
    sniffed, _, _ = sniff_data(path)
    trained = read_file(cfg, path)
    assert sniffed.columns[" review "] == trained[" review "][:] == [r.split("\t")[0] for r in rows]
    assert "2 classes, 25 training rows a class" in capfd.readouterr().err  # 50 rows, few-shot: none held out


def test_a_comma_file_without_quotes_is_read_with_standard_quoting(tmp_path: Path) -> None:
    # no quote anywhere: both parses agree, and minimal lets a test file with quoted commas be read alike
    rows = "".join(f"message number {i} with no quotes,{'spam' if i % 2 else 'ham'}\n" for i in range(40))
    (tmp_path / "train.csv").write_text("text,label\n" + rows)
    (tmp_path / "test.csv").write_text('text,label\n"hello, and a comma",ham\n')
    out = tmp_path / "c.yaml"
    assert _init(tmp_path / "train.csv", out) == 0
    cfg = load_config(out)
    assert cfg.data.quoting == "minimal"
    cfg.data.test_file = str(tmp_path / "test.csv")
    assert load_raw_splits(cfg).test["text"] == ["hello, and a comma"]
