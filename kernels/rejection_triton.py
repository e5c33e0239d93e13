"""Rejection sampling for speculative decoding in Triton; same contract as `rejection_reference.py`.

Two kernels, one program per request each: `_accept_kernel` finds the accepted prefix and writes the
output row (greedy requests are then done); `_final_token_kernel` draws a random request's recovered or
bonus token by inverse CDF at the one row of p that emits it, in two passes over the vocabulary: the total
fixed-point mass, then the block holding the draw and the index inside it (tl.cumsum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.rejection_reference import FIXED_POINT_BITS

# Widest vocab chunk one loop iteration handles; tests lower it to cover draws across blocks.
MAX_BLOCK_SIZE = 2048
_FIXED_POINT_SCALE = tl.constexpr(float(2**FIXED_POINT_BITS))
# NOTE: launches pass enable_fp_fusion=False: no fused multiply-adds, so every float op rounds as the
# torch reference's does and the two agree bit for bit on the GPU too.


@triton.jit
def _accept_kernel(
    output_token_ids_ptr,  # [batch, max_spec_len + 1] int64, written in full
    num_accepted_ptr,  # [batch] int64, written
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    cu_num_draft_tokens_ptr,  # [batch] int64
    draft_probs_ptr,  # [num_draft_tokens, vocab_size] fp32 q (unread when not HAS_DRAFT_PROBS)
    target_probs_ptr,  # [num_draft_tokens + batch, vocab_size] fp32 p (unread when not HAS_TARGET_PROBS)
    target_argmax_ptr,  # [num_draft_tokens + batch] int64
    is_greedy_ptr,  # [batch] bool
    acceptance_uniforms_ptr,  # [num_draft_tokens] fp32 or fp64 (unread when not HAS_TARGET_PROBS)
    vocab_size,
    max_spec_len,
    HAS_DRAFT_PROBS: tl.constexpr,
    HAS_TARGET_PROBS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # power of 2 >= max_spec_len + 1
):
    """Program per request: accepted prefix, then argmax p at the next row (a random request's token
    there is overwritten by _final_token_kernel), then -1 padding."""
    request = tl.program_id(0)
    draft_start = tl.load(cu_num_draft_tokens_ptr + request - 1, mask=request > 0, other=0)
    num_drafts = tl.load(cu_num_draft_tokens_ptr + request) - draft_start  # k of this request
    positions = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    is_draft = positions < num_drafts
    tokens = draft_start + positions  # [BLOCK_K] flattened draft indices
    rows = tokens + request  # [BLOCK_K] rows of p
    draft_token_ids = tl.load(draft_token_ids_ptr + tokens, mask=is_draft, other=0)
    argmax_p = tl.load(target_argmax_ptr + rows, mask=positions <= num_drafts, other=0)
    is_accepted = draft_token_ids == argmax_p  # the greedy test
    if HAS_TARGET_PROBS:
        is_greedy = tl.load(is_greedy_ptr + request) != 0
        # NOTE: a limit instead of `vector_mask & scalar_bool`: the interpreter mis-broadcasts the latter
        is_random_draft = positions < tl.where(is_greedy, 0, num_drafts)
        p = tl.load(target_probs_ptr + rows * vocab_size + draft_token_ids, mask=is_random_draft,
                    other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + tokens * vocab_size + draft_token_ids,
                        mask=is_random_draft, other=1.0)
        else:
            q = tl.full([BLOCK_K], 1.0, tl.float32)
        u = tl.load(acceptance_uniforms_ptr + tokens, mask=is_random_draft, other=1.0)
        # NOTE: u * q < p is u < min(1, p / q) without a division, as in the reference
        is_accepted = tl.where(is_greedy, is_accepted, u * q < p)
    # no `break` (the compiler rejects it): the first rejection is a min over positions
    num_accepted = tl.min(tl.where(is_draft & ~is_accepted, positions, num_drafts), axis=0)
    next_token_id = tl.sum(tl.where(positions == num_accepted, argmax_p, 0), axis=0)
    out = tl.where(positions < num_accepted, draft_token_ids,
                   tl.where(positions == num_accepted, next_token_id, -1))
    width = max_spec_len + 1
    tl.store(output_token_ids_ptr + request.to(tl.int64) * width + positions, out,
             mask=positions < width)
    tl.store(num_accepted_ptr + request, num_accepted.to(tl.int64))


@triton.jit
def _fixed_point_weights(
    target_probs_ptr, draft_probs_ptr, row, token, cols, num_cols, num_cols_q, zeroed_token_id,
    vocab_size, HAS_DRAFT_PROBS: tl.constexpr,
):
    """One block of the draw's weights as integers: max(0, p - q) (q read below num_cols_q only), or p
    with zeroed_token_id zeroed for one-hot q; 0 at and past num_cols. Also p itself (the fallback of
    an empty residual). Two [BLOCK_SIZE] int64."""
    p = tl.load(target_probs_ptr + row * vocab_size + cols, mask=cols < num_cols, other=0.0)
    if HAS_DRAFT_PROBS:
        q = tl.load(draft_probs_ptr + token * vocab_size + cols, mask=cols < num_cols_q, other=0.0)
        weights = tl.maximum(p - q, 0.0)
    else:
        weights = tl.where(cols == zeroed_token_id, 0.0, p)
    # NOTE: scaling by a power of 2 is exact, and the conversion truncates, as torch's .to(int64) does
    return (weights * _FIXED_POINT_SCALE).to(tl.int64), (p * _FIXED_POINT_SCALE).to(tl.int64)


@triton.jit
def _final_token_kernel(
    output_token_ids_ptr,  # [batch, max_spec_len + 1] int64, one cell written per random request
    num_accepted_ptr,  # [batch] int64 from _accept_kernel
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    cu_num_draft_tokens_ptr,  # [batch] int64
    draft_probs_ptr,  # [num_draft_tokens, vocab_size] fp32 q (unread when not HAS_DRAFT_PROBS)
    target_probs_ptr,  # [num_draft_tokens + batch, vocab_size] fp32 p
    is_greedy_ptr,  # [batch] bool
    sample_uniforms_ptr,  # [num_draft_tokens + batch] fp32 or fp64
    vocab_size,
    max_spec_len,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program per request: the inverse CDF of its weights at the row after its accepted prefix."""
    request = tl.program_id(0)
    is_random = tl.load(is_greedy_ptr + request) == 0
    if is_random:
        draft_start = tl.load(cu_num_draft_tokens_ptr + request - 1, mask=request > 0, other=0)
        num_drafts = tl.load(cu_num_draft_tokens_ptr + request) - draft_start
        num_accepted = tl.load(num_accepted_ptr + request)
        token = draft_start + num_accepted  # int64: the rejected draft, if any
        row = token + request  # int64: the row of p that emits the token
        is_rejected = num_accepted < num_drafts
        # at the bonus row no draft is zeroed and no q is read: the weights are p itself
        zeroed_token_id = tl.load(draft_token_ids_ptr + token, mask=is_rejected, other=-1)
        num_cols_q = tl.where(is_rejected, vocab_size, 0)
        # ---- pass 1: the total mass of the weights, and of p (the fallback of an empty residual) ----
        residual_total = tl.zeros([BLOCK_SIZE], tl.int64)
        p_total = tl.zeros([BLOCK_SIZE], tl.int64)
        for block_start in range(0, vocab_size, BLOCK_SIZE):
            cols = block_start + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
            residual, p = _fixed_point_weights(target_probs_ptr, draft_probs_ptr, row, token, cols,
                                               vocab_size, num_cols_q, zeroed_token_id, vocab_size,
                                               HAS_DRAFT_PROBS)
            residual_total += residual
            p_total += p
        residual_mass = tl.sum(residual_total, axis=0)
        # NOTE: with no residual mass left (p <= q up to rounding) the draw falls back to p
        is_residual = residual_mass > 0
        total_mass = tl.where(is_residual, residual_mass, tl.sum(p_total, axis=0))
        num_cols_q = tl.where(is_residual, num_cols_q, 0)
        zeroed_token_id = tl.where(is_residual, zeroed_token_id, -1)
        u = tl.load(sample_uniforms_ptr + row).to(tl.float64)
        # floor(u * total), kept below the total (see the reference)
        threshold = tl.minimum((u * total_mass.to(tl.float64)).to(tl.int64), total_mass - 1)
        # ---- pass 2: the first token whose CDF passes the threshold ----
        # The CDF is exact and non-decreasing, so that token has weight > 0. Blocks after the one
        # holding it load nothing (limit 0); no `break`, as above.
        carry = tl.zeros([], tl.int64)
        chosen = tl.zeros([], tl.int32) + vocab_size
        for block_start in range(0, vocab_size, BLOCK_SIZE):
            cols = block_start + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
            limit = tl.where(chosen == vocab_size, vocab_size, 0)
            fixed, _ = _fixed_point_weights(target_probs_ptr, draft_probs_ptr, row, token, cols,
                                            limit, tl.minimum(num_cols_q, limit), zeroed_token_id,
                                            vocab_size, HAS_DRAFT_PROBS)
            cdf = carry + tl.cumsum(fixed, axis=0)  # [BLOCK_SIZE] exact: integer sums
            first_hit = tl.min(tl.where(cdf > threshold, cols, vocab_size), axis=0)
            chosen = tl.minimum(chosen, first_hit)
            carry += tl.sum(fixed, axis=0)
        width = max_spec_len + 1
        # NOTE: a row of p without any mass (the caller zeroes rows whose logits left no probability)
        # keeps what _accept_kernel wrote: target_argmax, the argmax of the row's processed logits
        tl.store(output_token_ids_ptr + request.to(tl.int64) * width + num_accepted,
                 chosen.to(tl.int64), mask=total_mass > 0)


