"""Bad input: each case exits with code 2 and ONE line on stderr that names the key, file, line or
column, with no traceback, and writes nothing to the output directory.

Most cases go through `finetune.train.main(argv)` in process; two go through real subprocesses
(`python finetune/train.py` and the `finetune train` console script).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT, write_tiny_config

from finetune.config.files import load_config
from finetune.data.reading import load_raw_splits
from finetune.train import main as train_main

GOOD_TRAIN = (
    "text,label\nsuch a good film,pos\nawful and dull,neg\nloved it,pos\nboring,neg\nfine work,pos\nweak plot,neg\n"
)
GOOD_VAL = "text,label\nwonderful,pos\nterrible,neg\n"


@pytest.fixture
def case(tmp_path: Path, data_dir: Path) -> Callable[..., tuple[Path, Path]]:
    """Write small CSV data plus a tiny config over it; return (config path, output dir)."""
    files = tmp_path / "files"
    files.mkdir()
    (files / "train.csv").write_text(GOOD_TRAIN)
    (files / "val.csv").write_text(GOOD_VAL)

    def make(updates: dict | None = None, data: dict[str, bytes | str] | None = None) -> tuple[Path, Path]:
        for name, content in (data or {}).items():
            target = files / name
            target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
        base = {
            "data.data_dir": str(files),
            "data.train_file": "train.csv",
            "data.validation_file": "val.csv",
            "data.format": "auto",
            "data.quoting": "minimal",
            "data.text_column": "text",
            "data.label_column": "label",
            "data.label_map": None,
            "data.max_train_samples": None,
            "data.max_eval_samples": None,
        }
        cfg = write_tiny_config(tmp_path, {**base, **(updates or {})})
        return cfg, tmp_path / "run"

    return make


def _expect_error(
    argv: list[str],
    out: Path,
    capsys: pytest.CaptureFixture[str],
    *needles: str,
    before: list[str] | None = None,
    entry: Callable[[list[str]], int] = train_main,
) -> str:
    code = entry(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    # nothing written: the output directory does not exist, or is exactly as it was
    if before is None:
        assert not out.exists(), sorted(p.name for p in out.iterdir())
    else:
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    return lines[0]


def test_the_base_case_is_valid(case: Callable[..., tuple[Path, Path]]) -> None:
    """The cases below differ from this valid setup by one change each."""
    cfg, _ = case()
    raw = load_raw_splits(load_config(cfg))
    assert len(raw.train) == 6 and raw.label_names == ["neg", "pos"]


# ------------------------------------------------------------------------------------------------
# Config problems.


def test_unknown_key(case, capsys) -> None:
    cfg, out = case()
    _expect_error(
        ["--config", str(cfg), "train.learning_rat=1e-4"],
        out,
        capsys,
        "train.learning_rat",
        "did you mean train.learning_rate?",
    )


def test_mistyped_value(case, capsys) -> None:
    cfg, out = case()
    _expect_error(["--config", str(cfg), "train.epochs=lots"], out, capsys, "train.epochs", "'lots'")


def test_invalid_yaml(case, capsys, tmp_path: Path) -> None:
    _, out = case()
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"run:\n  output_dir: {out}\ntrain: {{epochs: 1\n")
    _expect_error(["--config", str(bad)], out, capsys, "bad.yaml", "not valid YAML", "line 4")


def test_missing_config_file(case, capsys, tmp_path: Path) -> None:
    _, out = case()
    _expect_error(["--config", str(tmp_path / "nope.yaml")], out, capsys, "nope.yaml", "does not exist")


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.micro_batch_size=0", "train.micro_batch_size"),
        ("data.max_length=-5", "data.max_length"),
        ("train.epochs=0", "train.epochs"),
    ],
)
def test_non_positive_size(case, capsys, override: str, key: str) -> None:
    cfg, out = case()
    _expect_error(["--config", str(cfg), override], out, capsys, key, "greater than 0")


# ------------------------------------------------------------------------------------------------
# Data problems.


def test_missing_data_file(case, capsys) -> None:
    cfg, out = case()
    _expect_error(["--config", str(cfg), "data.validation_file=nope.csv"], out, capsys, "nope.csv", "does not exist")


def test_missing_column(case, capsys) -> None:
    cfg, out = case()
    _expect_error(
        ["--config", str(cfg), "data.text_column=sentence"], out, capsys, "train.csv", "'sentence'", "data.text_column"
    )


def test_empty_file(case, capsys) -> None:
    cfg, out = case(data={"train.csv": ""})
    _expect_error(["--config", str(cfg)], out, capsys, "train.csv", "is empty")


def test_header_without_rows(case, capsys) -> None:
    cfg, out = case(data={"train.csv": "text,label\n"})
    _expect_error(["--config", str(cfg)], out, capsys, "train.csv", "no rows")


def test_row_with_missing_field(case, capsys) -> None:
    cfg, out = case(data={"train.csv": GOOD_TRAIN + "no label here\n"})
    _expect_error(["--config", str(cfg)], out, capsys, "train.csv", "line 8", "'label'")


def test_validation_label_unseen_in_training(case, capsys) -> None:
    cfg, out = case(data={"val.csv": GOOD_VAL + "so-so,neutral\n"})
    _expect_error(["--config", str(cfg)], out, capsys, "val.csv", "row 3", "'neutral'")


def test_test_label_unseen_in_training(case, capsys) -> None:
    cfg, out = case({"data.test_file": "test.csv"}, data={"test.csv": "text,label\nok,pos\nmeh,mixed\n"})
    _expect_error(["--config", str(cfg)], out, capsys, "test.csv", "row 2", "'mixed'")


def test_row_with_an_extra_field(case, capsys) -> None:
    cfg, out = case(
        {
            "data.train_file": "train.tsv",
            "data.validation_file": None,
            "data.validation_split": 0.5,
            "data.quoting": "none",
        },
        data={"train.tsv": "text\tlabel\ngood\tpos\nbad\tneg\tspare\n"},
    )
    _expect_error(["--config", str(cfg)], out, capsys, "train.tsv", "line 3")


def test_undecodable_file(case, capsys) -> None:
    cfg, out = case(data={"train.csv": GOOD_TRAIN.encode() + "caf\xe9 au lait,pos\n".encode("latin-1")})
    _expect_error(["--config", str(cfg)], out, capsys, "train.csv", "line 8", "0xe9", "data.encoding")


def test_label_not_in_label_map(case, capsys) -> None:
    cfg, out = case({"data.label_map": {"pos": "positive"}})
    _expect_error(["--config", str(cfg)], out, capsys, "train.csv", "'neg'", "data.label_map")


def test_line_regex_mismatch(case, capsys) -> None:
    cfg, out = case(
        {
            "data.train_file": "q.txt",
            "data.validation_file": None,
            "data.validation_split": 0.5,
            "data.line_regex": r"^(?P<label>[A-Z]+):\S+ (?P<text>.+)$",
        },
        data={"q.txt": "NUM:dist How far ?\nHUM:ind Who ?\njust a question\n"},
    )
    _expect_error(["--config", str(cfg)], out, capsys, "q.txt", "line 3", "data.line_regex")


# ------------------------------------------------------------------------------------------------
# Model, output directory, hub.


def test_model_path_does_not_exist(case, capsys, tmp_path: Path) -> None:
    cfg, out = case(
        {"model.architecture": None, "model.tokenizer": None, "model.name_or_path": str(tmp_path / "no_model")}
    )
    _expect_error(["--config", str(cfg)], out, capsys, "no_model", "does not exist", "model.name_or_path")


def test_max_length_above_the_model_positions(case, capsys, tmp_path: Path) -> None:
    """A long text with data.max_length above the tiny BERT's 128 positions crashed mid-run (size of tensor a
    (300) must match the size of tensor b (128)) after the run directory was written."""
    long_text = " ".join(["word"] * 400)
    cfg, out = case({"data.max_length": 300}, data={"train.csv": GOOD_TRAIN + f"{long_text},pos\n"})
    _expect_error(
        ["--config", str(cfg)],
        out,
        capsys,
        "data.max_length=300",
        "128 token positions",
        "data.max_length=128",
        "data.chunk_stride",
    )


def test_position_limit_of_families() -> None:
    """`finetune init` and prediction read the limit from a config: RoBERTa's table has two rows more than
    its positions, DeBERTa-v3 (relative attention) and configs without positions have none."""
    from transformers import AutoConfig

    from finetune.model.load import position_limit

    assert position_limit(AutoConfig.for_model("bert")) == 512
    assert position_limit(AutoConfig.for_model("roberta", max_position_embeddings=514, pad_token_id=1)) == 512
    assert position_limit(AutoConfig.for_model("gpt2")) == 1024
    assert position_limit(AutoConfig.for_model("deberta-v2", position_biased_input=False)) is None
    assert position_limit(AutoConfig.for_model("t5")) is None


def test_non_empty_output_dir(case, capsys) -> None:
    cfg, out = case()
    out.mkdir()
    (out / "keep.txt").write_text("earlier results")
    _expect_error(["--config", str(cfg)], out, capsys, str(out), "run.overwrite=true", before=["keep.txt"])
    assert (out / "keep.txt").read_text() == "earlier results"


def test_overwrite_keeps_old_results_when_the_input_is_bad(case, capsys) -> None:
    # run.overwrite=true clears the directory only once every input has been checked
    cfg, out = case(data={"val.csv": GOOD_VAL + "so-so,neutral\n"})
    out.mkdir()
    (out / "config.yaml").write_text("{}")  # an earlier run
    (out / "eval.json").write_text("{}")
    _expect_error(
        ["--config", str(cfg), "run.overwrite=true"],
        out,
        capsys,
        "val.csv",
        "'neutral'",
        before=["config.yaml", "eval.json"],
    )


def test_overwrite_refuses_a_directory_that_is_not_a_run(case, capsys) -> None:
    # run.overwrite=true deletes the directory: never one that holds anything but a run (e.g. run.output_dir=.)
    cfg, out = case()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _expect_error(
        ["--config", str(cfg), "run.overwrite=true"], out, capsys, str(out), "no config.yaml", before=["notes.txt"]
    )


def test_hub_model_offline(data_dir: Path, capsys, tmp_path: Path) -> None:
    out = tmp_path / "run"
    line = _expect_error(
        ["--config", str(ROOT / "configs" / "sst2-hub.yaml"), f"run.output_dir={out}"],
        out,
        capsys,
        "sentence-transformers/all-MiniLM-L6-v2",
        "unreachable",
        "model.name_or_path",
    )
    assert "minilm-l6" in line  # says how to point at local files


def test_hub_dataset_offline(data_dir: Path, capsys, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = [
        "--config",
        str(ROOT / "configs" / "sst2-hub.yaml"),
        f"run.output_dir={out}",
        "model.name_or_path=minilm-l6",
    ]
    _expect_error(argv, out, capsys, "stanfordnlp/sst2", "hub", "data.train_file")


def test_finetune_train_in_process(case, capsys) -> None:
    from finetune.cli import main as cli_main

    cfg, out = case()
    _expect_error(
        ["train", "--config", str(cfg), "data.label_column=target"],
        out,
        capsys,
        "'target'",
        "data.label_column",
        entry=cli_main,
    )


# ------------------------------------------------------------------------------------------------
# Real subprocesses: what a user's shell sees.


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def _check_proc(proc: subprocess.CompletedProcess[str], out: Path, *needles: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0]
    assert not out.exists()


@pytest.mark.slow
def test_python_train_py_subprocess(case) -> None:
    cfg, out = case(data={"train.csv": "text,label\n"})
    proc = _run([sys.executable, "finetune/train.py", "--config", str(cfg)])
    _check_proc(proc, out, "train.csv", "no rows")


@pytest.mark.slow
def test_finetune_console_script_subprocess(case) -> None:
    cfg, out = case()
    script = Path(sys.executable).parent / "finetune"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "finetune.cli"]
    proc = _run([*cmd, "train", "--config", str(cfg), "train.lerning_rate=1e-4"])
    _check_proc(proc, out, "train.lerning_rate", "did you mean train.learning_rate?")


def test_a_gguf_name_that_is_not_gguf(case, capsys) -> None:
    cfg, out = case()
    fake = out.parent / "model.gguf"
    fake.write_text("not a model")
    overrides = ["model.architecture=null", "model.tokenizer=null", f"model.name_or_path={fake}"]
    _expect_error(["--config", str(cfg), *overrides], out, capsys, "model.gguf", "is not a GGUF file")


def test_a_gguf_architecture_transformers_cannot_read(case, capsys) -> None:
    import gguf
    import numpy as np

    cfg, out = case()
    folder = out.parent / "bert-gguf"
    folder.mkdir()
    writer = gguf.GGUFWriter(str(folder / "bert.gguf"), arch="bert")  # BERT: no GGUF reader in transformers
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((10, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    overrides = [
        "model.architecture=null",
        "model.tokenizer=null",
        f"model.name_or_path={folder}",
        "model.gguf_file=bert.gguf",
    ]
    _expect_error(["--config", str(cfg), *overrides], out, capsys, "bert.gguf", "architecture bert")
