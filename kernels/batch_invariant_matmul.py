"""A matmul whose every output row is the same bits whatever else is in the batch.

cuBLAS picks its kernel (tile shape, split-K, the order of the K reduction) from the matrix sizes,
so in bfloat16 a decode row (M = 1), the same row among 1 + k verification rows, and the same row in
a batch of 24 are rounded differently, and greedy decoding with speculation drifts from decoding
without it (measured on an H200, docs/perf.md). Here one kernel configuration serves every M:

    y[m, n] = sum over k-tiles t = 0, 1, 2, ... of  x[m, tile t] . w[n, tile t]    (float32)

Each output element is reduced over K in the same tiles, in the same order, by the same instruction,
and no program ever splits K or mixes rows, so a row's result depends on that row and the weights
alone. The tile shape is fixed (no autotuning by M): a decode row wastes most of its 64-row tile, but
a decode step is bound by reading the weights, which every row shares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# fixed for every M: changing any of these changes every row's rounding (one tile in K, one MMA shape)
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4


# NOTE: M is not specialised (Triton would compile M == 1 and M % 16 == 0 apart): one binary for
# every batch, so nothing about a row's arithmetic can follow the batch's size
@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    out_ptr,  # [M, N], x's dtype
    x_ptr,  # [M, K]
    weight_ptr,  # [N, K]
    bias_ptr,  # [N] (only read when HAS_BIAS)
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # NOTE: the N tiles vary fastest, so programs running at once share one M tile of x
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    row_valid, col_valid = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = weight_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_valid = (k + depth) < K
        x = tl.load(x_rows + (k + depth)[None, :], mask=row_valid[:, None] & k_valid[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_cols + (k + depth)[:, None], mask=k_valid[:, None] & col_valid[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE_DOT:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with batch-invariant rows: x [..., K], weight [N, K] -> [..., N]."""
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but the weight is {weight.dtype}")
    if weight.stride(-1) != 1:
        raise ValueError("the weight needs a contiguous last (K) dimension")
    leading, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))
        _invariant_matmul_kernel[grid](
            out, x2, weight, weight if bias is None else bias, m, n, k,
            x2.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, IEEE_DOT=x.dtype == torch.float32,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return out.view(*leading, n)