def rejection_sample(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: Tensor,  # [batch] int64
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab_size] float32, or None: one-hot drafts
    target_probs: Tensor | None,  # [num_draft_tokens + batch, vocab_size] float32, None: all greedy
    target_argmax: Tensor,  # [num_draft_tokens + batch] int64
    is_greedy: Tensor,  # [batch] bool
    acceptance_uniforms: Tensor | None,  # [num_draft_tokens] float32 or float64
    sample_uniforms: Tensor | None,  # [num_draft_tokens + batch] float32 or float64
    max_spec_len: int,
) -> Tensor:  # [batch, max_spec_len + 1] int64
    """Triton twin of `kernels.rejection_reference.rejection_sample` (see there for the contract)."""
    has_target_probs = target_probs is not None
    has_draft_probs = has_target_probs and draft_probs is not None
    checks = [(draft_token_ids, 1), (cu_num_draft_tokens, 1), (target_argmax, 1), (is_greedy, 1)]
    if has_target_probs:
        checks += [(target_probs, 2), (acceptance_uniforms, 1), (sample_uniforms, 1)]
        assert target_probs.dtype == torch.float32
    if has_draft_probs:
        checks.append((draft_probs, 2))
        assert draft_probs.dtype == torch.float32
    for tensor, ndim in checks:
        assert tensor.ndim == ndim and tensor.is_contiguous()
    assert draft_token_ids.dtype == cu_num_draft_tokens.dtype == target_argmax.dtype == torch.int64
    assert is_greedy.dtype == torch.bool
    batch = cu_num_draft_tokens.numel()
    num_draft_tokens = draft_token_ids.numel()
    assert target_argmax.shape[0] == num_draft_tokens + batch
    vocab_size = target_probs.shape[1] if has_target_probs else 1
    output_token_ids = torch.empty((batch, max_spec_len + 1), dtype=torch.int64,
                                   device=target_argmax.device)  # [batch, max_spec_len + 1]
    if batch == 0:
        return output_token_ids
    num_accepted = torch.empty(batch, dtype=torch.int64, device=target_argmax.device)  # [batch]
    # pointers a variant never reads still need a tensor: target_argmax stands in
    target_or_any = target_probs if has_target_probs else target_argmax
    draft_or_any = draft_probs if has_draft_probs else target_or_any
    _accept_kernel[(batch,)](
        output_token_ids, num_accepted, draft_token_ids, cu_num_draft_tokens, draft_or_any,
        target_or_any, target_argmax, is_greedy,
        acceptance_uniforms if has_target_probs else target_argmax, vocab_size, max_spec_len,
        HAS_DRAFT_PROBS=has_draft_probs, HAS_TARGET_PROBS=has_target_probs,
        BLOCK_K=triton.next_power_of_2(max_spec_len + 1),
        enable_fp_fusion=False,
    )
    if has_target_probs:
        _final_token_kernel[(batch,)](
            output_token_ids, num_accepted, draft_token_ids, cu_num_draft_tokens, draft_or_any,
            target_probs, is_greedy, sample_uniforms, vocab_size, max_spec_len,
            HAS_DRAFT_PROBS=has_draft_probs,
            BLOCK_SIZE=min(triton.next_power_of_2(vocab_size), MAX_BLOCK_SIZE),
            enable_fp_fusion=False,
        )
    return output_token_ids
