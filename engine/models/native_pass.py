"""A packed or float32 model's forward on the CPU as one native call, when its shapes allow it.

It runs every family engine/models/llama.py does (Llama, Mistral, Qwen2, Qwen3, Gemma 3: per-head
q/k norms, output norms, GeGLU, sliding layers with their own window and RoPE tables) and the
EAGLE heads' plain layers.

A float32 Llama on the CPU with packed linears and specserve's fused ops runs ~400 torch ops a
step, each a dispatch and most an OpenMP fork and join; `kernels/csrc/native_decoder.cpp` runs the
same kernels, bit for bit, in one parallel region. The torch path stays the reference and serves
everything the pass does not take: CUDA, tensor parallelism, layers partly in another dtype, the
Triton attention backend. A float32 model's decoder linears take the kernel's float32 group layout
(`adopt_float32_layers`) so the pass runs it too. SPECSERVE_NATIVE_PASS=0 turns the pass off (to
compare the two).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from engine.models.attention import AttentionMetadata
from engine.models.cpu_linear import QuantizedLinear
from kernels import decoder_ops
from kernels.native_decoder import native_decoder_available, new_native_decoder
from kernels.quantized_gemm import pack_float32_for_kernel

logger = logging.getLogger(__name__)

NATIVE_PASS_ENV = "SPECSERVE_NATIVE_PASS"
# what the pass's profile splits its time into (native_decoder.cpp's enum Stage, in order)
NATIVE_STAGES = ("norms", "q|k|v", "rotary + KV write", "attention", "o-projection",
                 "gate|up + SiLU", "down-projection", "LM head")
# the decoder's linears, as (module path within a layer, the pass's name for it)
_LINEARS = (("self_attn.qkv_proj", "qkv"), ("self_attn.o_proj", "o"),
            ("mlp.gate_up_proj", "gate_up"), ("mlp.down_proj", "down"))
# the MLP activations the pass runs (NativeDecoder.set_activation), by their Hugging Face names
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def native_pass_enabled() -> bool:
    return os.environ.get(NATIVE_PASS_ENV, "1") != "0"


class NativePass:
    """Calls the pass with a step's inputs; built by `build` for a model it can run."""

    def __init__(self, decoder: torch.ScriptObject, has_head: bool) -> None:
        self._decoder = decoder
        self._kv_caches: list[torch.Tensor] | None = None
        # whether the LM head is in the pass (a packed head without bias): then a step's logits
        # come from the same call
        self.has_head = has_head

    @classmethod
    def build(cls, model: torch.nn.Module) -> NativePass | None:
        """The pass for `model` (engine/models/llama.py's LlamaForCausalLM, built), or None with
        the reason logged at debug level when it cannot take the model."""
        if getattr(model, "tp_group", None) is not None:
            logger.debug("native CPU pass not used: tensor parallelism")
            return None
        return cls.for_layers(list(model.layers), model.norm, model.lm_head)

    @classmethod
    def for_layers(cls, layers: list[nn.Module], final_norm: nn.Module | None = None,
                   lm_head: nn.Module | None = None, feature_norm: nn.Module | None = None,
                   norm_before_residual: bool = False) -> NativePass | None:
        """The pass for decoder layers (each with input_layernorm, an nn.Identity where it has
        none, self_attn, post_attention_layernorm and mlp), the final norm (None: the pass returns
        the residual stream) and an LM head it may take; an EAGLE-3 layer reads [embedding,
        feature] under its input norm and `feature_norm` (NativeDecoder.set_feature_input).
        None, with the reason logged at debug level, where the pass cannot run them."""
        reason = _unsupported(layers, final_norm)
        if reason is None:
            decoder = _new_decoder(layers, final_norm)
            if feature_norm is not None:
                decoder.set_feature_input(feature_norm.weight.detach(), norm_before_residual)
            reason = decoder.check_ready() or None
        if reason is not None:
            logger.debug("native CPU pass not used: %s", reason)
            return None
        has_head = isinstance(lm_head, QuantizedLinear) and all(
            bias is None for bias in lm_head.bias_parts)
        if has_head:
            for part in lm_head.parts:
                decoder.add_head_part(part.format_id, part.groups, part.shape[0], part.shape[1])
        return cls(decoder, has_head)

    @staticmethod
    def runs(meta: AttentionMetadata) -> bool:
        """Whether this step's metadata is the CPU attention kernel's (what the pass reads)."""
        return meta.kernel is not None and not meta.kernel.triton

    def set_profiling(self, on: bool) -> None:
        """On: every pass adds its thread 0's seconds per stage to `stage_seconds` (reset now)."""
        self._decoder.set_profiling(on)

    def stage_seconds(self) -> dict[str, float]:
        return dict(zip(NATIVE_STAGES, self._decoder.stage_seconds()))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                 aux_layers: tuple[int, ...], logits_rows: torch.Tensor | None = None,
                 local_rotary: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x: [T, hidden] embedded; cos, sin: [T, head_dim / 2]. Returns the final-norm hidden
        states, the residual stream entering each of `aux_layers`, side by side, and the LM
        head's logits at `logits_rows` ([R] int64; needs `has_head`), else None. local_rotary:
        the sliding layers' (cos, sin) where they have their own (Gemma 3); the sliding layers
        read `meta.windowed`, as LlamaForCausalLM._decode's do."""
        if kv_caches is not self._kv_caches:  # NOTE: a runner keeps one list for its lifetime
            self._decoder.set_kv_caches(list(kv_caches))
            self._kv_caches = kv_caches
        kernel = meta.kernel
        windowed = meta.windowed or meta
        local_cos, local_sin = (None, None) if local_rotary is None else local_rotary
        hidden, aux, logits = self._decoder.forward(
            x, cos, sin, local_cos, local_sin, meta.slot_mapping, kernel.block_tables,
            kernel.seq_lens, kernel.cu_num_query_tokens, meta.tree_mask,
            kernel.sliding_window or 0, windowed.tree_mask, windowed.kernel.sliding_window or 0,
            list(aux_layers), logits_rows)
        return hidden, aux, None if logits_rows is None else logits


