"""Tiny random Llama-family GGUF files written by the tests, as llama.cpp's converter writes them:
q/k rows permuted for llama, each tensor in the format asked for (gguf-py quantizes Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, F16 and BF16; it cannot make K-quants)."""

from __future__ import annotations

import gguf
import numpy as np

HIDDEN, INTERMEDIATE, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 96
HEAD_DIM = HIDDEN // NUM_HEADS

# GGUF tensor name -> format; every packed format gguf-py can write, F32 matrices, and Q5_0, which
# specserve does not keep packed
MIXED_FORMATS = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q4_1",
    "blk.0.attn_q.weight": "F16", "blk.0.attn_k.weight": "Q8_0", "blk.0.attn_v.weight": "Q4_0",
    "blk.0.attn_output.weight": "BF16", "blk.0.ffn_gate.weight": "Q4_1",
    "blk.0.ffn_up.weight": "Q8_0", "blk.0.ffn_down.weight": "Q5_0",
    "blk.1.attn_q.weight": "Q4_0", "blk.1.attn_k.weight": "F16", "blk.1.attn_v.weight": "Q8_0",
    "blk.1.attn_output.weight": "Q4_0", "blk.1.ffn_gate.weight": "F32",
    "blk.1.ffn_up.weight": "F16", "blk.1.ffn_down.weight": "Q8_0",
}


def write_tiny_gguf(path, architecture: str = "llama", formats: dict[str, str] | None = None,
                    tie_word_embeddings: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a random model to `path`; returns each tensor as written before quantization, in
    Hugging Face row order (GGUF name -> float32 [out, in]), to check the reading against."""
    formats = MIXED_FORMATS if formats is None else formats
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(NUM_LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)

    written = {}
    for name, shape in _tensor_shapes(architecture, tie_word_embeddings):
        values = rng.standard_normal(shape, dtype=np.float32) * 0.2
        if len(shape) == 1 and name.endswith("norm.weight"):
            values += 1.0
        written[name] = values
        stored = values
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


def _tensor_shapes(architecture: str, tie_word_embeddings: bool) -> list[tuple[str, tuple]]:
    kv_size = NUM_KV_HEADS * HEAD_DIM
    shapes = [("token_embd.weight", (VOCAB, HIDDEN)), ("output_norm.weight", (HIDDEN,))]
    if not tie_word_embeddings:
        shapes.append(("output.weight", (VOCAB, HIDDEN)))
    for layer in range(NUM_LAYERS):
        block = f"blk.{layer}"
        shapes += [
            (f"{block}.attn_norm.weight", (HIDDEN,)),
            (f"{block}.attn_q.weight", (HIDDEN, HIDDEN)),
            (f"{block}.attn_k.weight", (kv_size, HIDDEN)),
            (f"{block}.attn_v.weight", (kv_size, HIDDEN)),
            (f"{block}.attn_output.weight", (HIDDEN, HIDDEN)),
            (f"{block}.ffn_norm.weight", (HIDDEN,)),
            (f"{block}.ffn_gate.weight", (INTERMEDIATE, HIDDEN)),
            (f"{block}.ffn_up.weight", (INTERMEDIATE, HIDDEN)),
            (f"{block}.ffn_down.weight", (HIDDEN, INTERMEDIATE)),
        ]
        if architecture == "qwen2":  # Qwen2 puts a bias on q/k/v
            shapes += [(f"{block}.attn_q.bias", (HIDDEN,)), (f"{block}.attn_k.bias", (kv_size,)),
                       (f"{block}.attn_v.bias", (kv_size,))]
    return shapes


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py row order for q and k (rotary halves interleaved)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))
