"""Structured output in a speculative step: grammar masks at every verification row, drafts cut where
the grammar rejects them, and the same mask on a model proposer's q.

Row j of a request's 1 + k rows gets the grammar's mask after the committed output + drafts d_1..d_j,
exactly the mask one-token-at-a-time decoding would use there (engine/structured/grammar_state.py);
a drafting pass's row gets the mask the target's row will get after the same drafts.

Where a draft is cut (engine/drafting.py) keeps sampling lossless. A deterministic draft (n-gram, suffix, or any draft of
a greedy request) is cut before its first rejected token: the draft is a function of the context,
so cutting it cannot bias anything. A SAMPLED draft x ~ q is cut after its first rejected token,
which stays in the block: the mask gives it p(x) = 0, so the rejection sampler rejects it for sure
and draws the recovered token from norm(max(0, p - q)), as the lossless scheme requires. Dropping it
instead would mean drawing from p exactly where q put mass on invalid tokens, which biases the
output. Model proposers mask their q with the grammar too, so their drafts are rarely cut at all.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.structured import allocate_token_bitmask, apply_token_bitmask_, fill_batch_masks


def mask_verification_logits(logits: torch.Tensor, requests: list[Request],
                             drafts: list[list[int]], logits_starts: list[int]) -> torch.Tensor:
    """A verification step's logits [num_rows, vocab], each grammar request's rows starts[i] ..
    starts[i] + k masked after each prefix of its k drafts: a copy, or `logits` itself when no
    request in the step has a grammar (the raw logits stay for logprobs)."""
    return _masked_rows(logits, list(zip(requests, drafts, logits_starts)), every_prefix=True)


def mask_draft_logits(logits: torch.Tensor, requests: list[Request],
                      drafts: list[list[int]]) -> torch.Tensor:
    """A drafting pass's logits [rows, vocab], row i masked as the target's row will be after
    requests[i]'s output then drafts[i] (this proposal's drafts so far): a copy, or `logits`
    itself when no row's request has a grammar."""
    return _masked_rows(logits, list(zip(requests, drafts, range(len(requests)))),
                        every_prefix=False)


def _masked_rows(logits: torch.Tensor, entries: list[tuple[Request, list[int], int]],
                 every_prefix: bool) -> torch.Tensor:
    """entries: (request, drafts, logits row); with every_prefix the rows row .. row + k get the
    masks after each prefix of the k drafts (a verification's), else the row gets the mask after
    all of them (a drafting pass's)."""
    entries = [entry for entry in entries if entry[0].grammar is not None]
    if not entries:
        return logits
    states = [request.grammar for request, _, _ in entries]
    drafts = [draft for _, draft, _ in entries]
    vocab_size = states[0].vocab_size
    mask_starts = [0]
    for draft in drafts:
        mask_starts.append(mask_starts[-1] + len(draft) + 1)
    bitmask = allocate_token_bitmask(mask_starts[-1], vocab_size)  # [masks, words]
    fill_batch_masks(states, drafts, bitmask, mask_starts[:-1])
    if every_prefix:
        logits_rows = [row + j for (_, draft, row) in entries for j in range(len(draft) + 1)]
    else:
        bitmask = bitmask[[start + len(draft) for start, draft in zip(mask_starts, drafts)]]
        logits_rows = [row for _, _, row in entries]
    masked = logits.clone()
    apply_token_bitmask_(masked, bitmask, vocab_size, torch.tensor(logits_rows, dtype=torch.int64))
    return masked