def adopt_float32_layers(layers: list[nn.Module]) -> bool:
    """Give float32 CPU decoder layers' linears (a model's, or a draft head's) the kernel's float32
    group layout, so the native pass can run them (before `optimize_for_cpu`, which would give
    them another layout). The outputs stay bit for bit the float32 kernel's. False (nothing
    changed) where the pass could not run anyway; the LM head and any other linear are left
    alone."""
    if not native_pass_enabled() or not native_decoder_available():
        return False
    linears = [(layer, path) for layer in layers for path, _ in _LINEARS]
    if not all(type(layer.get_submodule(path)) is nn.Linear
               and layer.get_submodule(path).weight.dtype == torch.float32
               and layer.get_submodule(path).weight.device.type == "cpu"
               for layer, path in linears):
        return False
    for layer, path in linears:
        linear = layer.get_submodule(path)
        parent, _, child = path.rpartition(".")
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(layer.get_submodule(parent), child,
                QuantizedLinear([pack_float32_for_kernel(linear.weight)], bias))
    return True


def _output_norm(layer: nn.Module, block: str) -> nn.Module | None:
    """Gemma 3's norm of a block's output ("attention" or "mlp"); None where the layer has none (an
    EAGLE-3 head's layer has no such attribute)."""
    return getattr(layer, f"{block}_output_norm", None)


def _unsupported(layers: list[nn.Module], final_norm: nn.Module | None) -> str | None:
    if not native_pass_enabled():
        return f"{NATIVE_PASS_ENV}=0"
    norms = [] if final_norm is None else [final_norm]
    for index, layer in enumerate(layers):
        attention = layer.self_attn
        if attention.fused_ops is not decoder_ops or layer.mlp.fused_ops is not decoder_ops:
            return "the layers do not run specserve's CPU decoder ops"
        if attention.batch_invariant:
            return "batch-invariant kernels"
        if attention.tp_group is not None:
            return "tensor parallelism"
        if layer.mlp.hidden_act not in _ACTIVATIONS:
            return f"layer {index}'s activation {layer.mlp.hidden_act!r}"
        if (attention.q_norm is None) != (attention.k_norm is None):
            return f"layer {index} has a norm of q or of k, not both"
        if (_output_norm(layer, "attention") is None) != (_output_norm(layer, "mlp") is None):
            return f"layer {index} has an output norm on attention or on the MLP, not both"
        for path, _ in _LINEARS:
            if not isinstance(layer.get_submodule(path), QuantizedLinear):
                return f"layer {index}'s {path} is not packed"
        norms += [norm for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                                    attention.q_norm, attention.k_norm,
                                    _output_norm(layer, "attention"), _output_norm(layer, "mlp"))
                  if norm is not None and not isinstance(norm, nn.Identity)]
    if any(norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu"
           for norm in norms):
        return "norms are not float32 on the CPU"
    if len({norm.eps for norm in norms}) != 1:
        return "norms with different epsilons"
    if layers[0].self_attn.head_dim % 8:
        return "head_dim is not a multiple of 8"
    if not native_decoder_available():
        return "the native decoder library is not built"
    return None


def _new_decoder(layers: list[nn.Module], final_norm: nn.Module | None) -> torch.ScriptObject:
    attention, post_norm = layers[0].self_attn, layers[0].post_attention_layernorm
    intermediate = layers[0].mlp.down_proj.parts[0].shape[1]
    decoder = new_native_decoder(
        post_norm.weight.numel(), attention.num_heads, attention.num_kv_heads, attention.head_dim,
        intermediate, post_norm.eps, attention.scale,
        None if final_norm is None else final_norm.weight.detach())
    for index, layer in enumerate(layers):
        input_norm = layer.input_layernorm
        decoder.add_layer(None if isinstance(input_norm, nn.Identity) else input_norm.weight.detach(),
                          layer.post_attention_layernorm.weight.detach())
        attention = layer.self_attn
        if attention.q_norm is not None:
            decoder.set_head_norms(index, attention.q_norm.weight.detach(),
                                   attention.k_norm.weight.detach())
        if _output_norm(layer, "attention") is not None:
            decoder.set_output_norms(index, _output_norm(layer, "attention").weight.detach(),
                                     _output_norm(layer, "mlp").weight.detach())
        decoder.set_activation(index, layer.mlp.hidden_act)
        decoder.set_sliding(index, attention.sliding)
        for path, name in _LINEARS:
            linear = layer.get_submodule(path)
            for part, bias in zip(linear.parts, linear.bias_parts):
                decoder.add_linear_part(index, name, part.format_id, part.groups, part.shape[0],
                                        part.shape[1], bias)
    return decoder
