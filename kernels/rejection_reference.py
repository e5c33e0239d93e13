"""Rejection sampling for speculative decoding, in torch: the executable specification.

Vocabulary (these names are used the same way in code, metrics and docs):

- k (`num_speculative_tokens`): how many draft tokens one request proposes in one step. Requests in a
  batch may have different k, including 0 (a request that is not speculating this step: plain decoding
  is verification with k = 0).
- draft tokens x_1..x_k: the proposer's guesses, drawn from its draft distributions q_1..q_k. A proposer
  without a distribution (n-gram, suffix) counts as q_j = one-hot(x_j).
- target distributions p_1..p_{k+1}: the target model's probabilities at each draft position, plus one more
  row (the bonus position) after the last draft. The target forward computes all k + 1 rows at once.
- accepted tokens: the longest prefix of drafts that pass the test u_j < min(1, p_j(x_j) / q_j(x_j)), with
  u_j ~ U[0, 1); for a greedy request, x_j is accepted iff x_j == argmax p_j.
- recovered token: emitted at the first rejected position j instead of x_j, drawn from
  norm(max(0, p_j - q_j)) (greedy: argmax p_j). Acceptance plus recovery make the token at j follow p_j
  exactly, whatever q_j is: this is why speculation is lossless.
- bonus token: drawn from p_{k+1} (greedy: argmax p_{k+1}) and emitted when all k drafts were accepted.
- acceptance rate α = accepted draft tokens / proposed draft tokens.
- block efficiency τ = tokens emitted per target forward for one request = accepted + 1, so 1 <= τ <= k + 1
  (it counts the recovered or bonus token); "mean acceptance length" is the same number.

Output layout, one row per request, width max_spec_len + 1, padded with PLACEHOLDER_TOKEN_ID (-1):

    k = 3, all accepted         [x1, x2, x3, bonus]
    k = 3, x2 rejected          [x1, recovered_2, -1, -1]
    k = 0                       [bonus, -1, -1, -1]

Temperature, top-k and top-p have already been applied by the caller, the same way to p and to q (a draft
token outside the truncated p is then simply rejected). All randomness comes in as arguments: k acceptance
uniforms per request, and one uniform per row of p for the inverse-CDF draw of the token emitted at that
row if it is the recovered or bonus one (2k + 1 uniforms per request). So the Triton kernel in
`rejection_triton.py` is checked against this function exactly, given the same random numbers. (The
engine keys a seeded request's uniforms by seed and output position, engine/sample/keyed_random.py,
and decides a seeded request with one-hot drafts as a greedy one whose target_argmax is the token the
inverse CDF gives at each row: this function needs no random path of its own for either.)

p and q are finite and >= 0 (NaN has no fixed-point value): a row of p whose logits left no probability
(all -inf, or NaN / +inf after temperature) comes in as zeros, and the token it emits is then
target_argmax there, the argmax of the row's processed logits, which the caller passes for every row.

The inverse CDF works on probabilities turned into integers with FIXED_POINT_BITS fractional bits: integer
sums are exact in any order, so this cumsum and Triton's blocked scan see the same CDF. A weight below
2^-FIXED_POINT_BITS counts as zero (at most vocab_size * 2^-42 of mass, under 2.4e-7 for 2^20 tokens), and a
token whose weight is zero is never drawn, whatever the rounding at the CDF's edges.
"""

from __future__ import annotations

import torch
from torch import Tensor

PLACEHOLDER_TOKEN_ID = -1
FIXED_POINT_BITS = 42
# NOTE: 2^20 weights of at most 2^42 each: every CDF fits in int64
MAX_VOCAB_SIZE = 2**20


