"""Read a GGUF file's tensors directly, under Hugging Face names: packed as the file holds them
(`PackedWeight`), or expanded per tensor with the gguf-py function transformers' GGUF loader calls.

transformers dequantizes the whole model to build a module first (~25 s for the embedded 135M
model); here each tensor is read from the memory map, renamed with gguf-py's and transformers'
own name maps, and its rows reordered by transformers' own q/k un-permutation, so the expanded
tensors are bit for bit the ones transformers loads (tests/engine/test_gguf_checkpoint.py).
"""

from __future__ import annotations

import logging
import os

import gguf
import numpy as np
import torch
import transformers

from engine.models.packed_weight import PACKED_FORMATS, PackedWeight

logger = logging.getLogger(__name__)

# `general.architecture` values read here: the Llama family of engine/models/arch.py (a Mistral
# file says "llama")
GGUF_ARCHITECTURES = ("llama", "qwen2")

Weight = torch.Tensor | PackedWeight


def read_gguf(
    path: str, dtype: torch.dtype, packed: bool,
    hf_config: transformers.PretrainedConfig | None = None,
) -> tuple[transformers.PretrainedConfig, dict[str, Weight]]:
    """(config, Hugging Face name -> weight) of a GGUF file; `hf_config` skips re-reading the
    config from the file's metadata (the embedded model keeps it in its cache).

    packed=True: 2-D tensors stored in a PACKED_FORMATS format stay PackedWeight; the rest come
    back float32 (a format outside the list is expanded, with a warning). packed=False: every
    tensor as a `dtype` tensor.
    """
    # NOTE: imported here: it pulls in tokenizer converters (~0.8 s) a safetensors model never needs
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        read_field,
    )

    reader = open_gguf(path)
    architecture = read_field(reader, "general.architecture")[0]
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path} holds a {architecture!r} model; specserve reads GGUF files of "
                         f"the architectures {', '.join(GGUF_ARCHITECTURES)} (Llama family)")
    if hf_config is None:
        hf_config = read_gguf_config(path)
    hf_names = _hf_names(architecture, hf_config)
    # NOTE: head counts from the config: a file without head_count_kv is still permuted (llama.cpp
    # assumes n_kv = n_head), where transformers' own load then skips the un-permutation
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())

    weights: dict[str, Weight] = {}
    expanded_formats: set[str] = set()
    for tensor in reader.tensors:
        num_rows = tensor.data.shape[0]
        # NOTE: transformers' processor permutes rows only (llama.cpp's q/k order); letting it
        # permute an arange gives that order, which then moves packed blocks and floats alike
        processed = processor.process(weights=np.arange(num_rows), name=tensor.name)
        hf_name = hf_names.get(processed.name)
        if hf_name is None:  # e.g. rope_freqs: transformers skips it too (the config carries it)
            logger.info("%s: tensor %s has no Hugging Face counterpart; skipped", path, tensor.name)
            continue
        rows = _row_order(np.asarray(processed.weights), tensor.name)
        fmt = tensor.tensor_type.name
        if packed and tensor.data.ndim == 2 and fmt not in PACKED_FORMATS + ("F32",):
            expanded_formats.add(fmt)
        weights[hf_name] = _read_tensor(tensor, rows, dtype, packed)
    if expanded_formats:
        logger.warning("%s: %s weights are not kept packed (packed formats: %s); expanded to "
                       "float32", path, ", ".join(sorted(expanded_formats)),
                       ", ".join(PACKED_FORMATS))
    _check_complete(path, hf_config, hf_names, weights)
    return hf_config, weights


def read_gguf_config(path: str) -> transformers.PretrainedConfig:
    """The config transformers builds from this file's metadata, with `architectures` filled in
    (the metadata has no such key; a saved config.json then loads without guessing)."""
    folder, name = os.path.split(os.path.abspath(path))
    hf_config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name,
                                                        local_files_only=True)
    if not getattr(hf_config, "architectures", None):
        model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
        hf_config.architectures = [model_class.__name__]
    return hf_config


def open_gguf(path: str) -> gguf.GGUFReader:
    """gguf-py's reader of a file (metadata parsed, tensors memory-mapped), opened ~3x faster."""
    return _ArrayGGUFReader(path)


class _ArrayGGUFReader(gguf.GGUFReader):
    """gguf-py's reader over a plain ndarray view of the same memory map.

    NOTE: GGUFReader parses the metadata one value at a time, and every slice of an np.memmap
    pays for the subclass's bookkeeping: on the embedded model's 49k-token vocabulary that made
    opening the file ~3x slower (6 s against 2 s, 2 busy cores).
    """

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = value.view(np.ndarray)


def _hf_names(architecture: str, hf_config: transformers.PretrainedConfig) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, by gguf-py's own name map (as
    transformers' `get_gguf_hf_weights_map` does, minus its walk over every submodule, which
    took ~10 s here and only matters for models renamed below the top level, not Llamas)."""
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    name_map = gguf.get_tensor_name_map(arch, hf_config.num_hidden_layers)
    with torch.device("meta"):  # only the parameter names are wanted: no memory, no init
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    names = {}
    for hf_name in model.state_dict():
        stem, _, suffix = hf_name.rpartition(".")
        gguf_stem = name_map.get_name(stem)
        if gguf_stem is not None:
            names[f"{gguf_stem}.{suffix}"] = hf_name
    return names


def _row_order(order: np.ndarray, name: str) -> torch.Tensor | None:
    """The row permutation as an index, or None where rows stay where they are."""
    num_rows = len(order)
    if order.shape != (num_rows,) or not np.array_equal(np.sort(order), np.arange(num_rows)):
        raise ValueError(f"transformers' GGUF processing of {name} is not a row permutation; "
                         f"specserve cannot apply it to packed weights")
    if np.array_equal(order, np.arange(num_rows)):
        return None
    return torch.from_numpy(order.astype(np.int64))


def _read_tensor(tensor, rows: torch.Tensor | None, dtype: torch.dtype, packed: bool) -> Weight:
    """One tensor out of the memory map (copied: the file may change while we serve)."""
    fmt = tensor.tensor_type.name
    if tensor.data.ndim == 2 and fmt in PACKED_FORMATS:
        in_features = int(tensor.shape[0])  # GGML lists the fastest-moving dimension first
        blocks = torch.from_numpy(np.array(tensor.data).view(np.uint8))  # [out, bytes per row]
        weight = PackedWeight(fmt, blocks, (blocks.shape[0], in_features))
        if rows is not None:
            weight = weight.select_rows(rows)
        return weight if packed else weight.dequantize().to(dtype)
    try:
        # NOTE: the very call transformers makes; F32 comes back as a view of the map
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"tensor {tensor.name} is stored as {fmt}, which gguf-py cannot "
                         f"dequantize") from None
    expanded = torch.from_numpy(np.array(values, dtype=np.float32))
    if rows is not None:
        expanded = expanded.index_select(0, rows)
    return expanded if packed else expanded.to(dtype)


def _check_complete(path: str, hf_config: transformers.PretrainedConfig,
                    hf_names: dict[str, str], weights: dict[str, Weight]) -> None:
    """Every parameter the name map knows is in the file (lm_head only when not tied)."""
    expected = set(hf_names.values())
    if getattr(hf_config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(weights))
    if missing:
        raise ValueError(f"{path} lacks tensors the model needs: {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
