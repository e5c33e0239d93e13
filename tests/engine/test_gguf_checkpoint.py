"""engine/models/gguf_checkpoint.py: a GGUF read directly gives, expanded, exactly the tensors
transformers' own GGUF load gives (names, q/k row order, Gemma's norms, bits), and, packed, the
file's blocks that dequantize to those same tensors: on tiny llama, qwen2, qwen3 and gemma3 files,
the embedded model, and the real Gemma 3 270M where its package is installed."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from real_gemma import real_gemma_path
from tiny_gguf import HEAD_DIMS, MIXED_FORMATS, write_tiny_gguf
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
)

from engine.models.arch import DecoderArch
from engine.models.gguf_checkpoint import (
    hf_parameter_names,
    llama_cpp_row_order,
    read_gguf,
    read_gguf_config,
    read_gguf_weights,
)
from engine.models.gguf_file import read_gguf_layout
from engine.models.loader import embedded_gguf_path, load_checkpoint, load_tokenizer
from kernels.packed_weight import PACKED_FORMATS, PackedWeight

# GGUF name -> Hugging Face name for the tensors the tiny file's MIXED_FORMATS names
HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name in HF_NAMES:
        return HF_NAMES[gguf_name]
    _, layer, stem = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{HF_NAMES[stem]}"


# `general.architecture` -> the config's model_type and model class, as transformers reads a file
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
GEMMA3_NORMS = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "attn_q_norm",
                "attn_k_norm")


def transformers_state_dict(path: Path, dtype: torch.dtype = torch.float32
                            ) -> dict[str, torch.Tensor]:
    """transformers' own GGUF load: the reference every expanded tensor must equal."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, local_files_only=True)
    weights = model.state_dict()
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight")  # the checkpoint leaves a tied lm_head out
    return weights


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                         dtype: torch.dtype = torch.float32) -> None:
    assert sorted(got) == sorted(want)
    unequal = [name for name in want
               if got[name].dtype != dtype or not torch.equal(got[name], want[name])]
    assert not unequal, f"differ from transformers' GGUF load: {unequal}"


