"""The one extension point of speculation: a Proposer turns running requests into draft tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass
class DraftProposal:
    # the draft tokens, in order; may be empty (no guess for this request this step)
    token_ids: list[int]
    # [len(token_ids), vocab] float32 draft distribution q at each position, or None when the draft
    # is deterministic (n-gram, suffix): the rejection sampler then treats q as one-hot
    probs: torch.Tensor | None = None


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        """Draft up to max_num_tokens[i] tokens to follow requests[i]'s tokens (prompt + output).

        Invariant: reads requests, never changes them or any target state; returns one proposal per
        request, in order, each no longer than its cap.
        """

    def free(self, request_id: str) -> None:
        """The request ended; drop anything kept for it. Default: nothing kept."""
