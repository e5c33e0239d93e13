"""Verifying trees of drafts for a batch of requests, in torch: the reference the Triton kernel
matches.

The algorithm is `tree_rejection_reference.verify_tree` (greedy longest agreeing path; multi-draft
rejection sampling with the residual carried from sibling to sibling), and the rows, uniforms and
numerics are the chain sampler's (`rejection_reference.py`), so that a request whose drafts form a
chain gets exactly the chain sampler's tokens:

- the residual is kept unnormalised, as weights d with a scale s (d / s is the normalised residual):
  d = p and s = 1 at a node (p is taken as normalised, as the chain sampler does); rejecting a child
  with q gives d' = max(0, d - s * q) in float32, rejecting a one-hot child zeroes its token in d,
  and s' = the fixed-point total of d' (times 2^-FIXED_POINT_BITS). If d' has no fixed-point mass
  the residual stays as it was (the chain sampler's "p itself when p <= q");
- a child with token x is accepted when (u * q(x)) * s < d(x): the chain's u * q < p when s = 1;
- the recovered or bonus token is the chain's inverse CDF of d's fixed-point weights at the sample
  uniform of the node's row, target_argmax there when d has no mass (a row of p the caller zeroed
  because its logits left no probability: target_argmax is then the argmax of its processed logits).
Every sum is over integers, exact in any order, so a kernel summing in tiles finds the same tokens.
NOTE: verify_tree normalises in float64 before its fixed-point draw. The two agree but at rounding
boundaries and at the chain sampler's edges: q(x) = 0 accepts when p(x) > 0 (verify_tree: never); a
residual is empty when its fixed-point weights are (each under 2^-42), and a small one is drawn at
2^-42 absolute resolution (verify_tree renormalises first).

A request's drafts are tried in index order: the children of node u are the later drafts whose
parent is u, and once a draft is tried the next one tried is the first later draft whose parent is
the (possibly new) current node. So one pass over the draft indices walks every request's tree.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.rejection_reference import (
    FIXED_POINT_BITS,
    PLACEHOLDER_TOKEN_ID,
    _validate,
    inverse_cdf,
    recovery_weights,
    to_fixed_point,
)


def tree_rejection_sample_reference(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64, all requests' drafts, request by request
    draft_parents: Tensor,  # [num_draft_tokens] int64, parent draft within the request, -1 = root
    cu_num_draft_tokens: Tensor,  # [batch] int64, request i owns drafts [cu[i-1], cu[i])
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab_size] float32 q, or None: one-hot drafts
    target_probs: Tensor | None,  # [num_draft_tokens + batch, vocab_size] float32 p; None: greedy
    target_argmax: Tensor,  # [num_draft_tokens + batch] int64, argmax of each row of p
    is_greedy: Tensor,  # [batch] bool
    acceptance_uniforms: Tensor | None,  # [num_draft_tokens] float32 or float64, read when tried
    sample_uniforms: Tensor | None,  # [num_draft_tokens + batch] float32 or float64, one per row
    max_spec_len: int,  # the most drafts any request has (or more)
) -> tuple[Tensor, Tensor]:
    """Walk each request's tree; returns output_token_ids [batch, max_spec_len + 1] int64 (the
    accepted drafts, then the recovered or bonus token, then PLACEHOLDER_TOKEN_ID) and
    accepted_drafts [batch, max_spec_len] int64 (the accepted path's draft indices within the
    request, increasing, then -1).

    Rows of p as in the chain sampler: request i's start at cu[i-1] + i; its row 0 follows the root
    and row 1 + j follows draft j. A greedy request reads target_argmax only.
    """
    _validate(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax,
              is_greedy, acceptance_uniforms, sample_uniforms, max_spec_len)
    _validate_parents(draft_parents, cu_num_draft_tokens, draft_token_ids.numel())
    device = target_argmax.device
    batch = cu_num_draft_tokens.numel()
    output_token_ids, accepted_drafts = empty_tree_outputs(batch, max_spec_len, device)
    if batch == 0:
        return output_token_ids, accepted_drafts

    num_drafts = torch.diff(cu_num_draft_tokens,
                            prepend=cu_num_draft_tokens.new_zeros(1))  # [batch]
    draft_start = cu_num_draft_tokens - num_drafts  # [batch]
    root_row = draft_start + torch.arange(batch, device=device)  # [batch] row of p after the root
    node = torch.full((batch,), -1, dtype=torch.int64, device=device)  # [batch] -1: the root
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)  # [batch]
    # ---- the random requests' residuals: weights d and scale s (module docstring) ----------------
    random = (torch.empty(0, dtype=torch.int64, device=device) if target_probs is None
              else (~is_greedy).nonzero().squeeze(1))  # [num_random] request indices
    # [num_random, vocab_size]
    residual = None if target_probs is None else target_probs[root_row[random]]
    scale = torch.ones(random.numel(), dtype=torch.float32, device=device)  # [num_random]

    for j in range(int(num_drafts.max())):
        draft = torch.minimum(draft_start + j, cu_num_draft_tokens - 1).clamp_min(0)  # [batch]
        is_tried = (j < num_drafts) & (draft_parents[draft] == node)  # [batch]
        if not bool(is_tried.any()):
            continue
        token = draft_token_ids[draft]  # [batch]
        is_accepted = token == target_argmax[root_row + node + 1]  # [batch] the greedy test
        if random.numel() > 0:
            random_draft, random_token = draft[random], token[random]  # [num_random]
            q_of_token = (torch.ones_like(scale) if draft_probs is None
                          else draft_probs[random_draft, random_token])  # [num_random]
            d_of_token = residual.gather(1, random_token[:, None])[:, 0]  # [num_random]
            # NOTE: the chain's u * q < p without a division when s = 1; (u * q) rounds as there
            u_times_q = acceptance_uniforms[random_draft] * q_of_token  # [num_random]
            is_accepted[random] = u_times_q * scale < d_of_token
            is_rejected = is_tried[random] & ~is_accepted[random]  # [num_random]
            if bool(is_rejected.any()):
                rejected = is_rejected.nonzero().squeeze(1)  # into `random`
                residual[rejected], scale[rejected] = _reject(
                    residual[rejected], scale[rejected], random_token[rejected],
                    None if draft_probs is None else draft_probs[random_draft[rejected]])
        is_accepted &= is_tried
        if not bool(is_accepted.any()):
            continue
        accepted = is_accepted.nonzero().squeeze(1)  # [num_accepted_now] request indices
        output_token_ids[accepted, num_accepted[accepted]] = token[accepted]
        accepted_drafts[accepted, num_accepted[accepted]] = j
        num_accepted += is_accepted.long()
        node = torch.where(is_accepted, j, node)
        if random.numel() > 0:
            moved = is_accepted[random].nonzero().squeeze(1)  # into `random`: a fresh node
            residual[moved] = target_probs[root_row[random[moved]] + j + 1]
            scale[moved] = 1.0

    # ---- the recovered or bonus token, at the row of the last accepted node ----------------------
    final_row = root_row + node + 1  # [batch]
    next_token_ids = target_argmax[final_row]  # [batch] greedy's token, and the no-mass fallback
    if random.numel() > 0:
        next_token_ids[random] = inverse_cdf(to_fixed_point(residual),
                                             sample_uniforms[final_row[random]],
                                             next_token_ids[random])
    output_token_ids.scatter_(1, num_accepted[:, None], next_token_ids[:, None])
    return output_token_ids, accepted_drafts


def empty_tree_outputs(batch: int, max_spec_len: int,
                       device: torch.device) -> tuple[Tensor, Tensor]:
    """The outputs before any request is walked: output_token_ids [batch, max_spec_len + 1] all
    placeholders, accepted_drafts [batch, max_spec_len] all -1."""
    return (torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                       device=device),
            torch.full((batch, max_spec_len), -1, dtype=torch.int64, device=device))


def _reject(
    residual: Tensor,  # [rows, vocab_size] float32 weights d
    scale: Tensor,  # [rows] float32 s: d / s is the normalised residual
    token_ids: Tensor,  # [rows] int64, the rejected drafts
    draft_probs: Tensor | None,  # [rows, vocab_size] float32 their q, or None: one-hot
) -> tuple[Tensor, Tensor]:
    """What is left after a rejected draft: max(0, d - s * q), or d with the draft zeroed for
    one-hot q, with its fixed-point total as the new scale; (d, s) unchanged where that leaves no
    mass."""
    scaled_q = None if draft_probs is None else scale[:, None] * draft_probs  # [rows, vocab_size]
    left = recovery_weights(residual, scaled_q, token_ids)  # [rows, vocab_size]
    total = to_fixed_point(left).sum(dim=-1)  # [rows] exact
    has_mass = total > 0
    new_scale = (total.double() * 2.0**-FIXED_POINT_BITS).float()  # [rows]
    return (torch.where(has_mass[:, None], left, residual),
            torch.where(has_mass, new_scale, scale))


def _validate_parents(draft_parents: Tensor, cu_num_draft_tokens: Tensor,
                      num_draft_tokens: int) -> None:
    """Each draft's parent is -1 or an earlier draft of the same request."""
    if draft_parents.dtype != torch.int64 or tuple(draft_parents.shape) != (num_draft_tokens,):
        raise ValueError(f"draft_parents must be int64 of shape ({num_draft_tokens},), got "
                         f"{draft_parents.dtype} {tuple(draft_parents.shape)}")
    if not draft_parents.is_contiguous():
        raise ValueError("draft_parents must be contiguous")
    if draft_parents.device != cu_num_draft_tokens.device:
        raise ValueError(f"draft_parents is on {draft_parents.device}, cu_num_draft_tokens on "
                         f"{cu_num_draft_tokens.device}")
    num_drafts = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))
    request_of_draft = torch.repeat_interleave(
        torch.arange(num_drafts.numel(), device=num_drafts.device), num_drafts)
    position = (torch.arange(num_draft_tokens, device=num_drafts.device)
                - (cu_num_draft_tokens - num_drafts)[request_of_draft])  # [num_draft_tokens]
    is_valid = (draft_parents >= -1) & (draft_parents < position)
    if not bool(is_valid.all()):
        bad = int((~is_valid).nonzero()[0, 0])
        raise ValueError(f"draft {bad}'s parent {int(draft_parents[bad])} must be -1 or an earlier "
                         "draft of its request")


