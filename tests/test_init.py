"""`finetune init DATA`: a config that trains as written, from the layouts of ../shared/data."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.cli import main as cli_main
from finetune.config import load_config
from finetune.data import load_raw_splits
from finetune.train import main as train_main

pytestmark = pytest.mark.usefixtures("one_thread")


def _init(data: Path, out: Path, *extra: str) -> int:
    return cli_main(["init", str(data), "-o", str(out), *extra])


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
    name: str, problem_type: str, rows: int, labels: list[str] | int, keys: dict[str, str], tmp_path: Path,
    data_dir: Path,
) -> None:  # fmt: skip
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


def test_init_config_trains_as_written(tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "sms.yaml"
    assert _init(data_dir / "sms_spam" / "SMSSpamCollection", out) == 0
    run = tmp_path / "run"
    assert train_main(["--config", str(out), f"run.output_dir={run}", "data.max_train_samples=64",
                       "data.max_eval_samples=32", "train.max_steps=2", "run.num_threads=1"]) == 0  # fmt: skip
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
