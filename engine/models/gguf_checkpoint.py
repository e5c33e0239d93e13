"""Read a GGUF file's tensors directly, under Hugging Face names: packed as the file holds them
(`PackedWeight`), or expanded per tensor with the gguf-py function transformers' GGUF loader calls.

transformers dequantizes the whole model to build a module first (~25 s for the embedded 135M
model); here each tensor is read from the memory map (engine/models/gguf_file.py), renamed by
llama.cpp's tensor names, and what llama.cpp's converter changed (a Llama file's q/k row order, a
Gemma 3 file's norms, stored plus one) undone as transformers' GGUF loader undoes it, so the
expanded tensors are bit for bit the ones transformers loads, and the names the ones its model
class has (tests/engine/test_gguf_checkpoint.py checks both against transformers).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import gguf
import numpy as np
import torch

from engine.models.gguf_file import GGUFLayout, GGUFTensor, read_gguf_layout
from kernels.packed_weight import PACKED_FORMATS, PackedWeight

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger(__name__)

# `general.architecture` values read here: the models of engine/models/arch.py (a Mistral file says
# "llama"; a Gemma 3 file holds the text model alone, transformers' gemma3_text)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

Weight = torch.Tensor | PackedWeight


def read_gguf(
    path: str, dtype: torch.dtype, packed: bool,
    hf_config: transformers.PretrainedConfig | None = None,
) -> tuple[transformers.PretrainedConfig, dict[str, Weight]]:
    """(config, Hugging Face name -> weight) of a GGUF file; `hf_config` skips re-reading the
    config from the file's metadata (engine/models/gguf_cache.py keeps it), else transformers
    reads it. `packed` as in read_gguf_weights."""
    layout = read_gguf_layout(path)
    check_architecture(layout)
    if hf_config is None:
        hf_config = read_gguf_config(path)
    return hf_config, read_gguf_weights(layout, hf_config, dtype, packed)


def check_architecture(layout: GGUFLayout) -> str:
    """The file's `general.architecture`, one specserve reads; else a ValueError naming it."""
    architecture = layout.metadata.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"{layout.path} holds a {architecture!r} model; specserve reads GGUF "
                         f"files of the architectures {', '.join(GGUF_ARCHITECTURES)}")
    return architecture


def read_gguf_weights(layout: GGUFLayout, hf_config: transformers.PretrainedConfig,
                      dtype: torch.dtype, packed: bool) -> dict[str, Weight]:
    """Hugging Face name -> weight of a walked GGUF file.

    packed=True: 2-D tensors stored in a PACKED_FORMATS format stay PackedWeight; the rest come
    back float32 (a format outside the list is expanded, with a warning). packed=False: every
    tensor as a `dtype` tensor.
    """
    architecture = check_architecture(layout)
    hf_names = hf_parameter_names(architecture, hf_config)
    weights: dict[str, Weight] = {}
    expanded_formats: set[str] = set()
    for tensor in layout.tensors:
        hf_name = hf_names.get(tensor.name)
        if hf_name is None:  # e.g. rope_freqs: transformers skips it too (the config carries it)
            logger.info("%s: tensor %s has no Hugging Face counterpart; skipped", layout.path,
                        tensor.name)
            continue
        rows = llama_cpp_row_order(architecture, tensor.name, tensor.data.shape[0], hf_config)
        minus_one = is_stored_plus_one(architecture, tensor.name)
        fmt = tensor.tensor_type.name
        if packed and tensor.data.ndim == 2 and fmt not in PACKED_FORMATS + ("F32",):
            expanded_formats.add(fmt)
        weights[hf_name] = _read_tensor(tensor, rows, dtype, packed, minus_one)
    if expanded_formats:
        logger.warning("%s: %s weights are not kept packed (packed formats: %s); expanded to "
                       "float32", layout.path, ", ".join(sorted(expanded_formats)),
                       ", ".join(PACKED_FORMATS))
    _check_complete(layout.path, hf_config, hf_names, weights)
    return weights


