"""Recent acceptance α per request, and per engine (the prior a new request starts from).

A verification of k drafts that kept a prefix of a is read as a accepted tokens and, when a < k, one
rejected token: under the model that each draft position is accepted with probability α (given the
ones before it), accepted / (accepted + rejected) is the maximum-likelihood α. Each verification
counts once (its two counts are scaled to sum to 1), and counts decay, so the estimate follows the
request as its text changes (prose, then code, then a quoted passage) at the same pace either way.
"""

from __future__ import annotations

from dataclasses import dataclass

# per verification: a request's counts weigh ~1/(1-0.8) = 5 recent verifications
REQUEST_DECAY = 0.8
# per verification of any request: the prior follows the workload over ~100 verifications
ENGINE_DECAY = 0.99
# pseudo-tokens of the prior in a request's estimate: a new request trusts the engine-wide α
PRIOR_WEIGHT = 1.0
# before anything was verified: a neutral guess, corrected by the first verifications
INITIAL_ALPHA = 0.5
# α = 1 would make every extra draft look free; the geometric model never quite allows it
MAX_ALPHA = 0.98


@dataclass
class _DecayedCounts:
    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, accepted: float, rejected: float, decay: float) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + rejected


class AcceptanceTracker:
    def __init__(self) -> None:
        self._engine = _DecayedCounts()
        self._requests: dict[str, _DecayedCounts] = {}

    @property
    def engine_alpha(self) -> float:
        counts = self._engine
        total = counts.accepted + counts.rejected
        alpha = (counts.accepted + INITIAL_ALPHA) / (total + 1.0)
        return min(alpha, MAX_ALPHA)

    def alpha(self, request_id: str) -> float:
        """The request's estimate: its own recent verifications over the engine-wide prior."""
        prior = self.engine_alpha
        counts = self._requests.get(request_id)
        if counts is None:
            return prior
        total = counts.accepted + counts.rejected
        alpha = (counts.accepted + PRIOR_WEIGHT * prior) / (total + PRIOR_WEIGHT)
        return min(alpha, MAX_ALPHA)

    def observe(self, request_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification of `num_draft_tokens` drafts that kept `num_accepted` of them."""
        num_rejected = int(num_accepted < num_draft_tokens)
        accepted = num_accepted / (num_accepted + num_rejected)
        self._requests.setdefault(request_id, _DecayedCounts()).add(accepted, 1 - accepted,
                                                                    REQUEST_DECAY)
        self._engine.add(accepted, 1 - accepted, ENGINE_DECAY)

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
