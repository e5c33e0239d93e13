"""engine/models/gguf_checkpoint.py: a GGUF read directly gives, expanded, exactly the tensors
transformers' own GGUF load gives (names, q/k row order, bits), and, packed, the file's blocks
that dequantize to those same tensors."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from tiny_gguf import MIXED_FORMATS, write_tiny_gguf

from engine.models.gguf_checkpoint import (
    hf_parameter_names,
    llama_cpp_row_order,
    read_gguf,
    read_gguf_config,
)
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


def transformers_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF load, float32: the reference every expanded tensor must equal."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True)
    weights = model.state_dict()
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight")  # the checkpoint leaves a tied lm_head out
    return weights


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    unequal = [name for name in want
               if got[name].dtype != torch.float32 or not torch.equal(got[name], want[name])]
    assert not unequal, f"differ from transformers' GGUF load: {unequal}"


def transformers_names(architecture: str, hf_config) -> dict[str, str]:
    """GGUF name -> Hugging Face name as transformers' GGUF loader pairs them: its model class's
    parameters, each renamed by gguf-py's name map."""
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    name_map = gguf.get_tensor_name_map(arch, hf_config.num_hidden_layers)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    names = {}
    for hf_name in model.state_dict():
        stem, _, suffix = hf_name.rpartition(".")
        names[f"{name_map.get_name(stem)}.{suffix}"] = hf_name
    return names


@pytest.mark.parametrize("architecture, extra", [
    ("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"tie_word_embeddings": True}), ("qwen2", {}),
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


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_tiny_gguf_expands_exactly_as_transformers_loads_it(tmp_path, architecture):
    path = tmp_path / f"{architecture}.gguf"
    write_tiny_gguf(path, architecture)

    hf_config, weights = read_gguf(str(path), torch.float32, packed=False)

    assert_bit_identical(weights, transformers_state_dict(path))
    reference_config = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert getattr(hf_config, field) == getattr(reference_config, field), field
    assert hf_config.model_type == architecture


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


def test_packed_weights_dequantize_to_the_expanded_ones(tmp_path, caplog):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
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
        else:  # F32 matrices, and Q5_0, which is expanded with a warning
            assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32, gguf_name
        assert torch.equal(weight, expanded[hf_name(gguf_name)]), gguf_name
    norms = [name for name in packed if name.endswith("norm.weight")]
    assert norms and all(packed[name].dtype == torch.float32 for name in norms)
    assert "Q5_0" in caplog.text and "expanded to float32" in caplog.text


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

    with pytest.raises(ValueError, match=r"'gpt2' model.*llama, qwen2"):
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
