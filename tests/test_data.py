"""Data: the four real datasets through their configs' data sections (row counts and label sets of
their SOURCE.md), the label set under data.max_train_samples, the seeded stratified split, the
windowed batch sampler and the collator."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS

from finetune.config.files import load_config
from finetune.config.schema import Config
from finetune.data.build import build_data_report, tokenize_split
from finetune.data.collate import Collator
from finetune.data.reading import load_raw_splits


def _splits(name: str, overrides: list[str] | None = None):
    cfg = load_config(CONFIGS / name, overrides or [])
    return cfg, load_raw_splits(cfg)


def _named_counts(raw, ds) -> dict[str, int]:
    return dict(Counter(raw.raw_to_name[v] for v in ds["label"]))


# ------------------------------------------------------------------------------------------------
# The four datasets (numbers from ../shared/data/*/SOURCE.md).


@pytest.mark.slow
def test_sst2_rows_and_labels(data_dir: Path) -> None:
    _, raw = _splits("sst2-minilm.yaml", ["data.max_train_samples=null"])
    assert raw.label_names == ["negative", "positive"]
    assert len(raw.train) == 67_349 and len(raw.validation) == 872
    assert _named_counts(raw, raw.train) == {"negative": 29_780, "positive": 37_569}
    assert _named_counts(raw, raw.validation) == {"negative": 428, "positive": 444}
    # PTB-tokenized text read whole (no quote processing, no tabs left in a text)
    texts = list(raw.validation["text"])
    assert any(" 's " in t for t in texts) and not any("\t" in t for t in texts)


def test_sst2_senteval_test_file_headerless(data_dir: Path) -> None:
    # the SentEval test copy has no header: read it with header=false and column names
    _, raw = _splits(
        "sst2-minilm.yaml",
        [
            "data.train_file=sst2/test_senteval.tsv",
            "data.validation_file=null",
            "data.header=false",
            "data.column_names=[sentence, label]",
            "data.max_train_samples=null",
        ],
    )
    assert len(raw.train) == 1_821
    assert _named_counts(raw, raw.train) == {"negative": 912, "positive": 909}


def test_agnews_rows_and_labels(data_dir: Path) -> None:
    _, raw = _splits("agnews-minilm.yaml")
    assert raw.label_names == ["World", "Sports", "Business", "Sci/Tech"]  # 1..4 in classes.txt order
    assert len(raw.train) + len(raw.validation) == 8_000
    assert len(raw.validation) == 800  # seeded stratified 10%
    assert _named_counts(raw, raw.validation) == {n: 200 for n in raw.label_names}
    assert _named_counts(raw, raw.train) == {n: 1_800 for n in raw.label_names}
    assert len(raw.test) == 7_600
    assert _named_counts(raw, raw.test) == {n: 1_900 for n in raw.label_names}
    # SOURCE.md: 16 texts occur in both files (kept: duplicates are reported, not removed)
    assert len((set(raw.train["text"]) | set(raw.validation["text"])) & set(raw.test["text"])) == 16
    # RFC-4180 quoting: commas inside quoted texts stay in the text
    assert any("," in t for t in list(raw.test["text"])[:100])


def test_sms_spam_rows_and_labels(data_dir: Path) -> None:
    _, raw = _splits("sms-spam-minilm.yaml")
    assert raw.label_names == ["ham", "spam"]
    assert raw.test is None
    total = Counter(raw.train["label"]) + Counter(raw.validation["label"])
    assert sum(total.values()) == 5_574
    assert total == {"ham": 4_827, "spam": 747}
    # 80/20 stratified: 20% of each class in validation
    assert Counter(raw.validation["label"]) == {"ham": round(0.2 * 4_827), "spam": round(0.2 * 747)}


def test_trec_rows_and_labels(data_dir: Path) -> None:
    _, raw = _splits("trec-minilm.yaml")
    six = ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]
    assert raw.label_names == six
    total = Counter(raw.train["label"]) + Counter(raw.validation["label"])
    assert sum(total.values()) == 5_452
    assert total == {"ABBR": 86, "DESC": 1_162, "ENTY": 1_250, "HUM": 1_223, "LOC": 835, "NUM": 896}
    assert len(raw.test) == 500
    assert Counter(raw.test["label"]) == {"ABBR": 9, "DESC": 138, "ENTY": 94, "HUM": 65, "LOC": 81, "NUM": 113}
    # the regex keeps the question and drops the fine label; the latin-1 byte decodes
    assert all(not t.startswith(tuple(six)) for t in raw.test["text"])
    assert any("sister\xf0city" in t for t in list(raw.train["text"]) + list(raw.validation["text"]))


def test_trec_utf8_fails_with_line_number(data_dir: Path) -> None:
    from finetune.core.errors import UserError

    with pytest.raises(
        UserError, match=r"train_5500\.label line \d+: byte 0xf0 is not valid utf-8; set data\.encoding"
    ):
        _splits("trec-minilm.yaml", ["data.encoding=utf-8"])


def test_max_train_samples_keeps_every_label(data_dir: Path) -> None:
    cfg, raw = _splits("trec-minilm.yaml", ["data.validation_split=null", "data.max_train_samples=3"])
    assert len(raw.train) == 3
    assert raw.label_names == ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]  # from the whole file
    assert len(set(raw.train["label"])) < 6  # the slice itself does not have them all
    # the first N rows of the file, in file order
    lines = cfg.resolved_path(cfg.data.train_file).read_text(encoding="latin-1").splitlines()[:3]
    assert list(raw.train["text"]) == [line.split(" ", 1)[1] for line in lines]
    # the test split is still checked against all six labels (it contains ABBR)
    assert len(raw.test) == 500


def test_stratified_split_is_seeded(data_dir: Path) -> None:
    _, a = _splits("agnews-minilm.yaml")
    _, b = _splits("agnews-minilm.yaml")
    _, c = _splits("agnews-minilm.yaml", ["run.seed=7"])
    assert list(a.validation["text"]) == list(b.validation["text"])
    assert list(a.validation["text"]) != list(c.validation["text"])
    assert Counter(c.validation["label"]) == Counter(a.validation["label"])  # still stratified
    # train and validation partition the file
    assert len(a.train) + len(a.validation) == len(c.train) + len(c.validation) == 8_000


def test_data_report_counts(data_dir: Path) -> None:
    from finetune.model.load import build_tokenizer

    cfg, raw = _splits("trec-minilm.yaml", ["data.max_length=8", "data.max_train_samples=300"])
    tok = build_tokenizer(cfg)
    tokenized = {
        n: tokenize_split(ds, tok, 8, None)
        for n, ds in (("train", raw.train), ("validation", raw.validation), ("test", raw.test))
    }
    assert max(tokenized["test"]["length"]) == 8  # truncated at data.max_length
    report = build_data_report(raw, tokenized)
    assert report["splits"]["test"]["rows"] == 500
    assert report["splits"]["test"]["class_counts"]["ABBR"] == 9
    assert 0.0 < report["splits"]["train"]["truncated_fraction"] < 1.0
    assert report["splits"]["train"]["duplicates_within"] == len(raw.train) - len(set(raw.train["text"]))


# ------------------------------------------------------------------------------------------------
# Collating (the sampler is tested in tests/test_window.py).


def test_collator_pads_and_carries_window(data_dir: Path) -> None:
    from finetune.model.load import build_tokenizer

    cfg = load_config(CONFIGS / "tiny-debug.yaml")
    tok = build_tokenizer(cfg)
    feats = [dict(tok(t), labels=i, window_samples=3, sample_weight=1.0) for i, t in enumerate(["a b c d e", "short"])]
    batch = Collator(tok)(feats)
    assert batch["input_ids"].shape[0] == 2 and batch["input_ids"].shape[1] == len(feats[0]["input_ids"])
    assert batch["attention_mask"][1].sum() == len(feats[1]["input_ids"])
    assert batch["labels"].tolist() == [0, 1]
    assert float(batch["window_samples"]) == 3.0


@pytest.mark.parametrize("side", ["right", "left"])
def test_collator_pads_as_the_tokenizer_does(data_dir: Path, side: str) -> None:
    """The collator's own padding against `tokenizer.pad` (the reference it replaces on the hot path)."""
    import datasets

    from finetune.data.window import WindowedDataset
    from finetune.model.load import build_tokenizer

    tok = build_tokenizer(load_config(CONFIGS / "tiny-debug.yaml"))
    tok.padding_side = side
    pairs = [("a b c d e f", "g"), ("short", "an answer of some words"), ("x", "y")]
    enc = tok([a for a, _ in pairs], [b for _, b in pairs])
    feats = [{k: enc[k][i] for k in enc} for i in range(len(pairs))]
    ours = Collator(tok)(feats)
    reference = tok.pad(feats, return_tensors="pt")
    assert set(ours) == set(reference) == {"input_ids", "attention_mask", "token_type_ids"}
    for key in reference:
        assert torch.equal(ours[key], reference[key]), key
    # a micro-batch read at once from the table: the same rows as one read each
    table = WindowedDataset(datasets.Dataset.from_dict({**enc, "labels": [0, 1, 0]}))
    keys = [(2, 3, 1.0), (0, 3, 0.0), (1, 3, 1.0)]
    assert table.__getitems__(keys) == [table[k] for k in keys]
    assert table.__getitems__([1, 0]) == [table[1], table[0]]