def read_gguf_config(path: str) -> transformers.PretrainedConfig:
    """The config transformers builds from this file's metadata, with `architectures` filled in
    (the metadata has no such key; a saved config.json then loads without guessing)."""
    folder, name = os.path.split(os.path.abspath(path))
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name,
                                                        local_files_only=True)
    _take_qwen3_head_dim(path, hf_config)
    _take_gemma3_rope_scaling(path, hf_config)
    if not getattr(hf_config, "architectures", None):
        # NOTE: the class's name from transformers' table: the class itself imports its model code
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type]]
    return hf_config


def _take_qwen3_head_dim(path: str, hf_config: transformers.PretrainedConfig) -> None:
    """transformers' GGUF config reads no head size for qwen3 (it maps no key_length), so every
    Qwen3 file gets Qwen3Config's default of 128, right for every released Qwen3; a file whose
    `qwen3.attention.key_length` says otherwise, which transformers then cannot load at all, gets
    the file's. Files transformers loads are read as it reads them."""
    if getattr(hf_config, "model_type", None) != "qwen3":
        return
    key_length = read_gguf_layout(path).metadata.get("qwen3.attention.key_length")
    if isinstance(key_length, int) and key_length != hf_config.head_dim:
        logger.info("%s: head_dim %d from qwen3.attention.key_length (transformers' GGUF config "
                    "leaves Qwen3Config's %d)", path, key_length, hf_config.head_dim)
        hf_config.head_dim = key_length