def random_tree_inputs(
    num_drafts: list[int],  # how many drafts each request has
    vocab_size: int,
    *,
    has_draft_probs: bool,
    greedy_fraction: float,
    seed: int,
    is_chain: bool = False,
    device: str | torch.device = "cpu",
) -> dict[str, Tensor | int | None]:
    """Keyword arguments for `tree_rejection_sample_reference` (shared by tests and benchmarks).

    Each draft's parent is the draft before it half the time (deep paths), else the root or any
    earlier draft; the drafts are a chain when is_chain. A draft is drawn from a q near p at its
    parent's row, so acceptance varies, and siblings may repeat a token; greedy requests draft
    argmax p there half the time.
    """
    gen = torch.Generator(device).manual_seed(seed)
    rand = {"generator": gen, "device": device}
    batch, num_draft_tokens = len(num_drafts), sum(num_drafts)
    parents = []
    for k in num_drafts:
        for j in range(k):
            extends = is_chain or bool(torch.rand(1, **rand) < 0.5)
            parents.append(j - 1 if extends else int(torch.randint(-1, j, (1,), **rand)))
    draft_parents = torch.tensor(parents, dtype=torch.int64, device=device)  # [num_draft_tokens]
    num_drafts_t = torch.tensor(num_drafts, dtype=torch.int64, device=device)  # [batch]
    cu_num_draft_tokens = torch.cumsum(num_drafts_t, 0)
    request_of_draft = torch.repeat_interleave(torch.arange(batch, device=device), num_drafts_t)
    root_row = cu_num_draft_tokens - num_drafts_t + torch.arange(batch, device=device)  # [batch]
    parent_row = root_row[request_of_draft] + draft_parents + 1  # [num_draft_tokens]

    target_logits = torch.randn(num_draft_tokens + batch, vocab_size, **rand) * 3
    target_probs = target_logits.softmax(-1)  # [num_draft_tokens + batch, vocab_size]
    target_argmax = target_probs.argmax(-1)
    draft_logits = target_logits[parent_row] + torch.randn(num_draft_tokens, vocab_size, **rand)
    draft_probs = draft_logits.softmax(-1)  # [num_draft_tokens, vocab_size]
    draft_token_ids = torch.multinomial(draft_probs, 1, generator=gen).reshape(num_draft_tokens)
    is_greedy = torch.rand(batch, **rand) < greedy_fraction  # [batch]
    use_argmax = is_greedy[request_of_draft] & (torch.rand(num_draft_tokens, **rand) < 0.5)
    draft_token_ids = torch.where(use_argmax, target_argmax[parent_row], draft_token_ids)
    return {
        "draft_token_ids": draft_token_ids,
        "draft_parents": draft_parents,
        "cu_num_draft_tokens": cu_num_draft_tokens,
        "draft_probs": draft_probs if has_draft_probs else None,
        "target_probs": target_probs,
        "target_argmax": target_argmax,
        "is_greedy": is_greedy,
        "acceptance_uniforms": torch.rand(num_draft_tokens, **rand),
        "sample_uniforms": torch.rand(num_draft_tokens + batch, dtype=torch.float64, **rand),
        "max_spec_len": max(num_drafts, default=0),
    }