def transformers_names(architecture: str, hf_config) -> dict[str, str]:
    """GGUF name -> Hugging Face name as transformers' GGUF loader pairs them: its own
    get_gguf_hf_weights_map over the model class's parameters (gguf-py's name map per name)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
    return get_gguf_hf_weights_map(model, processor)


def transformers_tensor(tensor, architecture: str, hf_config,
                        rows: slice = slice(None)) -> torch.Tensor:
    """One file tensor (`rows` of it) as transformers' GGUF loader turns it into a weight, step
    by step (load_gguf_checkpoint without its reader, which takes ~15 s on a 262k vocabulary):
    gguf-py's dequantize, then the architecture's tensor processor, then a float32 tensor."""
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
    values = gguf.quants.dequantize(tensor.data[rows], tensor.tensor_type)
    processed = processor.process(weights=values, name=tensor.name)
    return torch.from_numpy(np.copy(processed.weights)).to(torch.float32)


@pytest.mark.parametrize("architecture, extra", [
    ("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {}),
    ("qwen3", {"attention_bias": True}), ("qwen3", {"tie_word_embeddings": True}),
    ("gemma3", {}), ("gemma3", {"tie_word_embeddings": True}),
])
def test_parameter_names_are_transformers_own(tmp_path, architecture, extra):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, architecture)
    hf_config = read_gguf_config(str(path))
    for key, value in extra.items():
        setattr(hf_config, key, value)

    assert hf_parameter_names(architecture, hf_config) == transformers_names(architecture,
                                                                             hf_config)


def test_embedded_parameter_names_are_transformers_own():
    hf_config = load_checkpoint(None, torch.float32, packed=True).hf_config
    assert hf_parameter_names("llama", hf_config) == transformers_names("llama", hf_config)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (9, 3), (8, 8)])
def test_q_and_k_row_order_is_transformers_own(num_heads, num_kv_heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    head_dim = 16
    hf_config = transformers.LlamaConfig(hidden_size=num_heads * head_dim, num_hidden_layers=1,
                                         num_attention_heads=num_heads,
                                         num_key_value_heads=num_kv_heads)
    processor = LlamaTensorProcessor(config=hf_config.to_dict())
    for name, heads in [("blk.0.attn_q.weight", num_heads), ("blk.0.attn_k.bias", num_kv_heads)]:
        rows = heads * head_dim
        want = processor.process(weights=np.arange(rows), name=name).weights
        assert np.array_equal(llama_cpp_row_order("llama", name, rows, hf_config), want), name
    assert llama_cpp_row_order("llama", "blk.0.attn_v.weight", 32, hf_config) is None
    assert llama_cpp_row_order("qwen2", "blk.0.attn_q.weight", 32, hf_config) is None


@pytest.mark.parametrize("architecture, tied", [
    ("llama", False), ("qwen2", False), ("qwen3", False), ("gemma3", True), ("gemma3", False),
])
def test_tiny_gguf_expands_exactly_as_transformers_loads_it(tmp_path, architecture, tied):
    path = tmp_path / f"{architecture}.gguf"
    write_tiny_gguf(path, architecture, tie_word_embeddings=tied)

    hf_config, weights = read_gguf(str(path), torch.float32, packed=False)

    assert_bit_identical(weights, transformers_state_dict(path))
    # the config is transformers' own, with the model class it names filled in
    reference_config = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert reference_config.to_dict() | {"architectures": [MODEL_CLASSES[architecture]]} == (
        hf_config.to_dict())
    assert hf_config.model_type == MODEL_TYPES[architecture]
    assert hf_config.tie_word_embeddings is tied


def test_gemma3_config_reads_the_file_as_transformers_does(tmp_path):
    path = tmp_path / "gemma3.gguf"
    write_tiny_gguf(path, "gemma3", num_layers=6, tie_word_embeddings=True)

    hf_config = read_gguf_config(str(path))

    assert type(hf_config).__name__ == "Gemma3TextConfig"
    assert hf_config.architectures == ["Gemma3ForCausalLM"]
    assert hf_config.head_dim == HEAD_DIMS["gemma3"]  # key_length, not hidden_size // heads
    assert hf_config.sliding_window == 16
    assert hf_config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    # the file's freq_base is the full layers' theta; the sliding layers keep Gemma 3's 10k
    assert hf_config.rope_parameters == {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    # not in the metadata: Gemma3TextConfig's defaults
    assert hf_config.query_pre_attn_scalar == 256
    assert hf_config.hidden_activation == "gelu_pytorch_tanh"


def test_gemma3_rope_scaling_in_the_file_scales_the_full_layers(tmp_path):
    """Gemma 3 4B's linear scaling (factor 8), which transformers' GGUF config drops: the full
    layers rotate as the published model's config says, the sliding layers unscaled."""
    path = tmp_path / "gemma3.gguf"
    write_tiny_gguf(path, "gemma3", num_layers=6, rope_scaling_factor=8.0)
    hf_config = read_gguf_config(str(path))
    assert hf_config.rope_parameters["full_attention"]["rope_type"] == "linear"
    arch = DecoderArch.from_hf_config(hf_config)
    published = transformers.Gemma3TextConfig(**{
        **{k: v for k, v in hf_config.to_dict().items() if k != "transformers_version"},
        "rope_parameters": {**hf_config.rope_parameters, "full_attention": {
            "rope_type": "linear", "factor": 8.0,
            "rope_theta": hf_config.rope_parameters["full_attention"]["rope_theta"]}}})
    rotary = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(published)
    assert torch.equal(torch.tensor(arch.rope_inv_freq), rotary.full_attention_inv_freq)
    assert torch.equal(torch.tensor(arch.local_rope_inv_freq), rotary.sliding_attention_inv_freq)
    unscaled = DecoderArch.from_hf_config(read_gguf_config(str(write_unscaled(tmp_path))))
    assert arch.rope_inv_freq[1] == pytest.approx(unscaled.rope_inv_freq[1] / 8)


def write_unscaled(tmp_path: Path) -> Path:
    path = tmp_path / "unscaled.gguf"
    write_tiny_gguf(path, "gemma3", num_layers=6)
    return path


def test_gemma3_norms_come_back_as_stored_minus_one_in_float32(tmp_path):
    """llama.cpp stores each Gemma norm w as w + 1; reading takes the 1 off in float32, before any
    cast, as transformers does (the bfloat16 load checked against transformers' too)."""
    path = tmp_path / "gemma3.gguf"
    written = write_tiny_gguf(path, "gemma3", tie_word_embeddings=True)

    _, weights = read_gguf(str(path), torch.float32, packed=True)
    _, bf16_weights = read_gguf(str(path), torch.bfloat16, packed=False)

    stored = {name: values + np.float32(1.0) for name, values in written.items()
              if name.endswith("norm.weight")}
    assert sorted(stored) == sorted(["output_norm.weight"] + [
        f"blk.{layer}.{norm}.weight" for layer in range(2) for norm in GEMMA3_NORMS])
    hf_names = hf_parameter_names("gemma3", read_gguf_config(str(path)))
    for name, values in stored.items():
        minus_one = torch.from_numpy(values - np.float32(1.0))
        assert torch.equal(weights[hf_names[name]], minus_one), name
        assert torch.equal(bf16_weights[hf_names[name]], minus_one.to(torch.bfloat16)), name
    assert_bit_identical(bf16_weights, transformers_state_dict(path, torch.bfloat16),
                         torch.bfloat16)


