"""The architecture numbers of a Llama-family checkpoint, read once from its Hugging Face config.

One dataclass covers Llama, Mistral, Qwen2 and SmolLM: they differ only in the fields below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class LlamaArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    # rotary inverse frequencies [head_dim // 2] after any rope scaling, and the cos/sin scale factor
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen2 puts a bias on the q/k/v projections; Llama and Mistral do not
    qkv_bias: bool
    # Mistral-style sliding window in tokens, None for full attention
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> LlamaArch:
        """Build from a `transformers.PretrainedConfig`; unsupported architectures fail clearly."""
        architectures = list(getattr(hf_config, "architectures", None) or [])
        model_type = getattr(hf_config, "model_type", None)
        known_types = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM"}
        if not architectures and model_type in known_types:
            architectures = [known_types[model_type]]
        if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
            raise ValueError(
                f"unsupported architecture {architectures or model_type!r}: specserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        inv_freq, attention_scaling = _rope_inv_freq(hf_config, head_dim)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        is_qwen2 = "Qwen2ForCausalLM" in architectures
        sliding_window = getattr(hf_config, "sliding_window", None)
        if is_qwen2 and not getattr(hf_config, "use_sliding_window", False):
            sliding_window = None
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(attention_scaling),
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 4096)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(getattr(hf_config, "attention_bias", False)),
            sliding_window=sliding_window,
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
        )


def _rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Reuse transformers' rope-scaling maths so scaled checkpoints match their reference exactly.

    Theta lives in `rope_parameters` in transformers 5.x and in a top-level field before.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if rope_type == "default":
        theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (float(theta) ** exponents), 1.0
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}: specserve supports default, "
            f"{', '.join(_STATIC_ROPE_TYPES)}"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)


# rope types whose frequencies do not change with the sequence length (dynamic NTK does)
_STATIC_ROPE_TYPES = ("linear", "llama3", "yarn")