# ------------------------------------------------------------------------------------------------
# Local formats through the same options (no data directory needed).

ROWS = [
    {"text": t, "label": label}
    for t, label in [("good", 1), ("bad", 0), ("great fun", 1), ("dull", 0), ("fine", 1), ("weak", 0)]
]


def _local_cfg(tmp_path: Path, train_file: str, extra: dict | None = None) -> Config:
    from conftest import write_tiny_config

    updates = {
        "data.data_dir": str(tmp_path),
        "data.train_file": train_file,
        "data.validation_file": None,
        "data.format": "auto",
        "data.quoting": "minimal",
        "data.text_column": "text",
        "data.label_column": "label",
        "data.label_map": {0: "neg", 1: "pos"},
        "data.max_train_samples": None,
        "data.max_eval_samples": None,
        **(extra or {}),
    }
    return load_config(write_tiny_config(tmp_path, updates, name="local.yaml"))


def test_local_formats_read_alike(tmp_path: Path) -> None:
    import json

    import datasets
    import pandas as pd

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pd.DataFrame(ROWS).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(ROWS).to_csv(tmp_path / "d.tsv", index=False, sep="\t")
    pd.DataFrame(ROWS).to_parquet(tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    for name in ("d.jsonl", "d.json", "d.csv", "d.tsv", "d.parquet", "saved"):
        raw = load_raw_splits(_local_cfg(tmp_path, name))
        assert raw.label_names == ["neg", "pos"], name
        assert list(raw.train["text"]) == [r["text"] for r in ROWS], name
        assert [raw.raw_to_name[v] for v in raw.train["label"]] == ["pos", "neg"] * 3, name


def test_saved_dataset_dict_asks_for_a_split(tmp_path: Path) -> None:
    import datasets

    from finetune.core.errors import UserError

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UserError, match=r"saved DatasetDict.*\(train\)"):
        load_raw_splits(_local_cfg(tmp_path, "dd"))
    raw = load_raw_splits(_local_cfg(tmp_path, "dd/train"))
    assert len(raw.train) == 6


