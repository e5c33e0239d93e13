"""Prompt lookup: if the context's last n tokens appeared earlier, guess that what followed then
follows again. Free to compute and strong wherever outputs copy their inputs (code edits, extraction)."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from engine.proposers.base import DraftProposal, Proposer
from engine.request import Request


def lookup_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-k tokens after the latest earlier occurrence of the longest matching suffix.

    tokens: [num_tokens] int64. Longer suffixes are tried first: they predict better.
    """
    num_tokens = len(tokens)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n:]
        # windows that start before the suffix itself: [num_tokens - n, n]
        windows = sliding_window_view(tokens[:num_tokens - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n  # the latest match: closest context, freshest copy
            return tokens[follow:follow + k].tolist()
    return []


class NgramProposer(Proposer):
    drafts_for_free = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        proposals = []
        for request, k in zip(requests, max_num_tokens):
            if k <= 0:
                proposals.append(DraftProposal([]))
                continue
            tokens = np.asarray(request.prompt_token_ids + request.output_token_ids, dtype=np.int64)
            proposals.append(DraftProposal(lookup_continuation(tokens, self.min_n, self.max_n, k)))
        return proposals