def _take_gemma3_rope_scaling(path: str, hf_config: transformers.PretrainedConfig) -> None:
    """Gemma 3 4B and up scale their full layers' RoPE linearly (factor 8); llama.cpp's converter
    writes it as `gemma3.rope.scaling.type` / `.factor`, which transformers' GGUF config does not
    map, so its own load of such a file rotates those layers unscaled (the 270M has no scaling).
    Here the file's scaling goes where a Hugging Face config keeps it: the model as published."""
    if getattr(hf_config, "model_type", None) != "gemma3_text":
        return
    metadata = read_gguf_layout(path).metadata
    kind, factor = metadata.get("gemma3.rope.scaling.type"), metadata.get("gemma3.rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 1.0):
        return
    if kind != "linear":
        raise ValueError(f"{path}: rope scaling {kind!r} on a gemma3 file; Gemma 3 scales linearly")
    full = dict(hf_config.rope_parameters["full_attention"])
    full.update(rope_type="linear", factor=float(factor))
    hf_config.rope_parameters = {**hf_config.rope_parameters, "full_attention": full}
    logger.info("%s: full layers' RoPE scaled linearly by %g (gemma3.rope.scaling.factor)", path,
                factor)


# llama.cpp's tensor names (gguf-py's TENSOR_NAMES) -> the Hugging Face modules, as gguf-py's
# per-architecture name maps (which transformers' GGUF loader uses) pair them
_MODEL_MODULES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}
_LAYER_MODULES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Qwen 3 and Gemma 3 normalize each head's queries and keys before the rotation
_QK_NORM_MODULES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 3 puts a norm before and after each sublayer: its ffn_norm is the one before the MLP, and
# "post_attention" means after attention's output (Llama's name for the norm before the MLP)
_GEMMA3_NORM_MODULES = {
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def hf_parameter_names(architecture: str,
                       hf_config: transformers.PretrainedConfig) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, for every parameter transformers' model
    class of this config has (tested against that class's state_dict; building even a meta-device
    model to list them took ~3 s, mostly importing its code)."""
    biased = {"attn_q", "attn_k", "attn_v"} if architecture == "qwen2" else set()
    if getattr(hf_config, "attention_bias", False):  # every attention projection
        biased |= {"attn_q", "attn_k", "attn_v", "attn_output"}
    if getattr(hf_config, "mlp_bias", False):  # Llama's flag (Qwen 3 and Gemma 3 have none)
        biased |= {"ffn_gate", "ffn_up", "ffn_down"}
    layer_modules = dict(_LAYER_MODULES)
    if architecture in ("qwen3", "gemma3"):
        layer_modules |= _QK_NORM_MODULES
    if architecture == "gemma3":
        layer_modules |= _GEMMA3_NORM_MODULES
    names = {f"{stem}.weight": f"{module}.weight" for stem, module in _MODEL_MODULES.items()}
    for layer in range(hf_config.num_hidden_layers):
        for stem, module in layer_modules.items():
            for suffix in ("weight", "bias") if stem in biased else ("weight",):
                names[f"blk.{layer}.{stem}.{suffix}"] = f"model.layers.{layer}.{module}.{suffix}"
    return names


def is_stored_plus_one(architecture: str, name: str) -> bool:
    """Whether the GGUF tensor `name` holds w + 1 for the model's w: Gemma's RMSNorm scales by
    1 + w, and llama.cpp's converter folds that 1 into every norm it writes. transformers' GGUF
    loader (Gemma2TensorProcessor, which gemma3 files use) subtracts 1 again from every tensor
    whose GGUF name contains "norm.weight": the same test here, so the same tensors."""
    return architecture == "gemma3" and "norm.weight" in name


def llama_cpp_row_order(architecture: str, name: str, num_rows: int,
                        hf_config: transformers.PretrainedConfig) -> np.ndarray | None:
    """The row order that undoes llama.cpp's q/k permutation (rotary halves interleaved per head,
    Llama files only), as transformers' GGUF loader undoes it; None where rows stay put.

    NOTE: head counts from the config: a file without head_count_kv is still permuted (llama.cpp
    assumes n_kv = n_head), where transformers' own load then skips the un-permutation.
    """
    if architecture != "llama" or (".attn_q." not in name and ".attn_k." not in name):
        return None
    num_heads = getattr(hf_config, "num_attention_heads", None)
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None)
    if num_heads is None or num_kv_heads is None:
        return None
    heads = num_heads if ".attn_q." in name else num_kv_heads
    if num_rows % (2 * heads):
        raise ValueError(f"{name}: {num_rows} rows do not split into {heads} heads of rotary "
                         f"pairs")
    # [heads, 2, rows per head // 2] in file order -> [heads, rows per head // 2, 2]
    return np.arange(num_rows).reshape(heads, num_rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _read_tensor(tensor: GGUFTensor, rows: np.ndarray | None, dtype: torch.dtype,
                 packed: bool, minus_one: bool = False) -> Weight:
    """One tensor out of the memory map, its rows in `rows` order (copied: the file may change
    while we serve; rows are picked from the file's bytes, which moves whole rows of blocks);
    `minus_one`: expanded, then 1 subtracted (is_stored_plus_one)."""
    fmt = tensor.tensor_type.name
    values = np.array(tensor.data) if rows is None else tensor.data[rows]
    if tensor.data.ndim == 2 and fmt in PACKED_FORMATS and not minus_one:
        in_features = int(tensor.shape[0])  # GGML lists the fastest-moving dimension first
        blocks = torch.from_numpy(values.view(np.uint8))  # [out, bytes per row]
        weight = PackedWeight(fmt, blocks, (blocks.shape[0], in_features))
        return weight if packed else weight.dequantize().to(dtype)
    try:
        # NOTE: the very call transformers makes; each row dequantizes on its own
        values = gguf.quants.dequantize(values, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"tensor {tensor.name} is stored as {fmt}, which gguf-py cannot "
                         f"dequantize") from None
    values = np.asarray(values, dtype=np.float32)
    if minus_one:
        # NOTE: float32 minus one, as transformers' `weights - 1` on the same array, before any
        # cast to `dtype`: w + 1 stored in float32 does not always come back as w exactly
        values = values - np.float32(1.0)
    expanded = torch.from_numpy(values)
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