def test_text_pair_column(tmp_path: Path, data_dir: Path) -> None:
    from finetune.model.load import build_tokenizer

    (tmp_path / "pairs.csv").write_text("premise,hypothesis,label\nit rains,it is wet,1\nit rains,it is dry,0\n")
    cfg = _local_cfg(tmp_path, "pairs.csv", {"data.text_column": "premise", "data.text_pair_column": "hypothesis"})
    raw = load_raw_splits(cfg)
    assert raw.train.column_names == ["text", "text_pair", "label"]
    tok = build_tokenizer(cfg)
    enc = tokenize_split(raw.train, tok, 32, raw.target)
    assert set(enc[0]["token_type_ids"]) == {0, 1}  # two segments
    assert enc["labels"][:] == [1, 0]


def test_swap_pairs_trains_both_orders(tmp_path: Path, data_dir: Path) -> None:
    """data.swap_pairs: training holds every pair as given and as (second, first), each as the tokenizer
    encodes it called directly, with its label and a text id of its own; validation stays as given."""
    from finetune.core.errors import UserError
    from finetune.data.build import build_data, format_data_report
    from finetune.model.load import build_tokenizer

    (tmp_path / "pairs.csv").write_text("a,b,label\nit rains,it is wet,1\nthe sun is out,it is dark outside,0\n")
    pair = {"data.text_column": "a", "data.text_pair_column": "b"}
    cfg = _local_cfg(tmp_path, "pairs.csv", {**pair, "data.swap_pairs": True, "data.validation_file": "pairs.csv"})
    tok = build_tokenizer(cfg)
    data = build_data(cfg, tok)
    rows = [("it rains", "it is wet", 1), ("the sun is out", "it is dark outside", 0)]
    expected = [(tok(a, b)["input_ids"], y) for a, b, y in rows] + [(tok(b, a)["input_ids"], y) for a, b, y in rows]
    assert list(zip(data.train["input_ids"][:], data.train["labels"][:], strict=True)) == expected
    assert sorted(data.train["doc"][:]) == [0, 1, 2, 3]
    assert data.validation["input_ids"][:] == [tok(a, b)["input_ids"] for a, b, _ in rows]
    assert data.report["splits"]["train"]["rows"] == 2 and data.report["splits"]["train"]["swapped_rows"] == 2
    assert "2 more rows with the pair's texts swapped" in format_data_report(data.report)
    with pytest.raises(UserError, match="data.swap_pairs swaps the two texts of a pair"):
        _local_cfg(tmp_path, "pairs.csv", {"data.swap_pairs": True})


