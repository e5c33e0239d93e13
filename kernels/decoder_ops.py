"""Fused per-layer ops of a float32 Llama decoder on the CPU (`kernels/csrc/decoder_ops.cpp`).

The torch reference of each is the op sequence it replaces in `engine/models/llama.py`; tests compare
them. Callers check `decoder_ops_available()` once and keep the torch ops where it is False.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import load_cpu_library


def decoder_ops_available() -> bool:
    return load_cpu_library("decoder_ops")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.specserve.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass."""
    return torch.ops.specserve.add_rms_norm(x, delta, weight, eps)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_rotated_heads: int,
            head_dim: int) -> None:
    """Rotate-half RoPE in place on the first `num_rotated_heads` heads of each row; cos, sin: [T, D/2]."""
    torch.ops.specserve.rotary_(qkv, cos, sin, num_rotated_heads, head_dim)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] gate then up -> silu(gate) * up, [T, I]."""
    return torch.ops.specserve.silu_and_mul(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] gate then up -> gelu_tanh(gate) * up, [T, I] (Gemma's GeGLU; torch's
    F.gelu(gate, approximate="tanh") * up within ~1 ulp)."""
    return torch.ops.specserve.gelu_tanh_and_mul(gate_up)
