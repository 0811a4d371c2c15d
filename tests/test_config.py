"""Config: every shipped config validates; YAML 1.2 scalars in files and overrides; did-you-mean;
all problems in one message; the written config.yaml reloads to the same Config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CONFIGS, write_tiny_config

from finetune.config.files import dump_config, load_config, parse_yaml12, validate_config
from finetune.config.schema import Config
from finetune.core.errors import UserError

CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))


def test_configs_dir_has_the_issue_configs() -> None:
    names = {p.name for p in CONFIG_FILES}
    assert {
        "sst2-minilm.yaml",
        "agnews-minilm.yaml",
        "sms-spam-minilm.yaml",
        "trec-minilm.yaml",
        "tiny-debug.yaml",
        "sst2-hub.yaml",
        "goemotions-minilm.yaml",
        "stsb-minilm.yaml",
        "mrpc-minilm.yaml",
        "bbc-minilm.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_config_validates_and_names_its_launch_line(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and ("finetune/train.py" in first or "finetune train" in first) and path.name in first
    # config.yaml as written into a run directory reloads to the same config
    assert validate_config(parse_yaml12(dump_config(cfg))) == cfg


@pytest.mark.parametrize("path", sorted((CONFIGS / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_launch_configs_load(path: Path) -> None:
    """configs/accelerate/*.yaml are `accelerate launch --config_file` files: Accelerate itself reads them."""
    from accelerate.commands.config.config_args import load_config_from_file

    cluster = load_config_from_file(str(path))
    assert cluster.num_processes >= 1 and cluster.distributed_type is not None
    # the accumulation count lives in the app config only (train.gradient_accumulation_steps)
    import yaml

    raw = yaml.safe_load(path.read_text())
    assert "gradient_accumulation_steps" not in (raw.get("deepspeed_config") or {})


def test_every_file_in_configs_is_checked() -> None:
    covered = set(CONFIG_FILES) | set((CONFIGS / "accelerate").glob("*.yaml")) | {CONFIGS / "schema.json"}
    assert {p for p in CONFIGS.rglob("*") if p.is_file()} == covered


# ------------------------------------------------------------------------------------------------
# YAML 1.2 numbers and booleans (PyYAML alone: "3e-5" is a string, "no" is False, "010" is 8).


def test_yaml12_scalars_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "run:\n  output_dir: out\n  overwrite: no\n"
        "data:\n  train_file: t.csv\n  text_column: no\n  label_map: {'0': no, '1': yes}\n"
        "train:\n  learning_rate: 3e-5\n  log_every_steps: 010\n  adam_epsilon: 1E-8\n"
    )
    cfg = load_config(path)
    assert isinstance(cfg.train.learning_rate, float) and cfg.train.learning_rate == 3e-5
    assert cfg.train.adam_epsilon == 1e-8
    assert cfg.run.overwrite is False  # `no` in a bool field
    assert cfg.data.text_column == "no"  # ... and text in a str field
    assert cfg.data.label_map == {"0": "no", "1": "yes"}
    assert cfg.train.log_every_steps == 10  # not octal 8


def test_yaml12_scalars_as_overrides(tmp_path: Path) -> None:
    path = write_tiny_config(tmp_path)
    cfg = load_config(
        path,
        [
            "train.learning_rate=3e-5",
            "run.overwrite=no",
            "data.text_column=no",
            "train.log_every_steps=010",
            "precision.deterministic=yes",
        ],
    )
    assert isinstance(cfg.train.learning_rate, float) and cfg.train.learning_rate == 3e-5
    assert cfg.run.overwrite is False
    assert cfg.data.text_column == "no"
    assert cfg.train.log_every_steps == 10
    assert cfg.precision.deterministic is True
    assert load_config(path, ["run.overwrite=true"]).run.overwrite is True


def test_parse_yaml12_rules() -> None:
    assert parse_yaml12("3e-5") == 3e-5 and isinstance(parse_yaml12("3e-5"), float)
    assert parse_yaml12("no") == "no" and parse_yaml12("on") == "on"
    assert parse_yaml12("false") is False and parse_yaml12("True") is True
    assert parse_yaml12("010") == 10 and parse_yaml12("0x10") == 16 and parse_yaml12("0o10") == 8
    assert parse_yaml12("[1, 2e3]") == [1, 2000.0]


def test_override_value_is_validated_with_the_file(tmp_path: Path) -> None:
    path = write_tiny_config(tmp_path)
    with pytest.raises(UserError, match=r"train\.learning_rate.*'fast'"):
        load_config(path, ["train.learning_rate=fast"])
    with pytest.raises(UserError, match=r"not of the form dotted\.key=value"):
        load_config(path, ["train.learning_rate"])


# ------------------------------------------------------------------------------------------------
# Errors: did-you-mean, wrong types, all problems at once.


def test_unknown_key_did_you_mean(tmp_path: Path) -> None:
    path = write_tiny_config(tmp_path)
    with pytest.raises(UserError) as e:
        load_config(path, ["train.learning_rat=1e-4"])
    assert "train.learning_rat: unknown key (did you mean train.learning_rate?)" in str(e.value)
    with pytest.raises(UserError) as e:
        load_config(path, ["trian.epochs=1"])
    assert "did you mean train?" in str(e.value)


def test_wrong_type_names_key_value_and_type(tmp_path: Path) -> None:
    path = write_tiny_config(tmp_path)
    with pytest.raises(UserError) as e:
        load_config(path, ["train.epochs=many"])
    msg = str(e.value)
    assert "train.epochs" in msg and "'many'" in msg and "number" in msg


def test_all_problems_reported_together(tmp_path: Path) -> None:
    path = write_tiny_config(tmp_path)
    with pytest.raises(UserError) as e:
        load_config(path, ["train.learning_rat=1e-4", "train.micro_batch_size=0", "data.max_length=abc", "run.seed=x"])
    msg = str(e.value)
    assert "\n" not in msg
    assert "4 problems" in msg
    for key in ("train.learning_rat", "train.micro_batch_size", "data.max_length", "run.seed"):
        assert key in msg, key
    assert msg.startswith(str(path))


def test_invalid_yaml_names_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  output_dir: x\ndata: [unclosed\n")
    with pytest.raises(UserError, match=r"bad\.yaml is not valid YAML at line \d+"):
        load_config(path)


def test_missing_config_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="top level must be a mapping"):
        load_config(path)


def test_missing_required_sections(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(UserError) as e:
        load_config(path)
    assert "run: required key is missing" in str(e.value) and "data: required key is missing" in str(e.value)


def test_env_var_expansion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_TEST_DIR", "/some/where")
    path = write_tiny_config(tmp_path, {"data.data_dir": "${FT_TEST_DIR}"})
    cfg = load_config(path)
    assert cfg.resolved_path("sst2/train.tsv") == Path("/some/where/sst2/train.tsv")
    monkeypatch.delenv("FT_TEST_DIR")
    with pytest.raises(UserError, match="FT_TEST_DIR is not set"):
        load_config(path)


def test_config_yaml_round_trips_tricky_strings(tmp_path: Path) -> None:
    path = write_tiny_config(tmp_path)
    cfg = load_config(
        path, ['data.label_map={"0": "1e5", "1": "no", "2": "010", "3": "true"}', 'data.text_column="3e-5"']
    )
    assert cfg.data.label_map == {"0": "1e5", "1": "no", "2": "010", "3": "true"}
    assert validate_config(parse_yaml12(dump_config(cfg))) == cfg


def test_integer_labels_in_label_map_and_labels(tmp_path: Path) -> None:
    # AG News style: `label_map: {1: World, ...}` needs no quotes around the raw integer labels
    path = write_tiny_config(tmp_path)
    cfg = load_config(path, ["data.label_map={0: negative, 1: positive}", "data.labels=[negative, positive]"])
    assert cfg.data.label_map == {"0": "negative", "1": "positive"}
    cfg = load_config(path, ["data.label_map=null", "data.labels=[0, 1]"])
    assert cfg.data.labels == ["0", "1"]


def test_unknown_best_metric_fails_before_training() -> None:
    from conftest import TINY

    with pytest.raises(UserError, match=r"checkpoint\.best_metric: .*'accuracy'.*'macro_f1'.*'loss'.*\(got 'acc'\)"):
        load_config(TINY, ["checkpoint.best_metric=acc"])
    assert load_config(TINY, ["checkpoint.best_metric=loss"]).checkpoint.best_metric == "loss"


def test_early_stopping_needs_periodic_evaluation() -> None:
    from conftest import TINY

    with pytest.raises(UserError, match=r"early_stopping_patience counts evaluations: set train.eval_every_steps"):
        load_config(TINY, ["train.early_stopping_patience=2", "train.eval_every_steps=null"])
    assert (
        load_config(TINY, ["train.early_stopping_patience=2"]).train.early_stopping_patience == 2
    )  # tiny-debug evaluates every 4 steps


# ----------------------------------------------------------------------------------------------
# The schema documents itself.


def _fields(model: Any, prefix: str = "") -> list[tuple[str, Any]]:
    import typing

    from pydantic import BaseModel

    out = []
    for name, f in model.model_fields.items():
        kinds = (f.annotation, *typing.get_args(f.annotation))
        subs = [a for a in kinds if isinstance(a, type) and issubclass(a, BaseModel)]
        out += _fields(subs[0], f"{prefix}{name}.") if subs else [(f"{prefix}{name}", f)]
    return out


def test_every_field_has_a_description() -> None:
    missing = [name for name, f in _fields(Config) if not f.description]
    assert not missing, missing


def test_generated_reference_and_json_schema_are_current() -> None:
    from finetune.config.docs import json_schema, schema_markdown

    root = CONFIGS.parent
    stale = "stale: run finetune config --markdown > docs/CONFIG.md"
    assert (root / "docs" / "CONFIG.md").read_text() == schema_markdown(), stale
    assert (CONFIGS / "schema.json").read_text() == json_schema(), "run: finetune config --schema > configs/schema.json"
    for name, _ in _fields(Config):
        assert f"`{name}`" in schema_markdown(), name


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shipped_configs_point_editors_at_the_schema(path: Path) -> None:
    assert "# yaml-language-server: $schema=schema.json" in path.read_text().splitlines()[:3]


def test_config_command_shows_the_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from finetune.cli import main as cli_main

    assert cli_main(["config", "--show", str(CONFIGS / "tiny-debug.yaml"), "train.learning_rate=3e-5"]) == 0
    shown = capsys.readouterr().out
    cfg = validate_config(parse_yaml12(shown))
    assert cfg.train.learning_rate == 3e-5 and cfg.checkpoint.best_metric == "accuracy"  # defaults filled in
    assert cli_main(["config", "--schema"]) == 0
    assert "train" in json.loads(capsys.readouterr().out)["properties"]
    assert cli_main(["config", "--show", str(CONFIGS / "tiny-debug.yaml"), "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err
