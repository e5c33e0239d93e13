"""The one extension point of speculation: a Proposer turns running requests into draft tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.request import Request
from engine.step.layout import DraftProposal

__all__ = ["DraftProposal", "Proposer", "model_draft_proposal"]


class Proposer(ABC):
    # True for proposers that read the target's features at every committed position (EAGLE): the
    # engine then hands them over through record_target_hidden after each step
    needs_committed_hidden: bool = False
    # True for proposers whose drafting costs next to nothing beside a target pass (n-gram, suffix):
    # adaptive speculation then lets them draft to the full budget and trims what it will not verify,
    # so it weighs drafts that exist instead of positions the proposer might not fill
    drafts_for_free: bool = False
    # target layers whose entering residual streams record_target_hidden receives, side by side,
    # instead of the final-norm hidden state (EAGLE-3); empty: the final-norm hidden state
    target_feature_layers: tuple[int, ...] = ()

    @abstractmethod
    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        """Draft up to max_num_tokens[i] tokens to follow requests[i]'s tokens (prompt + output).

        Invariant: reads requests, never changes them or any target state; returns one proposal per
        request, in order, each no longer than its cap.
        """

    def record_target_hidden(self, request: Request, start_position: int, hidden: torch.Tensor,
                             block_table: list[int]) -> None:
        """The target's final-norm hidden states at positions start_position .. + len(hidden) - 1,
        every one of a committed token (rejected drafts' rows are left out), and the request's
        target block table (positions before start_position may come from cached blocks that
        another request computed). Default: unused."""

    def free(self, request_id: str) -> None:
        """The request ended; drop anything kept for it. Default: nothing kept."""


def model_draft_proposal(request: Request, token_ids: list[int],
                         probs: list[torch.Tensor]) -> DraftProposal:
    """A model-based proposer's draft: its q rides along only when the request samples (a greedy
    request's drafts are verified as one-hot, whatever q was)."""
    is_random = bool(token_ids) and not request.params.is_greedy
    return DraftProposal(token_ids, torch.stack(probs) if is_random else None)
