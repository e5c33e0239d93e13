"""Verifying trees of drafts in Triton; same contract and numerics as `tree_rejection.py`.

One program per request walks its tree in one pass over its drafts (the reference's docstring says
why one pass is enough): a tried draft costs a few scalar loads; a random request's rejected draft
costs one pass over the vocabulary in tiles that writes the residual d' into a scratch row; the
recovered or bonus token is the chain kernel's two-pass inverse CDF (total mass, then the tile
holding the draw).

    scratch [batch, 2, vocab_size] fp32, per request:  buffer 0 | buffer 1
    current = -1: the residual is p at the node's row (nothing copied)
    a rejection reads the current residual, writes the OTHER buffer, and switches to it only if the
    result has mass; so the old residual survives an empty one, and no tile is read after another
    thread overwrote it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.rejection_reference import FIXED_POINT_BITS
from kernels.rejection_triton import _FIXED_POINT_SCALE
from kernels.tree_rejection import empty_tree_outputs

# Widest vocab tile one loop iteration handles; tests lower it to cover draws across tiles.
MAX_BLOCK_SIZE = 2048
_INVERSE_FIXED_POINT_SCALE = tl.constexpr(2.0**-FIXED_POINT_BITS)
# NOTE: launches pass enable_fp_fusion=False: d - s * q must not become a fused multiply-add, so
# every float op rounds as the torch reference's does.


@triton.jit
def _residual(target_probs_ptr, scratch_ptr, row, request, current, cols, num_cols, vocab_size):
    """The current residual's weights at cols (a tile or one token): p's row `row` while
    current < 0, else the request's scratch buffer `current`; 0 at and past num_cols."""
    # NOTE: limits, not `vector_mask & scalar_bool`, which the interpreter mis-broadcasts
    from_p = cols < tl.where(current < 0, num_cols, 0)
    from_scratch = cols < tl.where(current < 0, 0, num_cols)
    p = tl.load(target_probs_ptr + row * vocab_size + cols, mask=from_p, other=0.0)
    d = tl.load(scratch_ptr + (request * 2 + current) * vocab_size + cols, mask=from_scratch,
                other=0.0)
    return tl.where(from_p, p, d)


