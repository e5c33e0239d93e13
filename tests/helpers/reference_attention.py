"""One causal self-attention block read straight from Hugging Face-named weights, in float64: the
independent reading that tests of published heads compare the engine's math against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_self_attention(x: torch.Tensor, weights: dict[str, torch.Tensor], prefix: str,
                             num_heads: int, num_kv_heads: int,
                             rope_theta: float = 10000.0) -> torch.Tensor:
    """x: [T, in] at positions 0 .. T-1; returns o_proj(attention) [T, hidden]. Weights under
    `prefix` + "self_attn.{q,k,v,o}_proj.weight" (no biases); rotary in float64."""
    T = len(x)
    q = x @ weights[prefix + "self_attn.q_proj.weight"].T
    head_dim = q.shape[-1] // num_heads
    q = q.view(T, num_heads, head_dim)
    k = (x @ weights[prefix + "self_attn.k_proj.weight"].T).view(T, num_kv_heads, head_dim)
    v = (x @ weights[prefix + "self_attn.v_proj.weight"].T).view(T, num_kv_heads, head_dim)
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq
    cos = torch.cat([angles.cos()] * 2, -1)[:, None]
    sin = torch.cat([angles.sin()] * 2, -1)[:, None]

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = (t.repeat_interleave(num_heads // num_kv_heads, dim=1) for t in (k, v))
    attended = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.transpose(0, 1), is_causal=True)
    return attended.transpose(0, 1).reshape(T, -1) @ weights[prefix + "self_attn.o_proj.weight"].T
