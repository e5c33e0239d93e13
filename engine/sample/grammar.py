"""Structured output in a speculative step: grammar masks at every verification row, drafts cut where
the grammar rejects them, and the same mask on a model proposer's q.

Row j of a request's 1 + k rows gets the grammar's mask after the committed output + drafts d_1..d_j,
exactly the mask one-token-at-a-time decoding would use there (engine/structured/grammar_state.py).

Where a draft is cut keeps sampling lossless. A deterministic draft (n-gram, suffix, or any draft of
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
from engine.step.layout import DraftProposal, StepLayout
from engine.structured import allocate_token_bitmask, apply_token_bitmask_, fill_batch_masks


def mask_step_logits(logits: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """A copy of logits [num_rows, vocab] with each grammar request's rows masked, or `logits`
    itself when no request in the step has a grammar (the raw logits stay for logprobs)."""
    states, drafts, rows = [], [], []
    for item, start in zip(layout.sampling, layout.logits_starts):
        if item.request.grammar is not None:
            states.append(item.request.grammar)
            drafts.append(item.draft_token_ids)
            rows.append(start)
    if not states:
        return logits
    vocab_size = states[0].vocab_size
    mask_starts = [0]
    for draft in drafts:
        mask_starts.append(mask_starts[-1] + len(draft) + 1)
    bitmask = allocate_token_bitmask(mask_starts[-1], vocab_size)  # [masked rows, words]
    fill_batch_masks(states, drafts, bitmask, mask_starts[:-1])
    logits_rows = torch.tensor([row + j for row, draft in zip(rows, drafts)
                                for j in range(len(draft) + 1)], dtype=torch.int64)
    masked = logits.clone()
    apply_token_bitmask_(masked, bitmask, vocab_size, logits_rows)
    return masked


def mask_request_logits(logits: torch.Tensor, request: Request,
                        draft_token_ids: list[int]) -> torch.Tensor:
    """One request's logits [vocab] at the draft position after `draft_token_ids` (a proposer's
    earlier drafts of this proposal), masked by its grammar: a copy, or `logits` when it has none."""
    state = request.grammar
    if state is None:
        return logits
    bitmask = allocate_token_bitmask(len(draft_token_ids) + 1, state.vocab_size)
    state.fill_masks(draft_token_ids, bitmask, 0)
    masked = logits[None].clone()  # [1, vocab]
    apply_token_bitmask_(masked, bitmask[-1:], state.vocab_size)
    return masked[0]


def cut_drafts_at_grammar(requests: list[Request],
                          proposals: list[DraftProposal]) -> list[DraftProposal]:
    """Each grammar request's draft cut where its grammar rejects it (see the module docstring for
    why a sampled draft keeps its first rejected token); a tree keeps its main chain, as the
    grammar's masks follow one path."""
    cut = []
    for request, proposal in zip(requests, proposals):
        if request.grammar is not None and proposal.token_ids:
            proposal = proposal.main_chain()
            num_valid = request.grammar.valid_draft_prefix(proposal.token_ids)
            is_sampled = proposal.probs is not None and not request.params.is_greedy
            keep = num_valid + 1 if is_sampled else num_valid
            proposal = proposal.first(keep) if keep else DraftProposal([])
        cut.append(proposal)
    return cut
