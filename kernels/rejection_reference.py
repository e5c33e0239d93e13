"""Rejection sampling for speculative decoding, in torch: the executable specification.

Vocabulary (these names are used the same way in code, metrics and docs):

- k (`num_speculative_tokens`): how many draft tokens one request proposes in one step. Requests in a
  batch may have different k, including 0 (a request that is not speculating this step).
- draft tokens x_1..x_k: the proposer's guesses, drawn from its draft distributions q_1..q_k. A proposer
  without a distribution (n-gram, suffix) counts as q_j = one-hot(x_j).
- target distributions p_1..p_{k+1}: the target model's probabilities at each draft position, plus one more
  row (the bonus position) after the last draft. The target forward computes all k + 1 rows at once.
- accepted tokens: the longest prefix of drafts that pass the test u_j < min(1, p_j(x_j) / q_j(x_j)), with
  u_j ~ U[0, 1); for a greedy request, x_j is accepted iff x_j == argmax p_j.
- recovered token: emitted at the first rejected position j instead of x_j, drawn from
  norm(max(0, p_j - q_j)) (greedy: argmax p_j). Acceptance plus recovery make the token at j follow p_j
  exactly, whatever q_j is: this is why speculation is lossless.
- bonus token: drawn from p_{k+1} and emitted when all k drafts were accepted.
- acceptance rate α = accepted draft tokens / proposed draft tokens.
- block efficiency τ = tokens emitted per target forward for one request = accepted + 1, so 1 <= τ <= k + 1
  (it counts the recovered or bonus token); "mean acceptance length" is the same number.

Output layout, one row per request, width max_spec_len + 1, padded with PLACEHOLDER_TOKEN_ID (-1):

    k = 3, all accepted         [x1, x2, x3, bonus]
    k = 3, x2 rejected          [x1, recovered_2, -1, -1]
    k = 0                       [bonus, -1, -1, -1]

Temperature, top-k and top-p have already been applied by the caller, the same way to p and to q (a draft
token outside the truncated p is then simply rejected). All randomness comes in as arguments
(`uniform_samples`, `recovery_noise`, `bonus_token_ids`), so the Triton kernel in `rejection_triton.py` is
checked against this function exactly, given the same random numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64, all requests' drafts, request after request
    cu_num_draft_tokens: Tensor,  # [batch] int64, request i owns drafts [cu[i-1], cu[i])
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab_size] float32 q, or None: one-hot drafts
    target_probs: Tensor,  # [num_draft_tokens + batch, vocab_size] float32 p, k_i + 1 rows per request
    bonus_token_ids: Tensor,  # [batch] int64, drawn from each request's bonus row of p
    is_greedy: Tensor,  # [batch] bool
    uniform_samples: Tensor,  # [num_draft_tokens] float32 or float64 in [0, 1)
    recovery_noise: Tensor,  # [num_draft_tokens, vocab_size] float32 i.i.d. Exp(1) draws, all > 0
    max_spec_len: int,  # the largest k in the batch (or more)
) -> Tensor:  # [batch, max_spec_len + 1] int64: accepted drafts, then recovered or bonus, then -1
    """Accept each request's longest valid draft prefix and append its recovered or bonus token.

    A recovered token is argmax(r / noise) with r = max(0, p - q) left unnormalised (argmax does not care
    about scale; with Exp(1) noise this is an exact draw from norm(r)); for one-hot q, r is p with p[x]
    zeroed. Ties go to the lowest token id, as torch.argmax does, and the Triton kernel matches that.
    """
    _validate(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, bonus_token_ids,
              is_greedy, uniform_samples, recovery_noise, max_spec_len)
    device = target_probs.device
    batch = cu_num_draft_tokens.numel()
    num_draft_tokens = draft_token_ids.numel()
    width = max_spec_len + 1
    output_token_ids = torch.full((batch, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                                  device=device)  # [batch, width]
    if batch == 0:
        return output_token_ids

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
    p_of_draft = target_probs[target_row_of_token, draft_token_ids]  # [num_draft_tokens]
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs[token_index, draft_token_ids]  # [num_draft_tokens]
    # NOTE: u * q < p is u < min(1, p / q) without a division, so both implementations round the same
    # way; q = 0 accepts iff p > 0, and p = 0 never accepts (not even with u = 0).
    is_accepted = uniform_samples * q_of_draft < p_of_draft  # [num_draft_tokens]
    is_greedy_token = is_greedy[request_of_token]  # [num_draft_tokens]
    if bool(is_greedy_token.any()):
        greedy_tokens = is_greedy_token.nonzero().squeeze(1)  # [num_greedy_tokens]
        argmax_p = target_probs[target_row_of_token[greedy_tokens]].argmax(dim=-1)
        is_accepted[greedy_tokens] = draft_token_ids[greedy_tokens] == argmax_p

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

    # ---- recovered token at the first rejection, else the bonus token -----------------------------
    next_token_ids = bonus_token_ids.clone()  # [batch]
    rejected = (num_accepted < num_drafts).nonzero().squeeze(1)  # [num_rejected] request ids
    if rejected.numel() > 0:
        rejected_token = draft_start[rejected] + num_accepted[rejected]  # [num_rejected]
        next_token_ids[rejected] = _recovered_token_ids(
            target_probs[rejected_token + rejected],
            None if draft_probs is None else draft_probs[rejected_token],
            draft_token_ids[rejected_token],
            recovery_noise[rejected_token],
            is_greedy[rejected],
        )
    output_token_ids.scatter_(1, num_accepted[:, None], next_token_ids[:, None])
    return output_token_ids


def _recovered_token_ids(
    target_probs: Tensor,  # [rows, vocab_size] p at the rejected positions
    draft_probs: Tensor | None,  # [rows, vocab_size] q there, or None for one-hot drafts
    draft_token_ids: Tensor,  # [rows] the rejected drafts
    recovery_noise: Tensor,  # [rows, vocab_size] Exp(1)
    is_greedy: Tensor,  # [rows] bool
) -> Tensor:  # [rows] int64
    """argmax(max(0, p - q) / noise), or argmax(p) for greedy rows; first index wins ties."""
    if draft_probs is None:
        residual = target_probs.scatter(1, draft_token_ids[:, None], 0.0)  # [rows, vocab_size]
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)  # [rows, vocab_size]
    score = torch.where(is_greedy[:, None], target_probs, residual / recovery_noise)
    return score.argmax(dim=-1)


def _validate(
    draft_token_ids: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    bonus_token_ids: Tensor,
    is_greedy: Tensor,
    uniform_samples: Tensor,
    recovery_noise: Tensor,
    max_spec_len: int,
) -> None:
    """Fail with a ValueError naming the argument, before a bad shape turns into a wrong token."""
    if not isinstance(max_spec_len, int) or max_spec_len < 0:
        raise ValueError(f"max_spec_len must be an int >= 0, got {max_spec_len!r}")
    if target_probs.ndim != 2:
        raise ValueError(f"target_probs must be [num_draft_tokens + batch, vocab_size], "
                         f"got shape {tuple(target_probs.shape)}")
    num_draft_tokens = draft_token_ids.numel()
    batch = cu_num_draft_tokens.numel()
    vocab_size = target_probs.shape[1]
    f32, i64 = (torch.float32,), (torch.int64,)
    expected = [
        ("draft_token_ids", draft_token_ids, (num_draft_tokens,), i64),
        ("cu_num_draft_tokens", cu_num_draft_tokens, (batch,), i64),
        ("target_probs", target_probs, (num_draft_tokens + batch, vocab_size), f32),
        ("bonus_token_ids", bonus_token_ids, (batch,), i64),
        ("is_greedy", is_greedy, (batch,), (torch.bool,)),
        ("uniform_samples", uniform_samples, (num_draft_tokens,), (torch.float32, torch.float64)),
        ("recovery_noise", recovery_noise, (num_draft_tokens, vocab_size), f32),
    ]
    if draft_probs is not None:
        expected.append(("draft_probs", draft_probs, (num_draft_tokens, vocab_size), f32))
    for name, tensor, shape, dtypes in expected:
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if tensor.dtype not in dtypes:
            raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if tensor.device != target_probs.device:
            raise ValueError(f"{name} is on {tensor.device}, target_probs on {target_probs.device}")
    counts = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1)).tolist()
    if any(k < 0 for k in counts):
        raise ValueError(f"cu_num_draft_tokens must be non-decreasing, got {counts}")
    if sum(counts) != num_draft_tokens:
        raise ValueError(f"cu_num_draft_tokens must end at num_draft_tokens={num_draft_tokens}, "
                         f"got {cu_num_draft_tokens.tolist()}")
    if counts and max(counts) > max_spec_len:
        raise ValueError(f"a request has k={max(counts)} drafts, more than max_spec_len={max_spec_len}")
