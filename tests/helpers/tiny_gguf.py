"""Tiny random GGUF files (llama, qwen2, qwen3, gemma3) written by the tests, as llama.cpp's converter
writes them: q/k rows permuted for llama, Gemma's norms stored plus one, each tensor in the format
asked for (gguf-py quantizes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16 and MXFP4; it cannot make
K-quants)."""

from __future__ import annotations

import gguf
import numpy as np

HIDDEN, INTERMEDIATE, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 96
HEAD_DIM = HIDDEN // NUM_HEADS
# NOTE: transformers' GGUF config takes no head size from a qwen3 file: Qwen3Config's default of
# 128 is the one a file it loads can have. Gemma 3's comes from key_length; one that is not
# HIDDEN // NUM_HEADS shows it is read.
HEAD_DIMS = {"qwen3": 128, "gemma3": 32}

# GGUF tensor name -> format; every packed format gguf-py can write, F32 matrices, and MXFP4, which
# specserve does not keep packed
MIXED_FORMATS = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q4_1",
    "blk.0.attn_q.weight": "F16", "blk.0.attn_k.weight": "Q8_0", "blk.0.attn_v.weight": "Q4_0",
    "blk.0.attn_output.weight": "BF16", "blk.0.ffn_gate.weight": "Q4_1",
    "blk.0.ffn_up.weight": "Q8_0", "blk.0.ffn_down.weight": "MXFP4",
    "blk.1.attn_q.weight": "Q4_0", "blk.1.attn_k.weight": "F16", "blk.1.attn_v.weight": "Q8_0",
    "blk.1.attn_output.weight": "Q5_1", "blk.1.ffn_gate.weight": "F32",
    "blk.1.ffn_up.weight": "F16", "blk.1.ffn_down.weight": "Q5_0",
}


def write_tiny_gguf(path, architecture: str = "llama", formats: dict[str, str] | None = None,
                    tie_word_embeddings: bool = False, seed: int = 0,
                    num_layers: int = NUM_LAYERS, head_dim: int | None = None,
                    rope_scaling_factor: float | None = None) -> dict[str, np.ndarray]:
    """Write a random model to `path`; returns each tensor as the model holds it, before
    quantization, in Hugging Face row order (GGUF name -> float32 [out, in]), to check the reading
    against (a Gemma norm w is stored as w + 1). `head_dim`: HEAD_DIMS' or HEAD_DIM if None."""
    formats = MIXED_FORMATS if formats is None else formats
    head_dim = head_dim or HEAD_DIMS.get(architecture, HEAD_DIM)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    if architecture in HEAD_DIMS:  # llama.cpp's converter writes both for Qwen 3 and Gemma 3
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if architecture == "gemma3":
        writer.add_sliding_window(16)
    if rope_scaling_factor is not None:  # as llama.cpp's converter writes Gemma 3 4B's
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling_factor)

    written = {}
    for name, shape in _tensor_shapes(architecture, tie_word_embeddings, head_dim, num_layers):
        values = rng.standard_normal(shape, dtype=np.float32) * 0.2
        is_norm = len(shape) == 1 and name.endswith("norm.weight")
        if is_norm and architecture != "gemma3":  # Gemma scales by 1 + w: its w sits near 0
            values += 1.0
        written[name] = values
        stored = values
        if is_norm and architecture == "gemma3":
            stored = values + np.float32(1.0)  # llama.cpp's converter: every Gemma norm plus one
        if architecture == "llama" and ".attn_q." in name:
            stored = _llama_cpp_permute(values, NUM_HEADS)
        elif architecture == "llama" and ".attn_k." in name:
            stored = _llama_cpp_permute(values, NUM_KV_HEADS)
        fmt = formats.get(name, "F32")
        qtype = gguf.GGMLQuantizationType[fmt]
        if fmt == "F32":
            writer.add_tensor(name, stored)
        else:
            writer.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _tensor_shapes(architecture: str, tie_word_embeddings: bool, head_dim: int,
                   num_layers: int) -> list[tuple[str, tuple]]:
    q_size, kv_size = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    shapes = [("token_embd.weight", (VOCAB, HIDDEN)), ("output_norm.weight", (HIDDEN,))]
    if not tie_word_embeddings:
        shapes.append(("output.weight", (VOCAB, HIDDEN)))
    for layer in range(num_layers):
        block = f"blk.{layer}"
        shapes += [
            (f"{block}.attn_norm.weight", (HIDDEN,)),
            (f"{block}.attn_q.weight", (q_size, HIDDEN)),
            (f"{block}.attn_k.weight", (kv_size, HIDDEN)),
            (f"{block}.attn_v.weight", (kv_size, HIDDEN)),
            (f"{block}.attn_output.weight", (HIDDEN, q_size)),
            (f"{block}.ffn_norm.weight", (HIDDEN,)),
            (f"{block}.ffn_gate.weight", (INTERMEDIATE, HIDDEN)),
            (f"{block}.ffn_up.weight", (INTERMEDIATE, HIDDEN)),
            (f"{block}.ffn_down.weight", (HIDDEN, INTERMEDIATE)),
        ]
        if architecture == "qwen2":  # Qwen2 puts a bias on q/k/v
            shapes += [(f"{block}.attn_q.bias", (q_size,)), (f"{block}.attn_k.bias", (kv_size,)),
                       (f"{block}.attn_v.bias", (kv_size,))]
        if architecture in ("qwen3", "gemma3"):  # a norm over each head's queries and keys
            shapes += [(f"{block}.attn_q_norm.weight", (head_dim,)),
                       (f"{block}.attn_k_norm.weight", (head_dim,))]
        if architecture == "gemma3":  # norms after attention and after the MLP too
            shapes += [(f"{block}.post_attention_norm.weight", (HIDDEN,)),
                       (f"{block}.post_ffw_norm.weight", (HIDDEN,))]
    return shapes


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py row order for q and k (rotary halves interleaved)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))
