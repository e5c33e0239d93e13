"""Tiny random checkpoints of every family specserve runs, built by the tests themselves, and the
transformers reference."""

from __future__ import annotations

import torch
import transformers

TINY_SHAPES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
                   "max_position_embeddings": 512, "tie_word_embeddings": False, "eos_token_id": 0,
                   "bos_token_id": 1, "initializer_range": 0.15}


# head_dim unlike hidden / heads, as in the real models (Qwen3-0.6B: 128 against 1024 / 16)
QWEN3_SHAPES = {"head_dim": 24}
# three layers, the last full and the others sliding over 6 tokens with their own RoPE base;
# query_pre_attn_scalar unlike head_dim, as in Gemma 3 27B
GEMMA3_SHAPES = {"head_dim": 24, "num_hidden_layers": 3, "sliding_window": 6,
                 "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                 "query_pre_attn_scalar": 32, "pad_token_id": 2,
                 "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 1e4}}}
_FAMILY_SHAPES = {"qwen3": QWEN3_SHAPES, "gemma3": GEMMA3_SHAPES}
# kind -> transformers' config and model classes
_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
FAMILIES_WITH_QK_NORM = ("qwen3", "gemma3")


def _randomize_norms(model) -> None:
    """Every norm weight random: Gemma's start at zero (a scale of 1 + 0) and Qwen3's at one,
    which would hide a norm applied in the wrong place."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5) if "gemma" in type(model).__name__.lower() else \
                    param.uniform_(0.5, 1.5)


def build_tiny_checkpoint(path, kind: str = "llama", seed: int = 0, layer_scale: float = 1.0,
                          **overrides) -> str:
    """Save a random tiny model as a Hugging Face folder; the large init range makes logits peaked,
    so greedy ties never flip on rounding, while tokens still depend on their context.

    layer_scale < 1 shrinks what each layer adds to the residual stream (attention's o_proj and the
    MLP's down_proj; on Gemma 3 also its output norms' gains, which would undo that): at 0.01-0.02 the next token is mostly the token before it's favourite (a
    "mostly bigram" model, which a drafter built in tests/helpers/bigram_drafters.py guesses right
    60-85% of the time), while the context still decides the rest."""
    torch.manual_seed(seed)
    shapes = {**TINY_SHAPES, **_FAMILY_SHAPES.get(kind, {}), **overrides}
    if kind not in _CLASSES:
        raise ValueError(kind)
    config_class, model_class = (getattr(transformers, name) for name in _CLASSES[kind])
    model = model_class(config_class(**shapes))
    if kind in FAMILIES_WITH_QK_NORM:
        _randomize_norms(model)
    if layer_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(layer_scale)
                layer.mlp.down_proj.weight.mul_(layer_scale)
                if kind == "gemma3":  # its output norms give a block's output unit scale again:
                    for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                        norm.weight.copy_(layer_scale * (1.0 + norm.weight) - 1.0)  # gain - 1
    model.save_pretrained(path)
    return str(path)


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int,
              dtype: torch.dtype = torch.float64) -> list[int]:
    """The reference: transformers' own greedy generate on the same weights."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


