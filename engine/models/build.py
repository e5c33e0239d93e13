"""From a loaded checkpoint to a ready module, and its paged KV cache: shared by target and draft."""

from __future__ import annotations

import logging

import torch

from engine.models.arch import DecoderArch
from engine.models.cpu_linear import optimize_linears_for_cpu, packed_weights_available
from engine.models.llama import LlamaForCausalLM, use_fused_ops
from engine.models.loader import Checkpoint
from engine.models.native_pass import NativePass, adopt_float32_layers
from engine.models.packed_model import (
    expand_packed_weights,
    has_packed_weights,
    install_packed_weights,
    packed_formats,
)
from kernels import decoder_ops

logger = logging.getLogger(__name__)


def build_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
                gpu_kernels: str = "torch", arch: DecoderArch | None = None,
                batch_invariant: bool = False) -> tuple[LlamaForCausalLM, str]:
    """The module in eval mode on `device`, and the name of the kernels it uses (engine/config.py's
    GPU_KERNELS for gpu_kernels). `arch`: the shape the weights have, when not the checkpoint's
    (one tensor-parallel rank's shard, engine/runner/sharding.py). batch_invariant (with gpu_kernels
    "triton"): engine/models/batch_invariant.py."""
    arch = arch or DecoderArch.from_hf_config(checkpoint.hf_config)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    weights = checkpoint.weights
    packed = has_packed_weights(weights)
    if packed and not (device.type == "cpu" and dtype == torch.float32
                       and packed_weights_available()):
        logger.warning("packed weights expanded to %s: the packed kernel runs float32 on a CPU "
                       "with AVX2 and F16C", dtype)
        weights, packed = expand_packed_weights(weights, dtype), False
    if packed:
        weights = install_packed_weights(model, weights)
    model = materialize(model, device, dtype)
    # NOTE: rotary frequencies stay float32 whatever the weights' dtype, as in the reference
    model.rotary.inv_freq = torch.tensor(arch.rope_inv_freq, dtype=torch.float32, device=device)
    if model.local_rotary is not None:
        model.local_rotary.inv_freq = torch.tensor(arch.local_rope_inv_freq, dtype=torch.float32,
                                                   device=device)
    model.load_weights(weights)
    if arch.tie_word_embeddings and isinstance(model.embed_tokens, torch.nn.Embedding):
        model.lm_head.weight = model.embed_tokens.weight
    if gpu_kernels == "triton":
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"gpu_kernels triton takes float32, float16 or bfloat16, not {dtype}")
        from kernels import fused_ops_triton
        use_fused_ops(model, fused_ops_triton)
        if batch_invariant:  # NOTE: before the CPU's linears (tests) would replace nn.Linear
            from engine.models.batch_invariant import use_batch_invariant
            use_batch_invariant(model)
            return model.eval(), "batch-invariant triton matmuls, attention and fused ops"
        backend = optimize_for_cpu(model, dtype, device, fused_ops=False)
        return model.eval(), backend + " + triton attention and fused ops"
    if device.type == "cpu" and dtype == torch.float32 and not packed:
        adopt_float32_layers(list(model.layers))
    backend = optimize_for_cpu(model, dtype, device)
    if device.type == "cpu":
        model.native_pass = NativePass.build(model)
        if model.native_pass is not None:
            backend += " + native pass"
    return model.eval(), backend


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Give every parameter and buffer still on the meta device uninitialized storage on `device`
    (floating parameters in `dtype`), as `model.to_empty(device).to(dtype)` would. NOTE: to_empty's
    empty_like on meta tensors runs torch's Python reference ops, whose first use imports sympy:
    0.8 s of every start; torch.empty with the shape does not."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                kind = dtype if param.is_floating_point() else param.dtype
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=kind, device=device),
                    requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return model


def optimize_for_cpu(model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                     fused_ops: bool = True) -> str:
    """On the CPU, the fastest linears and (float32) specserve's fused per-layer ops, for a model
    or a draft head built from its blocks, used for inference only; returns what it chose."""
    if device.type != "cpu":
        return "torch"
    backend = optimize_linears_for_cpu(model)
    formats = packed_formats(model)
    if formats:
        backend = f"packed {'/'.join(formats)}" + (
            "" if backend == "none" else f" + {backend} for float32 linears")
    if fused_ops and dtype == torch.float32 and decoder_ops.decoder_ops_available():
        use_fused_ops(model, decoder_ops)
        backend += " + fused-ops"
    return backend


def allocate_kv_cache(arch: DecoderArch, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """Per layer: [2, num_kv_heads, num_blocks, block_size, head_dim] (engine/models/attention.py),
    zeros."""
    shape = (2, arch.num_kv_heads, num_blocks, block_size, arch.head_dim)
    if device.type == "cpu":
        return lazily_zeroed(shape, arch.num_layers, dtype)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]


def lazily_zeroed(shape: tuple[int, ...], count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` zero tensors of `shape` in one anonymous memory map: the kernel hands out its pages
    already zeroed when first touched, so a 1 GB cache costs nothing at start-up (torch.zeros
    writes every byte: 0.5-0.8 s on these machines) and only the blocks in use become resident.
    Page-aligned, as the CPU kernels' vector loads want."""
    import math
    import mmap

    itemsize = torch.empty((), dtype=dtype).element_size()
    per_tensor = math.prod(shape) * itemsize
    region = mmap.mmap(-1, max(1, per_tensor * count))
    flat = torch.frombuffer(region, dtype=dtype, count=math.prod(shape) * count)
    return [part.view(shape) for part in flat.chunk(count)] if count else []
