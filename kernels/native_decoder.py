"""The CPU decoder forward as one native call (`kernels/csrc/native_decoder.cpp` says why and how).

The pass runs the packed matmul and paged attention kernels of their own libraries through their
entry points, so it needs those two libraries loaded as well as its own.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import load_cpu_library

# the libraries the pass calls into, then its own
NATIVE_DECODER_LIBRARIES = ("quantized_gemm", "paged_attention", "native_decoder")


def native_decoder_available() -> bool:
    """True once all three libraries are built and loaded, on a CPU the packed kernel runs on."""
    return (all(load_cpu_library(name) for name in NATIVE_DECODER_LIBRARIES)
            and torch.ops.specserve.quantized_gemm_supported())


def new_native_decoder(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       intermediate_size: int, rms_norm_eps: float, attention_scale: float,
                       final_norm: torch.Tensor | None):
    """An empty pass (torch.classes.specserve.NativeDecoder) for a model of these shapes (no
    final norm: it returns the residual stream): add its layers (with each layer's family
    switches: set_head_norms, set_output_norms, set_activation, set_sliding), their linears'
    parts and the KV caches, then call `forward`."""
    ops = torch.ops.specserve
    return torch.classes.specserve.NativeDecoder(
        ops.quantized_gemm_entry_points(), ops.paged_attention_entry_points(), hidden_size,
        num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps, attention_scale,
        final_norm)
