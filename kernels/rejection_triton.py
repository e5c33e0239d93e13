"""Rejection sampling for speculative decoding in Triton; same contract as `rejection_reference.py`.

Two kernels: `_recovered_token_kernel` computes, for every draft position in parallel, the token that
would be emitted if the draft were rejected there (argmax p for greedy requests); `_accept_kernel` then
walks each request's drafts, finds the first rejection and writes the output row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Widest vocab chunk one loop iteration handles; tests lower it to cover the cross-block argmax.
MAX_BLOCK_SIZE = 2048
# NOTE: launches pass enable_fp_fusion=False: no fused multiply-adds, so every float op rounds as the
# torch reference's does and the two agree bit for bit on the GPU too.


@triton.jit
def _recovered_token_kernel(
    recovered_token_ids_ptr,  # [num_draft_tokens] int64, written
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    cu_num_draft_tokens_ptr,  # [batch] int64
    draft_probs_ptr,  # [num_draft_tokens, vocab_size] fp32 q (unread when not HAS_DRAFT_PROBS)
    target_probs_ptr,  # [num_draft_tokens + batch, vocab_size] fp32 p
    is_greedy_ptr,  # [batch] bool
    recovery_noise_ptr,  # [num_draft_tokens, vocab_size] fp32 Exp(1)
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program (request, position): argmax over the vocab of max(0, p - q) / noise, or of p if greedy."""
    request = tl.program_id(0)
    position = tl.program_id(1)
    draft_start = tl.load(cu_num_draft_tokens_ptr + request - 1, mask=request > 0, other=0)
    draft_end = tl.load(cu_num_draft_tokens_ptr + request)
    if position < draft_end - draft_start:
        token = draft_start + position  # int64: flattened draft index
        target_row = token + request
        draft_token_id = tl.load(draft_token_ids_ptr + token)
        is_greedy = tl.load(is_greedy_ptr + request) != 0
        # Greedy rows read no q or noise (q = 0, noise = 1) and zero no token, so their score is p.
        # NOTE: limits instead of `vector_mask & scalar_bool`: the interpreter mis-broadcasts the latter
        num_cols_random = tl.where(is_greedy, 0, vocab_size)
        zeroed_token_id = tl.where(is_greedy, -1, draft_token_id)
        # Running argmax per lane; strict > keeps the earlier block on ties, and the final min over
        # lanes holding the max gives the lowest token id, as torch.argmax does.
        best_score = tl.full([BLOCK_SIZE], float("-inf"), tl.float32)
        best_token = tl.zeros([BLOCK_SIZE], tl.int32)
        for block_start in range(0, vocab_size, BLOCK_SIZE):
            cols = block_start + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
            in_vocab = cols < vocab_size
            p = tl.load(target_probs_ptr + target_row * vocab_size + cols, mask=in_vocab, other=0.0)
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + token * vocab_size + cols,
                            mask=cols < num_cols_random, other=0.0)
                residual = tl.maximum(p - q, 0.0)
            else:
                residual = tl.where(cols == zeroed_token_id, 0.0, p)
            noise = tl.load(recovery_noise_ptr + token * vocab_size + cols,
                            mask=cols < num_cols_random, other=1.0)
            # NOTE: IEEE-rounded division, so the GPU result is bit-identical to torch's r / noise
            score = tl.math.div_rn(residual, noise)
            score = tl.where(in_vocab, score, float("-inf"))
            is_better = score > best_score
            best_score = tl.where(is_better, score, best_score)
            best_token = tl.where(is_better, cols, best_token)
        max_score = tl.max(best_score, axis=0)
        recovered = tl.min(tl.where(best_score == max_score, best_token, vocab_size), axis=0)
        tl.store(recovered_token_ids_ptr + token, recovered.to(tl.int64))


