"""Fused per-layer CPU ops against the torch ops they replace in engine/models/llama.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.llama import RMSNorm, apply_rotary
from kernels import decoder_ops

pytestmark = pytest.mark.skipif(not decoder_ops.decoder_ops_available(),
                                reason="no C++ compiler to build them")


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps)
    norm.weight.data = weight
    return norm(x)


def test_rms_norm_matches_the_reference_and_rows_are_independent():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(13, 576, generator=generator) * 3
    weight = torch.randn(576, generator=generator)
    got = decoder_ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, reference_norm(x, weight, 1e-5), rtol=2e-6, atol=2e-6)
    assert torch.equal(decoder_ops.rms_norm(x[4:5], weight, 1e-5), got[4:5])


def test_add_rms_norm_returns_the_sum_and_its_norm_without_touching_inputs():
    generator = torch.Generator().manual_seed(1)
    x, delta = torch.randn(2, 5, 64, generator=generator)
    weight = torch.randn(64, generator=generator)
    before = x.clone()
    total, normed = decoder_ops.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(x, before)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, reference_norm(x + delta, weight, 1e-6), rtol=2e-6,
                               atol=2e-6)


def test_rotary_in_place_is_bit_identical_to_apply_rotary():
    generator = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_dim, tokens = 9, 3, 64, 7
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6
    cos, sin = angles.cos(), angles.sin()
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    want_q = apply_rotary(q.reshape(tokens, num_heads, head_dim), cos[:, None], sin[:, None])
    want_k = apply_rotary(k.reshape(tokens, num_kv_heads, head_dim), cos[:, None], sin[:, None])
    want_v = v.clone()
    decoder_ops.rotary_(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
    assert torch.equal(q.reshape(tokens, num_heads, head_dim), want_q)
    assert torch.equal(k.reshape(tokens, num_kv_heads, head_dim), want_k)
    assert torch.equal(v, want_v)


def test_silu_and_mul_matches_the_reference():
    gate_up = torch.randn(6, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    got = decoder_ops.silu_and_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=2e-6)
    assert torch.equal(decoder_ops.silu_and_mul(gate_up[2:3]), got[2:3])


def test_gelu_tanh_and_mul_matches_the_reference():
    """Gemma's GeGLU, held as close to torch's F.gelu(approximate="tanh") as SiLU is to F.silu,
    over the whole range: the tails (exp over- and underflowing) included."""
    gate_up = torch.randn(6, 2 * 1536, generator=torch.Generator().manual_seed(4)) * 4
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 60.0, -60.0, 1e20, -1e20])
    gate, up = gate_up.chunk(2, dim=-1)
    got = decoder_ops.gelu_tanh_and_mul(gate_up)
    torch.testing.assert_close(got, F.gelu(gate, approximate="tanh") * up, rtol=2e-6, atol=2e-6)
    assert torch.equal(decoder_ops.gelu_tanh_and_mul(gate_up[2:3]), got[2:3])
    assert torch.equal(decoder_ops.gelu_tanh_and_mul(gate_up[:, None].expand(6, 2, 3072)[:, 0]),
                       got)  # rows with a stride


def test_bad_inputs_are_refused():
    with pytest.raises(RuntimeError, match="float32"):
        decoder_ops.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        decoder_ops.rotary_(torch.randn(2, 64), torch.ones(2, 5), torch.ones(2, 5), 2, 32)
    with pytest.raises(RuntimeError, match="odd width"):
        decoder_ops.gelu_tanh_and_mul(torch.randn(2, 7))