def test_qwen3_head_size_comes_from_key_length_where_transformers_reads_none(tmp_path):
    """transformers gives every qwen3 file Qwen3Config's head_dim of 128 (and then cannot load
    one with another); the file's key_length is taken instead."""
    path = tmp_path / "qwen3.gguf"
    write_tiny_gguf(path, "qwen3", head_dim=16)

    hf_config, weights = read_gguf(str(path), torch.float32, packed=False)

    reference_config = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert reference_config.head_dim == 128
    assert hf_config.head_dim == 16
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (16,)


def test_llama_q_and_k_rows_come_back_in_hugging_face_order(tmp_path):
    # F16 keeps these values exactly (after rounding), so the order is checked against what was
    # written, independently of transformers
    path = tmp_path / "tiny.gguf"
    written = write_tiny_gguf(path)
    _, weights = read_gguf(str(path), torch.float32, packed=False)

    for name in ("blk.0.attn_q.weight", "blk.1.attn_k.weight"):
        assert MIXED_FORMATS[name] == "F16"
        expected = torch.from_numpy(written[name]).half().float()
        assert torch.equal(weights[hf_name(name)], expected), name
    norm = torch.from_numpy(written["blk.1.ffn_norm.weight"])
    assert torch.equal(weights["model.layers.1.post_attention_layernorm.weight"], norm)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_packed_weights_dequantize_to_the_expanded_ones(tmp_path, caplog, architecture):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, architecture)
    _, expanded = read_gguf(str(path), torch.float32, packed=False)

    with caplog.at_level(logging.WARNING, logger="engine.models.gguf_checkpoint"):
        _, packed = read_gguf(str(path), torch.float32, packed=True)

    assert sorted(packed) == sorted(expanded)
    for gguf_name, fmt in MIXED_FORMATS.items():
        weight = packed[hf_name(gguf_name)]
        if fmt in PACKED_FORMATS:
            assert isinstance(weight, PackedWeight) and weight.format == fmt, gguf_name
            assert weight.shape == tuple(expanded[hf_name(gguf_name)].shape), gguf_name
            weight = weight.dequantize()
        else:  # F32 matrices, and formats not kept packed, expanded with a warning
            assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32, gguf_name
        assert torch.equal(weight, expanded[hf_name(gguf_name)]), gguf_name
    norms = [name for name in packed if name.endswith("norm.weight")]
    assert norms and all(packed[name].dtype == torch.float32 for name in norms)
    assert all(torch.equal(packed[name], expanded[name]) for name in norms)
    unpacked = sorted(set(MIXED_FORMATS.values()) - set(PACKED_FORMATS) - {"F32"})
    for fmt in unpacked:
        assert fmt in caplog.text, fmt
    assert ("expanded to float32" in caplog.text) is bool(unpacked)


