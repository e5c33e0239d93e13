"""A packed or float32 model's forward on the CPU as one native call, when its shapes allow it.

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

from engine.models.cpu_linear import QuantizedLinear
from engine.runner.attention import AttentionMetadata
from kernels import decoder_ops
from kernels.native_decoder import native_decoder_available, new_native_decoder
from kernels.quantized_gemm import pack_float32_for_kernel

logger = logging.getLogger(__name__)

NATIVE_PASS_ENV = "SPECSERVE_NATIVE_PASS"
# what the pass's profile splits its time into (native_decoder.cpp's enum Stage, in order)
NATIVE_STAGES = ("norms", "q|k|v", "rotary + KV write", "attention", "o-projection",
                 "gate|up + SiLU", "down-projection")
# the decoder's linears, as (module path within a layer, the pass's name for it)
_LINEARS = (("self_attn.qkv_proj", "qkv"), ("self_attn.o_proj", "o"),
            ("mlp.gate_up_proj", "gate_up"), ("mlp.down_proj", "down"))


def native_pass_enabled() -> bool:
    return os.environ.get(NATIVE_PASS_ENV, "1") != "0"


class NativePass:
    """Calls the pass with a step's inputs; built by `build` for a model it can run."""

    def __init__(self, decoder: torch.ScriptObject) -> None:
        self._decoder = decoder
        self._kv_caches: list[torch.Tensor] | None = None

    @classmethod
    def build(cls, model: torch.nn.Module) -> NativePass | None:
        """The pass for `model` (engine/models/llama.py's LlamaForCausalLM, built), or None with
        the reason logged at debug level when it cannot take the model."""
        reason = _unsupported(model)
        if reason is None:
            decoder = _new_decoder(model)
            reason = decoder.check_ready() or None
        if reason is not None:
            logger.debug("native CPU pass not used: %s", reason)
            return None
        return cls(decoder)

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
                 aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] embedded; cos, sin: [T, head_dim / 2]. Returns the final-norm hidden
        states and the residual stream entering each of `aux_layers`, side by side."""
        if kv_caches is not self._kv_caches:  # NOTE: a runner keeps one list for its lifetime
            self._decoder.set_kv_caches(list(kv_caches))
            self._kv_caches = kv_caches
        kernel = meta.kernel
        return self._decoder.forward(x, cos, sin, meta.slot_mapping, kernel.block_tables,
                                     kernel.seq_lens, kernel.cu_num_query_tokens, meta.tree_mask,
                                     kernel.sliding_window or 0, list(aux_layers))


def adopt_float32_layers(model: torch.nn.Module) -> bool:
    """Give a float32 CPU model's decoder linears the kernel's float32 group layout, so the native
    pass can run them (before `optimize_for_cpu`, which would give them another layout). The
    outputs stay bit for bit the float32 kernel's. False (nothing changed) where the pass could
    not run anyway; the LM head and any other linear are left alone."""
    if not native_pass_enabled() or not native_decoder_available():
        return False
    linears = [(layer, path) for layer in model.layers for path, _ in _LINEARS]
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


def _unsupported(model: torch.nn.Module) -> str | None:
    if not native_pass_enabled():
        return f"{NATIVE_PASS_ENV}=0"
    if getattr(model, "tp_group", None) is not None:
        return "tensor parallelism"
    for index, layer in enumerate(model.layers):
        if layer.fused_ops is not decoder_ops:
            return "the model does not run specserve's CPU decoder ops"
        if layer.self_attn.batch_invariant:
            return "batch-invariant kernels"
        for path, _ in _LINEARS:
            if not isinstance(layer.get_submodule(path), QuantizedLinear):
                return f"layer {index}'s {path} is not packed"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu":
                return "norms are not float32 on the CPU"
    if model.layers[0].self_attn.head_dim % 8:
        return "head_dim is not a multiple of 8"
    if not native_decoder_available():
        return "the native decoder library is not built"
    return None


def _new_decoder(model: torch.nn.Module) -> torch.ScriptObject:
    arch = model.arch
    attention = model.layers[0].self_attn
    decoder = new_native_decoder(arch.hidden_size, arch.num_heads, arch.num_kv_heads,
                                 arch.head_dim, arch.intermediate_size, model.norm.eps,
                                 attention.scale, model.norm.weight.detach())
    for index, layer in enumerate(model.layers):
        decoder.add_layer(layer.input_layernorm.weight.detach(),
                          layer.post_attention_layernorm.weight.detach())
        for path, name in _LINEARS:
            linear = layer.get_submodule(path)
            for part, bias in zip(linear.parts, linear.bias_parts):
                decoder.add_linear_part(index, name, part.format_id, part.groups, part.shape[0],
                                        part.shape[1], bias)
    return decoder
