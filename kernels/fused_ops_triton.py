"""A Llama decoder layer's small ops in Triton: RMSNorm (+ residual add), rotary, SiLU-and-multiply.

A GPU decode step is launch-bound: each of these replaces 2-14 torch kernels (and their trips
through memory) with one launch that reads its inputs once. Same signatures as
`kernels/decoder_ops.py`; the torch ops in `engine/models/llama.py` are the reference, rounding
order included (see each kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Widest chunk of one row a SiLU-and-multiply program handles, and of one half of a rotary tile.
SILU_BLOCK_SIZE = 1024
ROTARY_TILE_SIZE = 1024
ELEMENTWISE_NUM_WARPS = 4  # rotary and SiLU: 1024-wide blocks, 8 columns a thread
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# NOTE: launches pass enable_fp_fusion=False: no fused multiply-adds, so rotary's products and sums
# round as the reference's separate torch ops do, and the GPU agrees with it bit for bit.


@triton.jit
def _normalize_row(x, weight, n_cols, eps):
    """RMSNorm of one row held in float32 (0 past n_cols), as `RMSNorm.forward`: normalise in
    float32, round to the input dtype, then multiply by the weight (one more rounding). Returns
    float32."""
    # NOTE: IEEE division and square root (the GPU's `/` and sqrt are approximate): what is left of
    # the difference from torch is the order of the sum of squares and torch's own ~1-ulp rsqrt
    mean_square = tl.div_rn(tl.sum(x * x, axis=0), n_cols.to(tl.float32))
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    normed = (x * inv_rms).to(weight.dtype).to(tl.float32)
    return weight.to(tl.float32) * normed


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, n_cols], contiguous, written
    x_ptr,  # [T, n_cols] rows of stride x_row_stride
    weight_ptr,  # [n_cols]
    x_row_stride,
    n_cols,
    eps,
    BLOCK_SIZE: tl.constexpr,  # power of 2 >= n_cols
):
    """Program per row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
    is_col = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=is_col, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=is_col, other=0.0)
    out = _normalize_row(x, weight, n_cols, eps)
    tl.store(out_ptr + row * n_cols + cols, out.to(weight.dtype), mask=is_col)