def test_expanded_weights_take_the_dtype_asked_for(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    _, weights = read_gguf(str(path), torch.bfloat16, packed=False)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_tied_embeddings_leave_lm_head_absent(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, tie_word_embeddings=True)

    hf_config, weights = read_gguf(str(path), torch.float32, packed=True)

    assert hf_config.tie_word_embeddings
    assert "lm_head.weight" not in weights
    assert isinstance(weights["model.embed_tokens.weight"], PackedWeight)


def test_other_architectures_are_refused_by_name(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(ValueError, match=r"'gpt2' model.*llama, qwen2, qwen3, gemma3"):
        read_gguf(str(path), torch.float32, packed=True)


@pytest.mark.slow
def test_embedded_model_reads_exactly_as_transformers_loads_it():
    """The one slow test here (~30 s, transformers' whole-model dequantization): every tensor of
    the shipped Q4_1 file, read directly, equals transformers' load of it, bit for bit; its packed
    blocks dequantize to the same; the cached tokenizer equals the GGUF's own."""
    gguf_path = Path(embedded_gguf_path())
    expanded = load_checkpoint(None, torch.float32)
    packed = load_checkpoint(None, torch.float32, packed=True)

    assert_bit_identical(expanded.weights, transformers_state_dict(gguf_path))
    formats = {name: w.format for name, w in packed.weights.items() if isinstance(w, PackedWeight)}
    assert formats["model.embed_tokens.weight"] == "Q8_0"
    assert set(formats.values()) == {"Q4_1", "Q8_0"} and len(formats) == 30 * 7 + 1
    for name, weight in packed.weights.items():
        weight = weight.dequantize() if isinstance(weight, PackedWeight) else weight
        assert torch.equal(weight, expanded.weights[name]), name

    from_file = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    prompt = from_file.apply_chat_template([{"role": "user", "content": "Capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert load_tokenizer(None)(prompt).input_ids == from_file(prompt).input_ids


# ------------------------------------------------- the real Gemma 3 270M Q4_K_M (its package)

@pytest.fixture(scope="module")
def gemma3_270m() -> Path:
    return real_gemma_path()


def gemma3_metadata_config(layout) -> transformers.PretrainedConfig:
    """The file's config built from the metadata keys transformers' GGUF loader maps for gemma3
    (its own table), in a second: transformers' reading of the file takes ~25 s (the slow test
    checks this config against it)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    values = {hf_key: layout.metadata[f"gemma3.{key}"]
              for key, hf_key in GGUF_CONFIG_MAPPING["gemma3"].items()
              if hf_key and f"gemma3.{key}" in layout.metadata}
    return transformers.Gemma3TextConfig(
        **values, vocab_size=layout.metadata["tokenizer.ggml.tokens"].count,
        tie_word_embeddings=all(tensor.name != "output.weight" for tensor in layout.tensors))


def test_real_gemma3_names_are_transformers_own(gemma3_270m):
    layout = read_gguf_layout(str(gemma3_270m))
    hf_config = gemma3_metadata_config(layout)

    names = hf_parameter_names("gemma3", hf_config)

    assert names == transformers_names("gemma3", hf_config)
    # every tensor of the file has a name, and every name a tensor but the tied lm_head
    assert sorted(names) == sorted([tensor.name for tensor in layout.tensors] + ["output.weight"])


def test_real_gemma3_tensors_are_transformers_own(gemma3_270m):
    """Every norm, every tensor of the first layer (Q5_0, Q8_0, Q4_K, Q6_K) and the Q8_0 token
    table's first rows, read packed and dequantized, against transformers' steps for each."""
    layout = read_gguf_layout(str(gemma3_270m))
    hf_config = gemma3_metadata_config(layout)
    names = hf_parameter_names("gemma3", hf_config)

    weights = read_gguf_weights(layout, hf_config, torch.float32, packed=True)

    checked = [tensor for tensor in layout.tensors
               if tensor.name.startswith("blk.0.") or tensor.name.endswith("norm.weight")]
    assert {tensor.tensor_type.name for tensor in checked} == {"F32", "Q5_0", "Q8_0", "Q4_K",
                                                               "Q6_K"}
    for tensor in checked:
        weight = weights[names[tensor.name]]
        if isinstance(weight, PackedWeight):
            weight = weight.dequantize()
        want = transformers_tensor(tensor, "gemma3", hf_config)
        assert weight.dtype == torch.float32 and torch.equal(weight, want), tensor.name
    table = next(tensor for tensor in layout.tensors if tensor.name == "token_embd.weight")
    packed_table = weights["model.embed_tokens.weight"]
    assert isinstance(packed_table, PackedWeight) and packed_table.format == "Q8_0"
    assert torch.equal(packed_table.select_rows(range(16)).dequantize(),
                       transformers_tensor(table, "gemma3", hf_config, rows=slice(0, 16)))


@pytest.mark.slow
def test_real_gemma3_reads_exactly_as_transformers_loads_it(gemma3_270m):
    """The full comparison (~2 min: transformers' load of the file dequantizes every tensor after
    reading the 262k-token vocabulary twice): every tensor, expanded, bit for bit; the config
    transformers reads, which the quick tests' metadata config agrees with."""
    hf_config, weights = read_gguf(str(gemma3_270m), torch.float32, packed=False)

    assert_bit_identical(weights, transformers_state_dict(gemma3_270m))
    assert hf_config.architectures == ["Gemma3ForCausalLM"]
    quick_config = gemma3_metadata_config(read_gguf_layout(str(gemma3_270m))).to_dict()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                  "max_position_embeddings", "sliding_window", "layer_types", "rope_parameters",
                  "query_pre_attn_scalar", "hidden_activation", "tie_word_embeddings"):
        assert quick_config[field] == getattr(hf_config, field), field