@triton.jit
def _tree_kernel(
    output_token_ids_ptr,  # [batch, max_spec_len + 1] int64, filled with -1; path + final written
    accepted_drafts_ptr,  # [batch, max_spec_len] int64, filled with -1; the accepted path written
    scratch_ptr,  # [batch, 2, vocab_size] fp32 residuals (unread when not HAS_TARGET_PROBS)
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    draft_parents_ptr,  # [num_draft_tokens] int64, -1 = the root
    cu_num_draft_tokens_ptr,  # [batch] int64
    draft_probs_ptr,  # [num_draft_tokens, vocab_size] fp32 q (unread when not HAS_DRAFT_PROBS)
    target_probs_ptr,  # [num_draft_tokens + batch, vocab_size] fp32 p (when HAS_TARGET_PROBS)
    target_argmax_ptr,  # [num_draft_tokens + batch] int64
    is_greedy_ptr,  # [batch] bool
    acceptance_uniforms_ptr,  # [num_draft_tokens] fp32 or fp64 (unread when not HAS_TARGET_PROBS)
    sample_uniforms_ptr,  # [num_draft_tokens + batch] fp32 or fp64 (likewise)
    vocab_size,
    max_spec_len,
    HAS_DRAFT_PROBS: tl.constexpr,
    HAS_TARGET_PROBS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program per request: its accepted path, then its recovered or bonus token."""
    request = tl.program_id(0).to(tl.int64)
    draft_start = tl.load(cu_num_draft_tokens_ptr + request - 1, mask=request > 0, other=0)
    num_drafts = (tl.load(cu_num_draft_tokens_ptr + request) - draft_start).to(tl.int32)
    root_row = draft_start + request  # int64: the row of p after the root
    is_random = tl.load(is_greedy_ptr + request) == 0
    width = max_spec_len + 1
    node = tl.full([], -1, tl.int32)  # the last accepted draft, -1 = the root
    num_accepted = tl.zeros([], tl.int32)
    # the residual: d = current's weights, d / scale normalised, mass = d's fixed-point total
    current = tl.full([], -1, tl.int32)  # -1: p at the node's row; 0 or 1: a scratch buffer
    scale = tl.full([], 1.0, tl.float32)
    mass = tl.zeros([], tl.int64)  # known once current >= 0

    # ---- the walk: draft j is tried iff its parent is the current node ---------------------------
    for j in range(0, num_drafts):
        draft = draft_start + j  # int64
        if tl.load(draft_parents_ptr + draft) == node:
            token = tl.load(draft_token_ids_ptr + draft)
            row = root_row + node + 1  # the node's row of p
            is_accepted = token == tl.load(target_argmax_ptr + row)  # the greedy test
            if HAS_TARGET_PROBS:
                if is_random:
                    if HAS_DRAFT_PROBS:
                        q_of_token = tl.load(draft_probs_ptr + draft * vocab_size + token)
                    else:
                        q_of_token = tl.full([], 1.0, tl.float32)
                    d_of_token = _residual(target_probs_ptr, scratch_ptr, row, request, current,
                                           token, vocab_size, vocab_size)
                    u = tl.load(acceptance_uniforms_ptr + draft)
                    # NOTE: (u * q) * s < d(x): the chain's u * q < p when s = 1, rounded alike
                    is_accepted = (u * q_of_token) * scale < d_of_token
                    if not is_accepted:
                        # ---- d' = max(0, d - s q), or d without the token, into the other buffer
                        other = tl.where(current == 0, 1, 0)
                        left_mass = tl.zeros([BLOCK_SIZE], tl.int64)
                        for block_start in range(0, vocab_size, BLOCK_SIZE):
                            cols = block_start + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
                            d = _residual(target_probs_ptr, scratch_ptr, row, request, current,
                                          cols, vocab_size, vocab_size)
                            if HAS_DRAFT_PROBS:
                                q = tl.load(draft_probs_ptr + draft * vocab_size + cols,
                                            mask=cols < vocab_size, other=0.0)
                                left = tl.maximum(d - scale * q, 0.0)
                            else:
                                left = tl.where(cols == token, 0.0, d)
                            tl.store(scratch_ptr + (request * 2 + other) * vocab_size + cols, left,
                                     mask=cols < vocab_size)
                            left_mass += (left * _FIXED_POINT_SCALE).to(tl.int64)
                        # NOTE: later reads of a token may come from another thread than its write
                        tl.debug_barrier()
                        total = tl.sum(left_mass, axis=0)
                        has_mass = total > 0
                        current = tl.where(has_mass, other, current)
                        scale = tl.where(has_mass,
                                         (total.to(tl.float64) * _INVERSE_FIXED_POINT_SCALE)
                                         .to(tl.float32), scale)
                        mass = tl.where(has_mass, total, mass)
            if is_accepted:
                tl.store(output_token_ids_ptr + request * width + num_accepted, token)
                # NOTE: j + a typed zero: the interpreter's j is a Python int
                tl.store(accepted_drafts_ptr + request * max_spec_len + num_accepted,
                         j + tl.zeros([], tl.int64))
                num_accepted += 1
                node = j + tl.zeros([], tl.int32)
                current = -1
                scale = 1.0

    # ---- the recovered or bonus token: inverse CDF of the residual at the node's row -------------
    row = root_row + node + 1
    next_token_id = tl.load(target_argmax_ptr + row)  # greedy's token, and the no-mass fallback
    if HAS_TARGET_PROBS:
        if is_random:
            if current < 0:
                p_mass = tl.zeros([BLOCK_SIZE], tl.int64)
                for block_start in range(0, vocab_size, BLOCK_SIZE):
                    cols = block_start + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
                    p = _residual(target_probs_ptr, scratch_ptr, row, request, current, cols,
                                  vocab_size, vocab_size)
                    p_mass += (p * _FIXED_POINT_SCALE).to(tl.int64)
                mass = tl.sum(p_mass, axis=0)
            u = tl.load(sample_uniforms_ptr + row).to(tl.float64)
            # floor(u * total), kept below the total (see the chain reference)
            threshold = tl.minimum((u * mass.to(tl.float64)).to(tl.int64), mass - 1)
            # The CDF is exact and non-decreasing, so the first token past the threshold has weight
            # > 0. Tiles after the one holding it load nothing (limit 0); no `break`.
            carry = tl.zeros([], tl.int64)
            chosen = tl.zeros([], tl.int32) + vocab_size
            for block_start in range(0, vocab_size, BLOCK_SIZE):
                cols = block_start + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
                limit = tl.where(chosen == vocab_size, vocab_size, 0)
                d = _residual(target_probs_ptr, scratch_ptr, row, request, current, cols, limit,
                              vocab_size)
                fixed = (d * _FIXED_POINT_SCALE).to(tl.int64)  # [BLOCK_SIZE]
                cdf = carry + tl.cumsum(fixed, axis=0)  # [BLOCK_SIZE] exact: integer sums
                chosen = tl.minimum(chosen, tl.min(tl.where(cdf > threshold, cols, vocab_size),
                                                   axis=0))
                carry += tl.sum(fixed, axis=0)
            # NOTE: a row without any mass (logits that left no probability: p comes in as zeros)
            # keeps target_argmax's token, the argmax of the row's processed logits
            next_token_id = tl.where(mass > 0, chosen.to(tl.int64), next_token_id)
    tl.store(output_token_ids_ptr + request * width + num_accepted, next_token_id)


def tree_rejection_sample(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64
    draft_parents: Tensor,  # [num_draft_tokens] int64, parent draft within the request, -1 = root
    cu_num_draft_tokens: Tensor,  # [batch] int64
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab_size] float32, or None: one-hot drafts
    target_probs: Tensor | None,  # [num_draft_tokens + batch, vocab_size] float32, None: all greedy
    target_argmax: Tensor,  # [num_draft_tokens + batch] int64
    is_greedy: Tensor,  # [batch] bool
    acceptance_uniforms: Tensor | None,  # [num_draft_tokens] float32 or float64
    sample_uniforms: Tensor | None,  # [num_draft_tokens + batch] float32 or float64
    max_spec_len: int,
) -> tuple[Tensor, Tensor]:  # [batch, max_spec_len + 1], [batch, max_spec_len] int64
    """Triton twin of `kernels.tree_rejection.tree_rejection_sample_reference` (the contract is
    there): output_token_ids and accepted_drafts."""
    has_target_probs = target_probs is not None
    has_draft_probs = has_target_probs and draft_probs is not None
    checks = [(draft_token_ids, 1), (draft_parents, 1), (cu_num_draft_tokens, 1),
              (target_argmax, 1), (is_greedy, 1)]
    if has_target_probs:
        checks += [(target_probs, 2), (acceptance_uniforms, 1), (sample_uniforms, 1)]
        assert target_probs.dtype == torch.float32
    if has_draft_probs:
        checks.append((draft_probs, 2))
        assert draft_probs.dtype == torch.float32
    for tensor, ndim in checks:
        assert tensor.ndim == ndim and tensor.is_contiguous()
    assert (draft_token_ids.dtype == draft_parents.dtype == cu_num_draft_tokens.dtype
            == target_argmax.dtype == torch.int64)
    assert is_greedy.dtype == torch.bool
    batch = cu_num_draft_tokens.numel()
    num_draft_tokens = draft_token_ids.numel()
    assert draft_parents.shape[0] == num_draft_tokens
    assert target_argmax.shape[0] == num_draft_tokens + batch
    device = target_argmax.device
    output_token_ids, accepted_drafts = empty_tree_outputs(batch, max_spec_len, device)
    if batch == 0:
        return output_token_ids, accepted_drafts
    vocab_size = target_probs.shape[1] if has_target_probs else 1
    # pointers a variant never reads still need a tensor: target_argmax stands in
    target_or_any = target_probs if has_target_probs else target_argmax
    scratch = (torch.empty((batch, 2, vocab_size), dtype=torch.float32, device=device)
               if has_target_probs else target_argmax)  # [batch, 2, vocab_size]
    _tree_kernel[(batch,)](
        output_token_ids, accepted_drafts, scratch, draft_token_ids, draft_parents,
        cu_num_draft_tokens, draft_probs if has_draft_probs else target_or_any, target_or_any,
        target_argmax, is_greedy, acceptance_uniforms if has_target_probs else target_argmax,
        sample_uniforms if has_target_probs else target_argmax, vocab_size, max_spec_len,
        HAS_DRAFT_PROBS=has_draft_probs, HAS_TARGET_PROBS=has_target_probs,
        BLOCK_SIZE=min(triton.next_power_of_2(vocab_size), MAX_BLOCK_SIZE),
        enable_fp_fusion=False,
    )
    return output_token_ids, accepted_drafts
