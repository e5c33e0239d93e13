"""The architecture numbers of a decoder checkpoint, read once from its Hugging Face config.

One dataclass covers Llama, Mistral, Qwen2, SmolLM, Qwen3 and Gemma 3 (text): they are one
pre-norm decoder that differs only in the fields below (Qwen3 adds per-head q/k norms; Gemma 3
adds those, norms around both blocks' outputs, scaled embeddings, GeGLU and sliding-window
layers with their own RoPE base).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Gemma3ForCausalLM")
# model_type -> architecture, for configs that name no architecture (a GGUF's, a bare config)
_ARCHITECTURE_OF_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                         "gemma3_text": "Gemma3ForCausalLM"}
# the MLP activations the decoder runs, by their Hugging Face names
HIDDEN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class DecoderArch:
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
    # Mistral-style sliding window in tokens over every layer, None for full attention
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # a model that mixes windowed and full layers (Gemma 3, Qwen3 with max_window_layers): the
    # window of the layers flagged in sliding_layers, which also rotate by local_rope_inv_freq
    # where that is set (Gemma 3's local RoPE base)
    local_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    local_rope_inv_freq: tuple[float, ...] | None = None
    local_rope_attention_scaling: float = 1.0
    # Qwen3 and Gemma 3: an RMSNorm over each head of q and of k, before RoPE
    qk_norm: bool = False
    # Gemma: every RMSNorm scales by (1 + weight), in float32 before the cast back
    gemma_norms: bool = False
    # Gemma 3: an RMSNorm on the attention's output and one on the MLP's, before each residual add
    sandwich_norms: bool = False
    # Gemma: embeddings times sqrt(hidden_size); None = unscaled
    embedding_scale: float | None = None
    hidden_act: str = "silu"
    # the query scaling; None = head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    attention_scale: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act not in HIDDEN_ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {self.hidden_act!r}: specserve runs "
                             f"{', '.join(HIDDEN_ACTIVATIONS)}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers names {len(self.sliding_layers)} layers of "
                             f"{self.num_layers}")

    def plain_layers(self, num_layers: int, **changes: Any) -> DecoderArch:
        """This model's sizes and RoPE as `num_layers` plain Llama layers over full attention: a
        draft head's layers (EAGLE, MTP), whatever the target's family."""
        return replace(self, num_layers=num_layers, sliding_window=None, local_window=None,
                       sliding_layers=(), local_rope_inv_freq=None,
                       local_rope_attention_scaling=1.0, qk_norm=False, gemma_norms=False,
                       sandwich_norms=False, embedding_scale=None, hidden_act="silu",
                       attention_scale=None, **changes)

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends within local_window (and rotates by the local RoPE)."""
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> DecoderArch:
        """Build from a `transformers.PretrainedConfig`; unsupported architectures fail clearly."""
        architectures = list(getattr(hf_config, "architectures", None) or [])
        model_type = getattr(hf_config, "model_type", None)
        if not architectures and model_type in _ARCHITECTURE_OF_TYPE:
            architectures = [_ARCHITECTURE_OF_TYPE[model_type]]
        supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ValueError(
                f"unsupported architecture {architectures or model_type!r}: specserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = supported[0]
        is_gemma3 = family == "Gemma3ForCausalLM"
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(hf_config, cap, None) is not None:
                raise ValueError(f"{cap} is not supported (Gemma 2's logit soft-capping)")
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        window, local_window, sliding_layers = _attention_windows(hf_config, family)
        layer_rope = "full_attention" if sliding_layers or is_gemma3 else None
        inv_freq, attention_scaling = _rope_inv_freq(hf_config, head_dim, layer_rope)
        local_inv_freq, local_scaling = None, 1.0
        if is_gemma3:
            local, local_scaling = _rope_inv_freq(hf_config, head_dim, "sliding_attention")
            local_inv_freq = tuple(local.tolist())
        hidden_act = getattr(hf_config, "hidden_activation", None) or getattr(
            hf_config, "hidden_act", "silu")
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
            qkv_bias=family == "Qwen2ForCausalLM" or bool(getattr(hf_config, "attention_bias",
                                                                  False)),
            sliding_window=window,
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            local_window=local_window,
            sliding_layers=sliding_layers,
            local_rope_inv_freq=local_inv_freq,
            local_rope_attention_scaling=float(local_scaling),
            qk_norm=family in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            gemma_norms=is_gemma3,
            sandwich_norms=is_gemma3,
            # NOTE: transformers keeps the scale as a float32 tensor, cast to the weights' dtype
            embedding_scale=float(torch.tensor(hf_config.hidden_size**0.5)) if is_gemma3 else None,
            hidden_act=hidden_act,
            attention_scale=(float(hf_config.query_pre_attn_scalar) ** -0.5) if is_gemma3 else None,
        )


def _attention_windows(hf_config: Any, family: str
                       ) -> tuple[int | None, int | None, tuple[bool, ...]]:
    """(window over every layer, window of the sliding layers, which layers slide) as the
    config's model class applies them: Mistral's window covers every layer; Qwen2 and Qwen3
    slide only with use_sliding_window, and, like Gemma 3, only the layers `layer_types` calls
    "sliding_attention"."""
    window = getattr(hf_config, "sliding_window", None)
    if family in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not getattr(
            hf_config, "use_sliding_window", False):
        window = None
    if window is None:
        return None, None, ()
    layer_types = getattr(hf_config, "layer_types", None)
    if family == "MistralForCausalLM" or not layer_types:
        return int(window), None, ()
    sliding = tuple(kind == "sliding_attention" for kind in layer_types)
    if all(sliding):
        return int(window), None, ()
    if not any(sliding):
        return None, None, ()
    return None, int(window), sliding


def _rope_inv_freq(hf_config: Any, head_dim: int,
                   layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Reuse transformers' rope-scaling maths so scaled checkpoints match their reference exactly.

    Theta lives in `rope_parameters` in transformers 5.x and in a top-level field before; a model
    with layer types (Gemma 3) keeps one set of parameters per type there.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    else:
        layer_type = None
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

    if layer_type is None:
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, layer_type=layer_type)


# rope types whose frequencies do not change with the sequence length (dynamic NTK does)
_STATIC_ROPE_TYPES = ("linear", "llama3", "yarn")
