"""A step's drafts between the proposer and the step layout: cut where a request's grammar rejects
them (engine/sample/grammar.py says why the cut keeps sampling lossless)."""

from __future__ import annotations

from engine.request import Request
from engine.step.layout import DraftProposal


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