@triton.jit
def _accept_kernel(
    output_token_ids_ptr,  # [batch, max_spec_len + 1] int64, written in full
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    cu_num_draft_tokens_ptr,  # [batch] int64
    draft_probs_ptr,  # [num_draft_tokens, vocab_size] fp32 q (unread when not HAS_DRAFT_PROBS)
    target_probs_ptr,  # [num_draft_tokens + batch, vocab_size] fp32 p
    bonus_token_ids_ptr,  # [batch] int64
    is_greedy_ptr,  # [batch] bool
    uniform_samples_ptr,  # [num_draft_tokens] fp32 or fp64
    recovered_token_ids_ptr,  # [num_draft_tokens] int64 from _recovered_token_kernel
    vocab_size,
    max_spec_len,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # power of 2 >= max_spec_len + 1
):
    """Program per request: accepted prefix, then the recovered or bonus token, then -1 padding."""
    request = tl.program_id(0)
    draft_start = tl.load(cu_num_draft_tokens_ptr + request - 1, mask=request > 0, other=0)
    num_drafts = tl.load(cu_num_draft_tokens_ptr + request) - draft_start  # k of this request
    positions = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    is_draft = positions < num_drafts
    tokens = draft_start + positions  # [BLOCK_K] flattened draft indices
    draft_token_ids = tl.load(draft_token_ids_ptr + tokens, mask=is_draft, other=0)
    recovered_token_ids = tl.load(recovered_token_ids_ptr + tokens, mask=is_draft, other=0)
    is_greedy = tl.load(is_greedy_ptr + request) != 0
    is_random_draft = positions < tl.where(is_greedy, 0, num_drafts)  # see _recovered_token_kernel
    p = tl.load(target_probs_ptr + (tokens + request) * vocab_size + draft_token_ids,
                mask=is_random_draft, other=0.0)
    if HAS_DRAFT_PROBS:
        q = tl.load(draft_probs_ptr + tokens * vocab_size + draft_token_ids,
                    mask=is_random_draft, other=1.0)
    else:
        q = tl.full([BLOCK_K], 1.0, tl.float32)
    u = tl.load(uniform_samples_ptr + tokens, mask=is_random_draft, other=1.0)
    # NOTE: u * q < p is u < min(1, p / q) without a division, as in the reference
    is_accepted = tl.where(is_greedy, draft_token_ids == recovered_token_ids, u * q < p)
    # no `break` (the compiler rejects it): the first rejection is a min over positions
    num_accepted = tl.min(tl.where(is_draft & ~is_accepted, positions, num_drafts), axis=0)
    bonus_token_id = tl.load(bonus_token_ids_ptr + request)
    is_rejected = num_accepted < num_drafts
    recovered = tl.sum(tl.where(positions == num_accepted, recovered_token_ids, 0), axis=0)
    next_token_id = tl.where(is_rejected, recovered, bonus_token_id)
    out = tl.where(positions < num_accepted, draft_token_ids,
                   tl.where(positions == num_accepted, next_token_id, -1))
    width = max_spec_len + 1
    tl.store(output_token_ids_ptr + request.to(tl.int64) * width + positions, out,
             mask=positions < width)


def rejection_sample(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: Tensor,  # [batch] int64
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab_size] float32, or None: one-hot drafts
    target_probs: Tensor,  # [num_draft_tokens + batch, vocab_size] float32
    bonus_token_ids: Tensor,  # [batch] int64
    is_greedy: Tensor,  # [batch] bool
    uniform_samples: Tensor,  # [num_draft_tokens] float32 or float64
    recovery_noise: Tensor,  # [num_draft_tokens, vocab_size] float32
    max_spec_len: int,
) -> Tensor:  # [batch, max_spec_len + 1] int64
    """Triton twin of `kernels.rejection_reference.rejection_sample` (see there for the contract)."""
    for tensor, ndim in [(draft_token_ids, 1), (cu_num_draft_tokens, 1), (target_probs, 2),
                         (bonus_token_ids, 1), (is_greedy, 1), (uniform_samples, 1),
                         (recovery_noise, 2)] + ([] if draft_probs is None else [(draft_probs, 2)]):
        assert tensor.ndim == ndim and tensor.is_contiguous()
    assert target_probs.dtype == recovery_noise.dtype == torch.float32
    assert draft_probs is None or draft_probs.dtype == torch.float32
    assert draft_token_ids.dtype == cu_num_draft_tokens.dtype == bonus_token_ids.dtype == torch.int64
    assert is_greedy.dtype == torch.bool
    batch = cu_num_draft_tokens.numel()
    num_draft_tokens = draft_token_ids.numel()
    vocab_size = target_probs.shape[1]
    assert target_probs.shape[0] == num_draft_tokens + batch
    output_token_ids = torch.empty((batch, max_spec_len + 1), dtype=torch.int64,
                                   device=target_probs.device)  # [batch, max_spec_len + 1]
    if batch == 0:
        return output_token_ids
    has_draft_probs = draft_probs is not None
    recovered_token_ids = torch.zeros_like(draft_token_ids)  # [num_draft_tokens]
    if num_draft_tokens > 0 and max_spec_len > 0:
        _recovered_token_kernel[(batch, max_spec_len)](
            recovered_token_ids, draft_token_ids, cu_num_draft_tokens,
            draft_probs if has_draft_probs else target_probs, target_probs, is_greedy,
            recovery_noise, vocab_size,
            HAS_DRAFT_PROBS=has_draft_probs,
            BLOCK_SIZE=min(triton.next_power_of_2(vocab_size), MAX_BLOCK_SIZE),
            enable_fp_fusion=False,
        )
    _accept_kernel[(batch,)](
        output_token_ids, draft_token_ids, cu_num_draft_tokens,
        draft_probs if has_draft_probs else target_probs, target_probs, bonus_token_ids, is_greedy,
        uniform_samples, recovered_token_ids, vocab_size, max_spec_len,
        HAS_DRAFT_PROBS=has_draft_probs,
        BLOCK_K=triton.next_power_of_2(max_spec_len + 1),
        enable_fp_fusion=False,
    )
    return output_token_ids