def test_hub_dataset_path_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """configs/sst2-hub.yaml's data section on a stand-in for `datasets.load_dataset`
    (hub SST-2 has ClassLabel labels)."""
    import datasets

    import finetune.data.reading as data_mod

    features = datasets.Features(
        {
            "idx": datasets.Value("int32"),
            "sentence": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["negative", "positive"]),
        }
    )
    splits = {
        "train": datasets.Dataset.from_dict(
            {"idx": [0, 1, 2], "sentence": ["good", "bad", "fine"], "label": [1, 0, 1]}, features=features
        ),
        "validation": datasets.Dataset.from_dict(
            {"idx": [0, 1], "sentence": ["great", "awful"], "label": [1, 0]}, features=features
        ),
    }
    calls = []

    def fake_load_dataset(
        name: str, config: str | None = None, split: str | None = None, **kw: object
    ) -> datasets.Dataset:
        calls.append((name, split))
        return splits[split]

    monkeypatch.setattr(data_mod.datasets, "load_dataset", fake_load_dataset)
    raw = load_raw_splits(load_config(CONFIGS / "sst2-hub.yaml"))
    assert calls == [("stanfordnlp/sst2", "train"), ("stanfordnlp/sst2", "validation")]
    assert raw.label_names == ["negative", "positive"]
    assert list(raw.train["text"]) == ["good", "bad", "fine"]
    assert [raw.raw_to_name[v] for v in raw.validation["label"]] == ["positive", "negative"]


def test_stratified_split_keeps_rare_classes_in_training(tmp_path: Path) -> None:
    import pandas as pd

    rows = [{"text": f"common {i}", "label": 0} for i in range(20)] + [
        {"text": "rare 0", "label": 1},
        {"text": "rare 1", "label": 1},
        {"text": "single", "label": 2},
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "r.csv", index=False)
    cfg = _local_cfg(tmp_path, "r.csv", {"data.label_map": None, "data.validation_split": 0.1})
    raw = load_raw_splits(cfg)
    assert Counter(raw.validation["label"][:]) == {"0": 2, "1": 1}  # 10% of 20; at least one of 2; none of 1
    assert Counter(raw.train["label"][:]) == {"0": 18, "1": 1, "2": 1}


def test_carved_validation_is_mixed_under_max_eval_samples(data_dir: Path) -> None:
    # train_8k.csv is sorted by class; the first 40 rows of the carved validation set still mix them
    _, raw = _splits("agnews-minilm.yaml", ["data.max_eval_samples=40"])
    assert len(raw.validation) == 40
    assert len(set(raw.validation["label"][:])) == 4
