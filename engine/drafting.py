"""A step's drafting phase, after its tokens are committed: the target's features go to the
proposer, then each request that sampled gets its drafts for the next step (its k chosen by the
adaptive policy where one runs), cut where its grammar rejects them. A request whose drafting
raises fails alone (engine/step/isolation.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.adaptive import AdaptiveSpeculation
from engine.failures import run_isolated
from engine.proposers import Proposer
from engine.request import Request
from engine.scheduler import Scheduler
from engine.step.isolation import propose_isolated
from engine.step.layout import DraftProposal, DraftTokens, StepLayout
from engine.step.scheduler_output import SchedulerOutput
from engine.step.types import SampledTokens


@dataclass
class DraftChoice:
    """The k chosen for one decoding request when drafting for the next step."""

    request: Request
    k: int


class Drafting:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, scheduler: Scheduler,
                 adaptive: AdaptiveSpeculation | None) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.scheduler = scheduler
        self.adaptive = adaptive

    def record_target_hidden(self, scheduled: SchedulerOutput, sampled: list[SampledTokens],
                             token_hidden: torch.Tensor) -> dict[str, str]:
        """Before commit, for proposers that read the target's features: each request's rows of
        committed tokens (a prefill chunk whole; of a verification, the known token and the
        accepted drafts), from the position they start at. Returns {request_id: why} for the
        requests whose recording raised (each then fails alone)."""
        if not self.proposer.needs_committed_hidden:
            return {}
        failures: dict[str, str] = {}
        kept_tokens = iter(sampled)
        for item, row in zip(scheduled.scheduled, scheduled.layout.token_starts):
            num_known = item.num_known_tokens
            rows = token_hidden[row:row + num_known]
            if item.is_sampling:
                kept = next(kept_tokens)
                if kept.error is not None:
                    continue
                accepted = kept.kept_drafts
                if item.draft_parents is None:
                    rows = token_hidden[row:row + num_known + len(accepted)]
                elif accepted:  # a tree's accepted path: rows after the known ones, not in a run
                    path = [row + num_known + draft for draft in accepted]
                    rows = torch.cat([rows, token_hidden[torch.tensor(path,
                                                                      device=rows.device)]])
            error = run_isolated(lambda: self.proposer.record_target_hidden(
                item.request, item.request.num_computed_tokens, rows,
                self.scheduler.block_manager.block_table(item.request.request_id)),
                item.request.request_id, "recording the target's features")
            if error is not None:
                failures[item.request.request_id] = error
        return failures

    def propose(self, layout: StepLayout, sampled: list[SampledTokens],
                hidden: torch.Tensor) -> tuple[list[DraftChoice], dict[str, str]]:
        """Drafts for the NEXT step, from the tokens just committed (so the scheduler can budget
        them); returns the k chosen for each request drafted for.

        Only requests that sampled this step get new drafts: the others' tokens did not change, so
        their pending drafts still stand. Each gets the target's hidden state at the row that
        produced its newest token (of a chain, row a of its 1 + k rows after a accepted drafts; of
        a tree, the row after the last draft on its accepted path). Also returns {request_id: why}
        for the requests whose drafting raised on their own (they fail alone).
        """
        row_of = {item.request.request_id: layout.kept_rows(index, kept.kept_drafts)[-1]
                  for index, (item, kept) in enumerate(zip(layout.sampling, sampled))}
        requests = [r for r in self.scheduler.decoding if r.request_id in row_of]
        if not requests:
            return [], {}
        caps = [self.scheduler.draft_budget(r, self.num_speculative_tokens) for r in requests]
        target_hidden = hidden[torch.tensor([row_of[r.request_id] for r in requests],
                                            device=hidden.device)]
        if self.adaptive is None:
            proposals, failures = self._propose(requests, caps, target_hidden)
        elif self.proposer.drafts_for_free:
            # draft first: the policy then weighs the drafts that exist, and trims them
            proposals, failures = self._propose(requests, caps, target_hidden)
            caps = self._choose_ks(requests, [len(p.token_ids) for p in proposals],
                                   [p.parents for p in proposals])
            proposals = [self.adaptive.keep_best(r.request_id, p, cap)
                         for r, p, cap in zip(requests, proposals, caps)]
        else:
            caps = self._choose_ks(requests, caps)
            proposals, failures = self._propose(requests, caps, target_hidden)
        self.scheduler.update_draft_token_ids(
            DraftTokens({r.request_id: p for r, p in zip(requests, proposals)}))
        return [DraftChoice(r, cap) for r, cap in zip(requests, caps)], failures

    def free(self, request_id: str) -> None:
        """The request ended: its proposer and adaptive state go (the proposer's in isolation)."""
        run_isolated(lambda: self.proposer.free(request_id), request_id,
                     "freeing its drafter state")
        if self.adaptive is not None:
            self.adaptive.free(request_id)

    def _propose(self, requests: list[Request], caps: list[int], target_hidden: torch.Tensor,
                 ) -> tuple[list[DraftProposal], dict[str, str]]:
        """Drafts, and {request_id: why} for the requests whose drafting raised on their own."""
        return propose_isolated(self._propose_batch, requests, caps, target_hidden)

    def _propose_batch(self, requests: list[Request], caps: list[int],
                       target_hidden: torch.Tensor) -> list[DraftProposal]:
        """The proposer's drafts, each cut where its request's grammar (if any) rejects it."""
        proposals = self.proposer.propose(requests, caps, target_hidden)
        if any(r.grammar is not None for r in requests):
            proposals = cut_drafts_at_grammar(requests, proposals)
        return proposals

    def _choose_ks(self, requests: list[Request], caps: list[int],
                   trees: list[list[int] | None] | None = None) -> list[int]:
        return self.adaptive.choose(requests, caps,
                                    self.scheduler.num_prefill_tokens_next_step(len(requests)),
                                    trees)


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
