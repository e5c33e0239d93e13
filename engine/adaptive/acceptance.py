"""How likely each draft position is to be accepted, per request and per engine (the prior a new
request starts from).

Acceptance is not one α per request. A suffix or n-gram draft that copies a passage is kept whole or
lost at its first token; a model's draft thins out with depth. So the tracker keeps, per draft
position j, the chance a_j that draft j is accepted given drafts 1 .. j-1 were: a verification of k
drafts that kept a of them counts positions 1 .. a as accepted and, when a < k, position a + 1 as
rejected (later positions were never tested). Draft j is then emitted with probability
a_1 · a_2 · … · a_j, which is what the policy weighs against the cost of its row. Counts decay, so
the estimates follow the request as its text changes (prose, then code, then a quoted passage).

A request's a_j is shrunk toward the engine's a_j, which pools every request's verifications over a
longer memory: deep positions are tested only after every earlier draft was kept, so one request
sees them rarely, while the engine learns that copied passages hold once they start (a_1 low, a_2 ..
high). The engine's own a_j is shrunk toward its a_(j-1): a position never tested yet is assumed as
good as the one before it, and the geometric model (every a_j equal) is where the estimates start.

A tree (engine/draft_tree.py) tells more per verification: once a node is kept, each of its
children was the next token or not. Its a_j is read off first children (the proposer's first guess
after a node at depth j - 1, as a chain's draft j is); a later sibling of rank r, the proposer's
(r+1)-th guess there, is kept with chance b_r, pooled over depths and requests (side branches are
rarer than main chains). Each node's chance of being kept is then its parent's times a_j (first
child) or b_r (rank r), never above its parent's, and a tree is valued and cut by its nodes' chances
(policy.py), not by its depth-first order. Ranks are the proposer's: a tree cut to its likeliest
nodes is observed with its nodes' ranks in the uncut tree, so a dropped first guess does not
promote the second to first. (With sampled drafts, siblings after the kept one were not tested;
they count as not kept, which is exact for greedy requests.)

A proposer that drafts before the policy chooses (suffix, n-gram: `Proposer.drafts_for_free`) says
how sure it is by how much it offers: a suffix draft is as long as its match and as the path its
counts back, so on held-out prompts a 1-token draft's first token was kept 20% of the time and an
8-token draft's 95%. Pooled, the short guesses (most drafts) priced every long one as a guess and
the policy cut copied passages that verification would have kept. So a_j is also kept per offered
length n (the draft's length before the cut), a request's shrunk toward the engine's for that n;
the engine's a_1 for n toward its a_1 for n - 1, or toward INITIAL_ACCEPTANCE if that is lower (a
length not seen yet is taken as good as the next shorter one, and never as a failing guess: alone,
one verified row shows at once whether offers that long hold), its deeper a_j toward the engine's
a_j over all lengths.

Such a proposer's drafts are one-hot, so a draft the policy cut is tested all the same: the token
the step emits after the last kept draft is the one verification would have compared with the next
offered draft (policy.py observes it as one more tested position). Each request thus learns its own
a_1 every step, whether or not it verifies, and `first_draft_evidence` says how much it has seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.draft_tree import depths, sibling_ranks, verification_outcomes

# per test of a position: a request's estimate of it weighs its ~1/(1-0.8) = 5 last tests
REQUEST_DECAY = 0.8
# per test of a position by any request: the prior follows the workload over its ~100 last tests
ENGINE_DECAY = 0.99
# pseudo-verifications of the prior in a request's estimate: a new request trusts the engine's
PRIOR_WEIGHT = 1.0
# before anything was verified: a neutral guess, corrected by the first verifications
INITIAL_ACCEPTANCE = 0.5
# a later sibling (a second guess) before any was verified: guessed worse than a first guess
INITIAL_SIBLING_ACCEPTANCE = 0.3
# a_j = 1 would make every deeper draft look free
MAX_ACCEPTANCE = 0.98
# positions tracked; deeper drafts share the last one's estimate
MAX_POSITIONS = 32
# offered draft lengths tracked apart; longer offers share the last one's estimates
MAX_OFFERED = 16


class _PositionCounts:
    """Decayed accepted / rejected counts per draft position (or per sibling rank).

    NOTE: a position's counts decay when it is tested again, not when others are: each estimate is
    a moving window over its own last tests, so the shallow tests every step brings (policy.py tests
    a cut draft's first position for free) do not wash out what deep positions learned."""

    def __init__(self) -> None:
        self.accepted = np.zeros(MAX_POSITIONS)
        self.rejected = np.zeros(MAX_POSITIONS)

    def add(self, outcomes: Sequence[tuple[int, bool]], decay: float) -> None:
        """One verification's (1-based position, kept) outcomes."""
        tested = sorted({min(position, MAX_POSITIONS) - 1 for position, _ in outcomes})
        self.accepted[tested] *= decay
        self.rejected[tested] *= decay
        for position, kept in outcomes:
            if kept and position > MAX_POSITIONS:
                continue  # as in add_chain: a kept draft past the last tracked position adds nothing
            (self.accepted if kept else self.rejected)[min(position, MAX_POSITIONS) - 1] += 1.0

    def add_chain(self, num_draft_tokens: int, num_accepted: int, decay: float) -> None:
        """A chain's verification (positions 1..a kept, a + 1 not if a < k): what add() records
        for it, without building the outcomes every step of every request."""
        _add_chain(self.accepted, self.rejected, num_draft_tokens, num_accepted, decay)

    def estimate_toward(self, prior: np.ndarray, prior_weight: float) -> np.ndarray:
        """[MAX_POSITIONS] a_j = (accepted_j + w prior_j) / (tested_j + w)."""
        tested = self.accepted + self.rejected + prior_weight
        return np.minimum((self.accepted + prior_weight * prior) / tested, MAX_ACCEPTANCE)

    def estimate(self, first_prior: float, prior_weight: float) -> np.ndarray:
        """[MAX_POSITIONS] a_j = (accepted_j + w a_(j-1)) / (tested_j + w), with a_0 = first_prior.

        The recurrence a_j = c_j + d_j a_(j-1) unrolled: a_j = D_j (first_prior + sum_(i <= j) c_i / D_i)
        with D_j = d_1 ... d_j (no underflow: d_j >= w / (w + 1 / (1 - decay)) over 32 positions).
        """
        tested = self.accepted + self.rejected + prior_weight
        c, d = self.accepted / tested, prior_weight / tested
        products = np.cumprod(d)
        rate = products * (first_prior + np.cumsum(c / products))
        return np.minimum(rate, MAX_ACCEPTANCE)


def _add_chain(accepted: np.ndarray, rejected: np.ndarray, num_draft_tokens: int,
               num_accepted: int, decay: float) -> None:
    """[MAX_POSITIONS] counts (views, updated in place) after a chain's verification: the tested
    positions 1 .. a + 1 decay, then 1 .. a count as kept and a + 1, if a < k, as not."""
    num_tested = min(num_accepted + int(num_accepted < num_draft_tokens), MAX_POSITIONS)
    if num_tested <= 2:
        # NOTE: the common case (a first draft tested, often for free, every step of every
        # request): element by element, ~7x faster than slicing
        for position in range(num_tested):
            accepted[position] *= decay
            rejected[position] *= decay
        for position in range(num_accepted):
            accepted[position] += 1.0
    else:
        accepted[:num_tested] *= decay
        rejected[:num_tested] *= decay
        accepted[:min(num_accepted, MAX_POSITIONS)] += 1.0
    if num_accepted < num_draft_tokens:
        rejected[min(num_accepted + 1, MAX_POSITIONS) - 1] += 1.0


class _OfferedCounts:
    """Decayed accepted / rejected counts per (offered length n, draft position j) of chains."""

    def __init__(self) -> None:
        self.accepted = np.zeros((MAX_OFFERED, MAX_POSITIONS))
        self.rejected = np.zeros((MAX_OFFERED, MAX_POSITIONS))

    def add_chain(self, num_offered: int, num_draft_tokens: int, num_accepted: int,
                  decay: float) -> None:
        """As _PositionCounts.add_chain, in the row of drafts offered `num_offered` long."""
        row = min(num_offered, MAX_OFFERED) - 1
        _add_chain(self.accepted[row], self.rejected[row], num_draft_tokens, num_accepted, decay)

    def estimate(self, prior: np.ndarray, prior_weight: float) -> np.ndarray:
        """[MAX_OFFERED, MAX_POSITIONS] a_j per offered length n: a_1 shrunk toward a_1 of n - 1 but
        no lower than INITIAL_ACCEPTANCE (of n = 1: toward prior[0]), a_j (j > 1) toward
        prior[j - 1], the engine's over every length (once a copied passage starts it holds,
        whatever was offered)."""
        tested = self.accepted + self.rejected + prior_weight
        rate = (self.accepted + prior_weight * prior[None, :]) / tested
        # NOTE: a longer offer is never assumed worse than a shorter one; nor, before it is seen,
        # as bad as failing guesses: priced that low it would be cut, and so never seen
        first_prior = float(prior[0])
        for row in range(MAX_OFFERED):
            rate[row, 0] = ((self.accepted[row, 0] + prior_weight * first_prior)
                            / tested[row, 0])
            first_prior = max(float(rate[row, 0]), INITIAL_ACCEPTANCE)
        return np.minimum(rate, MAX_ACCEPTANCE)


class AcceptanceTracker:
    def __init__(self) -> None:
        self._engine = _PositionCounts()
        self._requests: dict[str, _PositionCounts] = {}
        # chains of proposers that drafted before the cut, by offered length (module docstring)
        self._engine_offered = _OfferedCounts()
        self._requests_offered: dict[str, _OfferedCounts] = {}
        # later siblings of trees, by rank (position r - 1 holds rank r), engine-wide
        self._siblings = _PositionCounts()
        # the engine's estimates, the prior of every request: computed once per batch of
        # verifications, not once per request and step
        self._engine_estimate: np.ndarray | None = None
        self._sibling_estimate: np.ndarray | None = None
        self._engine_offered_estimate: np.ndarray | None = None

    @property
    def engine_acceptance(self) -> np.ndarray:
        """[MAX_POSITIONS] conditional acceptance per position over all recent verifications."""
        if self._engine_estimate is None:
            self._engine_estimate = self._engine.estimate(INITIAL_ACCEPTANCE, 1.0)
        return self._engine_estimate

    @property
    def sibling_acceptance(self) -> np.ndarray:
        """[MAX_POSITIONS] b_r at index r - 1: a later sibling of rank r kept, once its parent was."""
        if self._sibling_estimate is None:
            self._sibling_estimate = self._siblings.estimate(INITIAL_SIBLING_ACCEPTANCE, 1.0)
        return self._sibling_estimate

    def engine_offered_acceptance(self, num_offered: int) -> np.ndarray:
        """[MAX_POSITIONS] a_j over all recent verifications of chains offered `num_offered` long."""
        if self._engine_offered_estimate is None:
            self._engine_offered_estimate = self._engine_offered.estimate(
                self.engine_acceptance, 1.0)
        return self._engine_offered_estimate[min(num_offered, MAX_OFFERED) - 1]

    def conditional_acceptance(self, request_id: str,
                               num_offered: int | None = None) -> np.ndarray:
        """[MAX_POSITIONS] a_j for the request: its own recent verifications over the engine's;
        with `num_offered`, those of drafts offered that long (a proposer that drafted first)."""
        if num_offered is not None and num_offered > 0:
            prior = self.engine_offered_acceptance(num_offered)
            counts = self._requests_offered.get(request_id)
            if counts is None:
                return prior
            row = min(num_offered, MAX_OFFERED) - 1
            tested = counts.accepted[row] + counts.rejected[row] + PRIOR_WEIGHT
            return np.minimum((counts.accepted[row] + PRIOR_WEIGHT * prior) / tested,
                              MAX_ACCEPTANCE)
        prior = self.engine_acceptance
        counts = self._requests.get(request_id)
        return prior if counts is None else counts.estimate_toward(prior, PRIOR_WEIGHT)

    def first_draft_evidence(self, request_id: str, num_offered: int | None = None) -> float:
        """How many times (decayed) the request's own first draft was tested lately, verified or
        for free (of drafts offered `num_offered` long): what its a_1 rests on beside the prior."""
        if num_offered is not None and num_offered > 0:
            counts = self._requests_offered.get(request_id)
            row = min(num_offered, MAX_OFFERED) - 1
            return 0.0 if counts is None else float(counts.accepted[row, 0]
                                                    + counts.rejected[row, 0])
        pooled = self._requests.get(request_id)
        return 0.0 if pooled is None else float(pooled.accepted[0] + pooled.rejected[0])

    def emission_chances(self, request_id: str, depth: int,
                         num_offered: int | None = None) -> np.ndarray:
        """[depth]: the chance that draft j (1-based) is accepted, a_1 · … · a_j; non-increasing.
        `num_offered`: the draft the proposer offered, when it drafted before the cut."""
        conditional = (self.conditional_acceptance(request_id) if num_offered is None
                       else self.conditional_acceptance(request_id, num_offered))
        per_position = conditional[np.minimum(np.arange(depth), MAX_POSITIONS - 1)]
        return np.cumprod(per_position)

    def tree_chances(self, request_id: str, parents: Sequence[int]) -> np.ndarray:
        """[len(parents)]: the chance each draft of the proposer's tree `parents` is kept (module
        docstring); never above its parent's."""
        conditional = self.conditional_acceptance(request_id)
        sibling = self.sibling_acceptance
        chances = np.empty(len(parents))
        for node, (parent, depth, rank) in enumerate(zip(parents, depths(parents),
                                                         sibling_ranks(parents))):
            own = (conditional[min(depth, MAX_POSITIONS) - 1] if rank == 0
                   else sibling[min(rank, MAX_POSITIONS) - 1])
            chances[node] = own * (1.0 if parent < 0 else chances[parent])
        return chances

    def observe(self, request_id: str, num_draft_tokens: int, num_accepted: int,
                parents: Sequence[int] | None = None, accepted_drafts: Sequence[int] | None = None,
                ranks: Sequence[int] | None = None, num_offered: int | None = None) -> None:
        """One verification of `num_draft_tokens` drafts, a chain or the tree `parents`, that kept
        `num_accepted` of them (of a tree: the first of the path `accepted_drafts`); `ranks`: the
        drafts' ranks in the proposer's tree when the policy cut this one from it;
        `num_offered`: a chain's length as the proposer offered it, before the cut."""
        counts = self._requests.get(request_id)
        if counts is None:  # NOTE: not setdefault: every request observes every step
            counts = self._requests[request_id] = _PositionCounts()
        self._engine_estimate = self._engine_offered_estimate = None
        if parents is None and ranks is None:  # the common case, every step of every request
            counts.add_chain(num_draft_tokens, num_accepted, REQUEST_DECAY)
            self._engine.add_chain(num_draft_tokens, num_accepted, ENGINE_DECAY)
            if num_offered is not None and num_offered >= num_draft_tokens:
                offered = self._requests_offered.get(request_id)
                if offered is None:
                    offered = self._requests_offered[request_id] = _OfferedCounts()
                offered.add_chain(num_offered, num_draft_tokens, num_accepted, REQUEST_DECAY)
                self._engine_offered.add_chain(num_offered, num_draft_tokens, num_accepted,
                                               ENGINE_DECAY)
            return
        accepted = (list(range(num_accepted)) if parents is None
                    else list(accepted_drafts or ())[:num_accepted])
        first_children, later_siblings = verification_outcomes(parents, num_draft_tokens,
                                                               accepted, ranks)
        counts.add(first_children, REQUEST_DECAY)
        self._engine.add(first_children, ENGINE_DECAY)
        if later_siblings:
            self._siblings.add(later_siblings, ENGINE_DECAY)
            self._sibling_estimate = None

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._requests_offered.pop(request_id, None)