@triton.jit
def _add_rms_norm_kernel(
    sum_ptr,  # [T, n_cols], contiguous, written: x + delta
    out_ptr,  # [T, n_cols], contiguous, written: rms_norm(x + delta)
    x_ptr,  # [T, n_cols] rows of stride x_row_stride
    delta_ptr,  # [T, n_cols] rows of stride delta_row_stride
    weight_ptr,  # [n_cols]
    x_row_stride,
    delta_row_stride,
    n_cols,
    eps,
    BLOCK_SIZE: tl.constexpr,  # power of 2 >= n_cols
):
    """Program per row: the residual add, rounded to the input dtype as torch's `x + delta` is, then
    the norm of that rounded sum."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
    is_col = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=is_col, other=0.0)
    delta = tl.load(delta_ptr + row * delta_row_stride + cols, mask=is_col, other=0.0)
    weight = tl.load(weight_ptr + cols, mask=is_col, other=0.0)
    total = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + row * n_cols + cols, total, mask=is_col)
    out = _normalize_row(total.to(tl.float32), weight, n_cols, eps)
    tl.store(out_ptr + row * n_cols + cols, out.to(x.dtype), mask=is_col)


@triton.jit
def _rotary_kernel(
    qkv_ptr,  # [T, width] rows of stride qkv_row_stride; the first num_rotated_heads heads rotated
    cos_ptr,  # [T, head_dim / 2] rows of stride cos_row_stride, qkv's dtype
    sin_ptr,  # [T, head_dim / 2] rows of stride sin_row_stride, qkv's dtype
    qkv_row_stride,
    cos_row_stride,
    sin_row_stride,
    num_rotated_heads,
    head_dim,
    BLOCK_HEADS: tl.constexpr,  # heads per program, a power of 2
    BLOCK_HALF: tl.constexpr,  # power of 2 >= head_dim / 2
):
    """Program per (row, group of BLOCK_HEADS heads): rotate-half RoPE in place, as `apply_rotary`:
    x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product and each sum rounded to the dtype."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BLOCK_HEADS]
    half = head_dim // 2
    cols = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    is_col = cols < half
    cos = tl.load(cos_ptr + row * cos_row_stride + cols, mask=is_col, other=0.0)[None, :]
    sin = tl.load(sin_ptr + row * sin_row_stride + cols, mask=is_col, other=0.0)[None, :]
    x1_ptrs = qkv_ptr + row * qkv_row_stride + heads[:, None] * head_dim + cols[None, :]
    mask = (heads < num_rotated_heads)[:, None] & is_col[None, :]  # [BLOCK_HEADS, BLOCK_HALF]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0)  # [BLOCK_HEADS, BLOCK_HALF]
    x2 = tl.load(x1_ptrs + half, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    # NOTE: as torch's 16-bit ops do, each op computes in float32 and rounds to the dtype (in
    # float32 the casts are no-ops); the GPU compiler may fold such a pair into one bf16/f16 op,
    # which rounds the same
    x1_cos, x2_sin = (x1 * cos).to(dtype).to(tl.float32), (x2 * sin).to(dtype).to(tl.float32)
    x2_cos, x1_sin = (x2 * cos).to(dtype).to(tl.float32), (x1 * sin).to(dtype).to(tl.float32)
    tl.store(x1_ptrs, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(x1_ptrs + half, (x2_cos + x1_sin).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, width], contiguous, written
    gate_up_ptr,  # [T, 2 * width] rows of stride gate_up_row_stride: gate then up
    gate_up_row_stride,
    width,
    BLOCK_SIZE: tl.constexpr,  # power of 2
):
    """Program per (row, block of columns): silu(gate) = gate / (1 + exp(-gate)) rounded to the
    dtype (as `F.silu`), then times up, rounded again (as torch's multiply)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
    is_col = cols < width
    gate_ptrs = gate_up_ptr + row * gate_up_row_stride + cols
    gate = tl.load(gate_ptrs, mask=is_col, other=0.0)
    up = tl.load(gate_ptrs + width, mask=is_col, other=0.0)
    gate_f = gate.to(tl.float32)
    # NOTE: the GPU's tl.exp is ex2.approx of a rounded gate * log2(e): relative error about
    # |gate| * 6e-8, far below a 16-bit ulp; the division is IEEE, as torch's is
    silu = tl.div_rn(gate_f, 1.0 + tl.exp(-gate_f)).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * width + cols, out.to(gate.dtype), mask=is_col)


def _check_rows(tensor: Tensor, name: str) -> None:
    """2-D with contiguous rows (any row stride) in a supported dtype."""
    if tensor.ndim != 2 or tensor.stride(1) != 1 or tensor.dtype not in _DTYPES:
        raise ValueError(f"{name} must be 2-D with contiguous rows in float32, float16 or "
                         f"bfloat16, got shape {tuple(tensor.shape)}, strides {tensor.stride()}, "
                         f"{tensor.dtype}")


def _check_weight(x: Tensor, weight: Tensor) -> None:
    if weight.shape != (x.shape[1],) or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(f"weight must be a contiguous [{x.shape[1]}] {x.dtype} tensor, got "
                         f"{tuple(weight.shape)} {weight.dtype}")


def norm_launch_config(hidden_size: int) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) of both norm kernels: the whole row in one block, 8 columns (16 bytes
    of a 16-bit row, one vector load) per thread up to 16 warps."""
    block_size = triton.next_power_of_2(hidden_size)
    return block_size, min(16, max(1, block_size // 256))


def rotary_launch_config(num_rotated_heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_HEADS, BLOCK_HALF): as many heads a program as fit ROTARY_TILE_SIZE columns a half."""
    block_half = triton.next_power_of_2(head_dim // 2)
    block_heads = min(triton.next_power_of_2(num_rotated_heads),
                      max(1, ROTARY_TILE_SIZE // block_half))
    return block_heads, block_half


def silu_block_size(width: int) -> int:
    return min(SILU_BLOCK_SIZE, triton.next_power_of_2(width))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, H], weight [H] -> weight * normalise(x), [T, H]; same as `RMSNorm.forward`."""
    _check_rows(x, "x")
    _check_weight(x, weight)
    num_tokens, hidden_size = x.shape
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)  # [T, H]
    if num_tokens == 0:
        return out
    block_size, num_warps = norm_launch_config(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        out, x, weight, x.stride(0), hidden_size, eps, BLOCK_SIZE=block_size, num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return out


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass: x, delta [T, H] read once, two [T, H]
    written."""
    _check_rows(x, "x")
    _check_rows(delta, "delta")
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    _check_weight(x, weight)
    num_tokens, hidden_size = x.shape
    total = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)  # [T, H]
    out = torch.empty_like(total)  # [T, H]
    if num_tokens == 0:
        return total, out
    block_size, num_warps = norm_launch_config(hidden_size)
    _add_rms_norm_kernel[(num_tokens,)](
        total, out, x, delta, weight, x.stride(0), delta.stride(0), hidden_size, eps,
        BLOCK_SIZE=block_size, num_warps=num_warps, enable_fp_fusion=False,
    )
    return total, out


def rotary_(qkv: Tensor, cos: Tensor, sin: Tensor, num_rotated_heads: int, head_dim: int) -> None:
    """Rotate-half RoPE in place on the first `num_rotated_heads` heads of each row of qkv
    ([T, heads * head_dim], q's heads then k's; v's and anything past them untouched);
    cos, sin: [T, head_dim / 2] in qkv's dtype. Bit-identical to `apply_rotary`."""
    _check_rows(qkv, "qkv")
    _check_rows(cos, "cos")
    _check_rows(sin, "sin")
    num_tokens, half = qkv.shape[0], head_dim // 2
    if (head_dim % 2 or num_rotated_heads * head_dim > qkv.shape[1]
            or cos.shape != (num_tokens, half) or sin.shape != (num_tokens, half)
            or not cos.dtype == sin.dtype == qkv.dtype):
        raise ValueError(f"rotary_: shapes do not match: qkv {tuple(qkv.shape)} {qkv.dtype}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}, "
                         f"{num_rotated_heads} heads of {head_dim}")
    if num_tokens == 0 or num_rotated_heads == 0:
        return
    block_heads, block_half = rotary_launch_config(num_rotated_heads, head_dim)
    grid = (num_tokens, triton.cdiv(num_rotated_heads, block_heads))
    _rotary_kernel[grid](
        qkv, cos, sin, qkv.stride(0), cos.stride(0), sin.stride(0), num_rotated_heads, head_dim,
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, num_warps=ELEMENTWISE_NUM_WARPS,
        enable_fp_fusion=False,
    )


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """[T, 2I] gate then up -> silu(gate) * up, [T, I]."""
    _check_rows(gate_up, "gate_up")
    num_tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.shape[1] != 2 * width:
        raise ValueError(f"gate_up must have an even width, got {gate_up.shape[1]}")
    out = torch.empty((num_tokens, width), dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    if num_tokens == 0 or width == 0:
        return out
    block_size = silu_block_size(width)
    grid = (num_tokens, triton.cdiv(width, block_size))
    _silu_and_mul_kernel[grid](
        out, gate_up, gate_up.stride(0), width, BLOCK_SIZE=block_size,
        num_warps=ELEMENTWISE_NUM_WARPS, enable_fp_fusion=False,
    )
    return out


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    """[T, 2I] gate then up -> gelu_tanh(gate) * up, [T, I] (Gemma's GeGLU), with torch's ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