def rejection_sample(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64, all requests' drafts, request after request
    cu_num_draft_tokens: Tensor,  # [batch] int64, request i owns drafts [cu[i-1], cu[i])
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab_size] float32 q, or None: one-hot drafts
    target_probs: Tensor | None,  # [num_draft_tokens + batch, vocab_size] float32 p, k_i + 1 rows per
    # request; None when every request is greedy (no row of p is read for a greedy request)
    target_argmax: Tensor,  # [num_draft_tokens + batch] int64, each row's argmax (greedy's token; the
    # token of a random row of p without mass)
    is_greedy: Tensor,  # [batch] bool
    acceptance_uniforms: Tensor | None,  # [num_draft_tokens] float32 or float64 in [0, 1)
    sample_uniforms: Tensor | None,  # [num_draft_tokens + batch] float32 or float64 in [0, 1), per row
    max_spec_len: int,  # the largest k in the batch (or more)
) -> Tensor:  # [batch, max_spec_len + 1] int64: accepted drafts, then recovered or bonus, then -1
    """Accept each request's longest valid draft prefix and append its recovered or bonus token.

    The token after the accepted prefix of a random request is the inverse CDF, at that row's sample
    uniform u, of its weights w: max(0, p - q) at a rejected position (p with p[x] zeroed for one-hot q;
    p itself where that leaves no mass, i.e. p <= q up to rounding), p at the bonus position: the first
    token v with cdf[v] > min(floor(u * total), total - 1). A greedy request reads neither p, q nor any
    uniform: target_argmax decides everything. A random request reads target_argmax only at a row of p
    without any mass (all zeros: the caller's stand-in for logits that left no probability), where a
    draft is never accepted (u * q < 0 fails) and the emitted token is target_argmax.
    """
    _validate(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax,
              is_greedy, acceptance_uniforms, sample_uniforms, max_spec_len)
    device = target_argmax.device
    batch = cu_num_draft_tokens.numel()
    num_draft_tokens = draft_token_ids.numel()
    width = max_spec_len + 1
    output_token_ids = torch.full((batch, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                                  device=device)  # [batch, width]
    if batch == 0:
        return output_token_ids

    if num_draft_tokens == 0:
        # NOTE: plain decoding (k = 0 everywhere): nothing to accept, each request emits its bonus
        num_drafts = draft_start = num_accepted = cu_num_draft_tokens  # [batch] zeros
    else:
        output_token_ids, num_accepted, num_drafts, draft_start = _accept_prefix(
            draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax,
            is_greedy, acceptance_uniforms, output_token_ids)

    # ---- the recovered or bonus token, at the row of p right after the accepted prefix -------------
    final_row = draft_start + torch.arange(batch, device=device) + num_accepted  # [batch]
    next_token_ids = target_argmax[final_row]  # [batch] greedy's token, and the no-mass fallback
    random = None if target_probs is None else (~is_greedy).nonzero().squeeze(1)  # [num_random]
    if random is not None and random.numel() > 0:
        rows = final_row[random]  # [num_random]
        fixed = to_fixed_point(target_probs[rows])  # [num_random, vocab_size] p
        rejected = (num_accepted[random] < num_drafts[random]).nonzero().squeeze(1)  # into `random`
        if rejected.numel() > 0:
            rejected_token = draft_start[random[rejected]] + num_accepted[random[rejected]]
            residual = to_fixed_point(recovery_weights(
                target_probs[rows[rejected]],
                None if draft_probs is None else draft_probs[rejected_token],
                draft_token_ids[rejected_token]))  # [num_rejected, vocab_size]
            has_mass = residual.sum(dim=-1, keepdim=True) > 0  # [num_rejected, 1]
            fixed[rejected] = torch.where(has_mass, residual, fixed[rejected])
        next_token_ids[random] = inverse_cdf(fixed, sample_uniforms[rows], next_token_ids[random])
    output_token_ids.scatter_(1, num_accepted[:, None], next_token_ids[:, None])
    return output_token_ids


def _accept_prefix(
    draft_token_ids: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor | None,
    target_argmax: Tensor,
    is_greedy: Tensor,
    acceptance_uniforms: Tensor | None,
    output_token_ids: Tensor,  # [batch, width] all PLACEHOLDER_TOKEN_ID
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The accepted drafts written into the output; [batch] num_accepted, k and first draft index."""
    device = output_token_ids.device
    batch, width = output_token_ids.shape
    num_draft_tokens = draft_token_ids.numel()
    # ---- where each draft token lives -------------------------------------------------------------
    cu = cu_num_draft_tokens
    num_drafts = torch.diff(cu, prepend=cu.new_zeros(1))  # [batch] k_i
    draft_start = cu - num_drafts  # [batch] first draft index of each request
    token_index = torch.arange(num_draft_tokens, device=device)  # [num_draft_tokens]
    request_of_token = torch.repeat_interleave(torch.arange(batch, device=device), num_drafts)
    position_of_token = token_index - draft_start[request_of_token]  # [num_draft_tokens] j in 0..k-1
    # NOTE: request i's rows of p start at draft_start[i] + i (each earlier request has one extra row)
    target_row_of_token = token_index + request_of_token  # [num_draft_tokens]

    # ---- the acceptance test ----------------------------------------------------------------------
    is_accepted = draft_token_ids == target_argmax[target_row_of_token]  # [num_draft_tokens] greedy
    if target_probs is not None:
        p_of_draft = target_probs[target_row_of_token, draft_token_ids]  # [num_draft_tokens]
        if draft_probs is None:
            q_of_draft = torch.ones_like(p_of_draft)
        else:
            q_of_draft = draft_probs[token_index, draft_token_ids]  # [num_draft_tokens]
        # NOTE: u * q < p is u < min(1, p / q) without a division, so both implementations round the
        # same way; q = 0 accepts iff p > 0, and p = 0 never accepts (not even with u = 0).
        is_random_accepted = acceptance_uniforms * q_of_draft < p_of_draft  # [num_draft_tokens]
        is_accepted = torch.where(is_greedy[request_of_token], is_accepted, is_random_accepted)

    # ---- accepted prefix per request --------------------------------------------------------------
    # Drafts laid out as a [batch, width] grid; cells past k_i count as rejections, so the prefix
    # product stops at k_i at the latest.
    accepted_grid = torch.zeros((batch, width), dtype=torch.int64, device=device)
    accepted_grid[request_of_token, position_of_token] = is_accepted.long()
    num_accepted = accepted_grid.cumprod(dim=1).sum(dim=1)  # [batch]
    draft_grid = torch.full_like(output_token_ids, PLACEHOLDER_TOKEN_ID)  # [batch, width]
    draft_grid[request_of_token, position_of_token] = draft_token_ids
    columns = torch.arange(width, device=device)  # [width]
    is_accepted_cell = columns[None, :] < num_accepted[:, None]  # [batch, width]
    output_token_ids = torch.where(is_accepted_cell, draft_grid, output_token_ids)

    return output_token_ids, num_accepted, num_drafts, draft_start


def recovery_weights(
    target_probs: Tensor,  # [rows, vocab_size] p at the rejected positions
    draft_probs: Tensor | None,  # [rows, vocab_size] q there, or None for one-hot drafts
    draft_token_ids: Tensor,  # [rows] int64 the rejected drafts
) -> Tensor:  # [rows, vocab_size] float32
    """The unnormalised residual max(0, p - q) a recovered token is drawn from; p with the draft's
    entry zeroed for one-hot q (no one-hot tensor is built)."""
    if draft_probs is None:
        return target_probs.scatter(1, draft_token_ids[:, None], 0.0)
    return (target_probs - draft_probs).clamp_min(0.0)


def to_fixed_point(weights: Tensor) -> Tensor:
    """[..., vocab_size] float32 >= 0 -> int64 with FIXED_POINT_BITS fractional bits, truncated (the
    scaling by a power of 2 is exact)."""
    return (weights * 2.0**FIXED_POINT_BITS).to(torch.int64)


def inverse_cdf(
    fixed: Tensor,  # [rows, vocab_size] int64 >= 0, unnormalised fixed-point weights
    uniforms: Tensor,  # [rows] float32 or float64 in [0, 1)
    fallback_token_ids: Tensor,  # [rows] int64, the answer for a row with no weight at all
) -> Tensor:  # [rows] int64
    """One draw per row from norm(weights) at its uniform (module docstring): the first token whose
    CDF passes floor(u * total)."""
    cdf = fixed.cumsum(dim=-1)  # [rows, vocab_size] exact integer sums, so non-decreasing
    total = cdf[:, -1:]  # [rows, 1]
    # NOTE: the threshold stays below the total (a guard: u = 1, out of contract, would pass every
    # entry), so some entry lies above it; the first one belongs to a token with weight > 0, since
    # the CDF is exact and non-decreasing.
    threshold = torch.minimum((uniforms[:, None].double() * total.double()).to(torch.int64), total - 1)
    token_ids = torch.searchsorted(cdf, threshold, right=True)[:, 0]  # [rows]
    return torch.where(total[:, 0] > 0, token_ids, fallback_token_ids)


def _validate(
    draft_token_ids: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor | None,
    target_argmax: Tensor,
    is_greedy: Tensor,
    acceptance_uniforms: Tensor | None,
    sample_uniforms: Tensor | None,
    max_spec_len: int,
) -> None:
    """Fail with a ValueError naming the argument, before a bad shape turns into a wrong token."""
    if not isinstance(max_spec_len, int) or max_spec_len < 0:
        raise ValueError(f"max_spec_len must be an int >= 0, got {max_spec_len!r}")
    if target_probs is not None and target_probs.ndim != 2:
        raise ValueError(f"target_probs must be [num_draft_tokens + batch, vocab_size], "
                         f"got shape {tuple(target_probs.shape)}")
    num_draft_tokens = draft_token_ids.numel()
    batch = cu_num_draft_tokens.numel()
    num_rows = num_draft_tokens + batch
    f32, i64, uniform = (torch.float32,), (torch.int64,), (torch.float32, torch.float64)
    expected = [
        ("draft_token_ids", draft_token_ids, (num_draft_tokens,), i64),
        ("cu_num_draft_tokens", cu_num_draft_tokens, (batch,), i64),
        ("target_argmax", target_argmax, (num_rows,), i64),
        ("is_greedy", is_greedy, (batch,), (torch.bool,)),
    ]
    if target_probs is not None:
        vocab_size = target_probs.shape[1]
        if vocab_size > MAX_VOCAB_SIZE:
            raise ValueError(f"vocab_size {vocab_size} exceeds {MAX_VOCAB_SIZE}: the fixed-point CDF "
                             "would overflow")
        if acceptance_uniforms is None or sample_uniforms is None:
            raise ValueError("acceptance_uniforms and sample_uniforms are needed with target_probs")
        expected += [
            ("target_probs", target_probs, (num_rows, vocab_size), f32),
            ("acceptance_uniforms", acceptance_uniforms, (num_draft_tokens,), uniform),
            ("sample_uniforms", sample_uniforms, (num_rows,), uniform),
        ]
        if draft_probs is not None:
            expected.append(("draft_probs", draft_probs, (num_draft_tokens, vocab_size), f32))
    elif not bool(is_greedy.all()):
        raise ValueError("target_probs may be None only when every request is greedy")
    for name, tensor, shape, dtypes in expected:
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if tensor.dtype not in dtypes:
            raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if tensor.device != target_argmax.device:
            raise ValueError(f"{name} is on {tensor.device}, target_argmax on {target_argmax.device}")
    cu = cu_num_draft_tokens.tolist()
    counts = [end - start for start, end in zip([0] + cu, cu)]
    if any(k < 0 for k in counts):
        raise ValueError(f"cu_num_draft_tokens must be non-decreasing, got {counts}")
    if sum(counts) != num_draft_tokens:
        raise ValueError(f"cu_num_draft_tokens must end at num_draft_tokens={num_draft_tokens}, "
                         f"got {cu}")
    if counts and max(counts) > max_spec_len:
        raise ValueError(f"a request has k={max(counts)} drafts, more than max_spec_len={max_spec_len}")
