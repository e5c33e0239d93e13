"""Choose k per request, each step, to maximise expected tokens emitted per second.

A verification of k drafts emits 1 + c_1 + … + c_k tokens in expectation (the accepted prefix plus
the bonus or recovered token), where c_j, the chance draft j is accepted, is the product of the
request's per-position acceptance (engine/adaptive/acceptance.py): gains shrink with depth, slowly
for a request copying a passage, fast for one whose drafts are guesses. A batch pays for them together: its step
costs verify(tokens) + draft(depth), with tokens = the known tokens (one per decoding request, plus
prefill chunks) + Σk, and depth = max k. So, for each depth D, the draft positions are taken best gain
first while the batch's tokens per second still rise; the best D wins, and k = 0 for everyone when
speculation would not beat plain decoding by MIN_RELATIVE_GAIN.

This is what makes speculation back off under load: when the target pass turns compute-bound (a big
batch, long prefill chunks), extra rows stop being nearly free, the marginal draft no longer pays,
and k falls toward 0; with few requests and a cheap extra row, k rises to the configured maximum.

A tree of drafts (engine/draft_tree.py) is weighed node by node: each node's chance of being kept
(acceptance.py) is its gain, the best nodes go first, and a tree cut to k drafts keeps its k likeliest
nodes (a child is never likelier than its parent, so they form a tree). Proposers that draft for free
hand the policy their trees; a model drafter (EAGLE) is given its budget before it drafts, valued as
a chain of that length.

Under load, a draft is priced on evidence. Its row is a sure cost to every request of the step;
its gain is an estimate, picked because it looked good (the noisier, the likelier it looks better
than it is), and it pays only if the request's earlier finish is used: a batch runs until its
slowest request ends, unless a waiting request takes the freed slot. Alone, a request bets only its
own pass, a row is a small share of it, and a won bet saves a whole pass: it is chosen on its mean.
At batch B a row costs B times the share of a token's worth it costs alone, so margins are thin and
a bet is worth the others' time only once the request has shown it wins. So a one-hot chain's draft
(below) is valued at the Wilson lower bound of its request's first-draft acceptance, SKEPTICISM *
(1 - 1/B) deviations wide, over the request's own tested first drafts of that offered length and
the prior's weight: a request whose long offers keep holding (a copied passage) speculates under
load; one whose few hits may be luck, or that has not tested an offer that long, does not.

Evidence costs nothing for one-hot chains from a proposer that drafts first (suffix, n-gram): the
token a step emits after its last kept draft is the token verification would have compared with the
next offered draft, so the step tests a cut draft anyway (`tested_for_free`): every request learns
its first-draft acceptance every step, verified or not, and needs no probes. Where evidence costs a
verified row (a model drafter, a tree), demanding it would starve the drafter: those are chosen on
their means, and a request left at k = 0 PROBE_INTERVAL steps drafts one token.

The costs are only as good as their last measurement, and the policy measures only the pass sizes
it picks. When its choice rests on a size not timed in a while (step_cost.STALE_AFTER passes) and
would verify more drafts were that size's extra rows STALE_DOUBT times cheaper (a point timed while
the machine was busy), it verifies those drafts once, at most once per that many passes, to time
the size again; a choice that no plausible error in the table would change is not explored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.adaptive.acceptance import PRIOR_WEIGHT, AcceptanceTracker
from engine.adaptive.step_cost import STALE_AFTER, StepCostModel
from engine.draft_tree import sibling_ranks
from engine.request import Request
from engine.step.layout import DraftProposal
from engine.step.scheduler_output import SchedulerOutput
from engine.step.types import SampledTokens

# speculate only when the model predicts at least this much more throughput than plain decoding:
# the margin absorbs noise in the measured costs
MIN_RELATIVE_GAIN = 0.03
# a request left at k = 0 this many steps in a row drafts one token, so a request whose text turned
# predictable is noticed (costs at most one extra row per PROBE_INTERVAL steps); only requests whose
# cut drafts are not tested for free (module docstring)
PROBE_INTERVAL = 16
# width of the lower bound a one-hot chain is valued at in a large batch (times 1 - 1/B: none
# alone): at batch 8, a request's first drafts kept 5 times in a row count as ~0.45 (not 0.97),
# an offer length it never tested as ~0.05 (not the prior's 0.5)
SKEPTICISM = 2.5
# a stale cost point may be off by this factor (timed while other work ran): the choice is explored
# only if rows this much cheaper would change it
STALE_DOUBT = 2.0


@dataclass
class _Offer:
    """The draft a proposer offered a request before the policy's cut."""

    num_offered: int  # its length
    chain: list[int] | None  # its tokens, of a chain (None: a tree)


def geometric_chances(alphas: np.ndarray, depth: int) -> np.ndarray:
    """[batch, depth] α^j: the emission chances of requests whose every position has acceptance α."""
    return np.asarray(alphas, dtype=float)[:, None] ** np.arange(1, depth + 1)[None, :]


def best_draft_lengths(chances: np.ndarray, caps: np.ndarray, num_known_tokens: int,
                       verify_seconds: Callable[[np.ndarray], np.ndarray],
                       draft_seconds: Callable[[int], float],
                       num_expected_tokens: float | None = None) -> np.ndarray:
    """k per request ([batch] int) maximising expected emitted tokens / predicted step seconds.

    chances: [batch, >= max cap] the chance each draft position is accepted, non-increasing along a
    row; caps: [batch] the most drafts each may take;
    num_known_tokens: tokens the step computes whatever k is (decode rows + prefill chunks);
    num_expected_tokens: tokens it emits with k = 0 (default: one per request).
    """
    batch = len(caps)
    max_depth = int(caps.max(initial=0))
    if max_depth == 0 or not (chances[:, :max_depth] > 0).any():
        return np.zeros(batch, dtype=np.int64)
    base_emitted = float(batch if num_expected_tokens is None else num_expected_tokens)
    plain_rate = base_emitted / (float(verify_seconds(np.array([num_known_tokens]))[0])
                                 + draft_seconds(0))
    positions = np.arange(1, max_depth + 1)
    # gains[i, j-1]: expected extra tokens from request i's draft at position j
    gains = np.where(positions[None, :] <= caps[:, None], chances[:, :max_depth],
                     0.0)  # [batch, max_depth]
    best_rate, best_depth, best_chosen = plain_rate * (1 + MIN_RELATIVE_GAIN), 0, None
    for depth in range(1, max_depth + 1):
        flat = gains[:, :depth].ravel()
        order = np.argsort(-flat, kind="stable")
        order = order[flat[order] > 0]
        if not len(order):
            continue
        num_drafts = np.arange(1, len(order) + 1)
        rates = (base_emitted + np.cumsum(flat[order])) / (
            verify_seconds(num_known_tokens + num_drafts) + draft_seconds(depth))
        best = int(rates.argmax())
        if rates[best] > best_rate:
            best_rate, best_depth, best_chosen = rates[best], depth, order[:best + 1]
    if best_chosen is None:
        return np.zeros(batch, dtype=np.int64)
    # NOTE: a row's gains fall with depth, so the chosen positions of each row are a prefix
    return np.bincount(best_chosen // best_depth, minlength=batch)


class AdaptiveSpeculation:
    """Per-request k for the engine: learns costs and acceptance from the steps it sees."""

    def __init__(self, has_soft_drafts: bool = True, drafts_first: bool = False) -> None:
        """`has_soft_drafts`: the proposer samples its drafts from a q (a model drafter), so a seeded
        request's text depends on its draft lengths and must keep its cap; one-hot drafts (n-gram,
        suffix) leave a seeded request's text as without speculation, so its k may adapt too.
        `drafts_first`: the proposer drafts before the choice (Proposer.drafts_for_free), so each
        cap is the draft it offered, and a chain's acceptance is read for drafts offered that long
        (acceptance.py)."""
        self.has_soft_drafts = has_soft_drafts
        self.drafts_first = drafts_first
        self.cost = StepCostModel()
        self.acceptance = AcceptanceTracker()
        # request id -> steps in a row it could have drafted but was given k = 0
        self._steps_without_drafts: dict[str, int] = {}
        # request id -> (drafts, their ranks in the proposer's tree) of the tree this step's
        # verification checks, when the policy cut it (keep_best); the cuts made this step wait in
        # _new_cuts until this step's verifications are observed
        self._cuts: dict[str, tuple[list[int], list[int]]] = {}
        self._new_cuts: dict[str, tuple[list[int], list[int]] | None] = {}
        # request id -> the draft offered before the cut, for the verification of this step
        # (_offered) and of the next (_new_offered), as with the cuts
        self._offered: dict[str, _Offer] = {}
        self._new_offered: dict[str, _Offer] = {}
        # the cost model's pass count at the last exploration: at most one per STALE_AFTER passes,
        # so a busy batch whose sizes vary (prefill chunks) pays for at most that share of them
        self._explored_at = -STALE_AFTER

    def choose(self, requests: Sequence[Request], caps: Sequence[int], num_prefill_tokens: int,
               trees: Sequence[list[int] | None] | None = None) -> list[int]:
        """k for each decoding request of the next step, each at most its cap. `trees`: of requests
        whose drafts already exist, each one's tree (its parents) or None for a chain; a tree's k
        keeps its k likeliest nodes (`keep_best`).

        With soft drafts, a seeded sampling request keeps its cap: rejection sampling against q
        uses its keyed random numbers per draft, so a k that followed measured timings would make
        its text differ run to run. With one-hot drafts its text is the text without speculation
        whatever k is (engine/sample/keyed_random.py), so it adapts like any other request.
        """
        if not requests:
            return []
        trees = trees if trees is not None else [None] * len(requests)
        skepticism = SKEPTICISM * (1.0 - 1.0 / len(requests))
        is_fixed = [self.has_soft_drafts and r.params.seed is not None and not r.params.is_greedy
                    for r in requests]
        adaptive = [i for i, keep in enumerate(is_fixed) if not keep]
        fixed = [i for i, keep in enumerate(is_fixed) if keep]
        num_known = len(requests) + num_prefill_tokens + sum(caps[i] for i in fixed)
        expected = len(adaptive) + sum(
            1.0 + float(self._gains(requests[i], caps[i], trees[i]).sum()) for i in fixed)
        min_depth = max((caps[i] for i in fixed), default=0)
        chosen = list(caps)
        if adaptive and self.cost.is_ready:
            depth = max(caps[i] for i in adaptive)
            gains = np.zeros((len(adaptive), depth))
            for row, i in enumerate(adaptive):
                doubt = skepticism if self._learns_for_free(trees[i]) else 0.0
                gains[row, :caps[i]] = self._gains(requests[i], caps[i], trees[i], doubt)
            adaptive_caps = np.array([caps[i] for i in adaptive])

            def draft_seconds(depth: int) -> float:
                return self.cost.draft_seconds(max(depth, min_depth))

            lengths = best_draft_lengths(gains, adaptive_caps, num_known, self.cost.step_seconds,
                                         draft_seconds, expected)
            explored = self._explore(gains, adaptive_caps, num_known, lengths, draft_seconds,
                                     expected)
            for i, k in zip(adaptive, (lengths if explored is None else explored).tolist()):
                chosen[i] = k if explored is not None else self._probe(
                    requests[i].request_id, caps[i], k, self._learns_for_free(trees[i]))
        return chosen

    def _explore(self, gains: np.ndarray, caps: np.ndarray, num_known: int, lengths: np.ndarray,
                 draft_seconds: Callable[[int], float], expected: float) -> np.ndarray | None:
        """The drafts to verify instead of `lengths` to time a stale pass size again, or None."""
        all_drafts = int(caps.sum())
        if (int(lengths.sum()) == all_drafts or not self.cost.is_stale(num_known + all_drafts)
                or self.cost.num_observed - self._explored_at < STALE_AFTER):
            return None
        plain = float(self.cost.step_seconds(np.array([num_known]))[0])

        def doubted_seconds(num_tokens: np.ndarray) -> np.ndarray:
            return plain + (self.cost.step_seconds(num_tokens) - plain) / STALE_DOUBT

        wider = best_draft_lengths(gains, caps, num_known, doubted_seconds, draft_seconds,
                                   expected)
        # NOTE: doubted once per period, explored or not: the doubt costs a second choice
        self._explored_at = self.cost.num_observed
        if int(wider.sum()) <= int(lengths.sum()):
            return None  # the table could be that wrong and the choice would still stand
        # NOTE: this pass measures a stale point again: a choice resting on a point timed while the
        # machine was busy (start-up calibration beside other processes) would otherwise never
        # revisit it and keep drafts short for good
        return wider

    def _learns_for_free(self, tree: list[int] | None) -> bool:
        """A cut draft of this request is tested by the token its step emits (module docstring)."""
        return self.drafts_first and not self.has_soft_drafts and tree is None

    def keep_best(self, request_id: str, proposal: DraftProposal, k: int) -> DraftProposal:
        """The proposal cut to k drafts: a chain's first k, a tree's k likeliest nodes."""
        self._new_offered[request_id] = _Offer(
            len(proposal.token_ids), None if proposal.is_tree else list(proposal.token_ids))
        if not proposal.is_tree or k >= len(proposal.token_ids):
            self._new_cuts[request_id] = None
            return proposal.first(k)
        chances = self.acceptance.tree_chances(request_id, proposal.parents)
        # NOTE: ties go to the earlier node, so a parent (never less likely) comes before its child
        kept = sorted(sorted(range(len(chances)), key=lambda j: -chances[j])[:k])
        cut = proposal.keep(kept)
        ranks = sibling_ranks(proposal.parents)
        self._new_cuts[request_id] = (cut.token_ids, [ranks[j] for j in kept])
        return cut

    def _gains(self, request: Request, cap: int, parents: list[int] | None,
               skepticism: float = 0.0) -> np.ndarray:
        """[cap] expected tokens from each draft, best first: a chain's positions in order, a
        tree's nodes by their chance of being kept; with `skepticism`, at the lower bound of the
        request's first-draft acceptance (module docstring)."""
        request_id = request.request_id
        num_offered = cap if self.drafts_first and parents is None else None
        if parents is None:
            gains = self.acceptance.emission_chances(request_id, cap, num_offered)
        else:
            gains = np.sort(self.acceptance.tree_chances(request_id, parents))[::-1][:cap]
        if skepticism == 0.0 or parents is not None or not len(gains):
            return gains
        # NOTE: only the first draft is doubted: whether a request's drafts start right is what
        # its own few verifications measure; how far a started draft holds (a copied passage) the
        # engine learns from every request's deeper positions
        first = float(gains[0])  # a chain's first draft: its emission chance is a_1
        evidence = self.acceptance.first_draft_evidence(request_id, num_offered)
        lower = wilson_lower_bound(first, evidence + PRIOR_WEIGHT, skepticism)
        return gains * (lower / first) if first > 0.0 else gains

    def _probe(self, request_id: str, cap: int, k: int, learns_for_free: bool = False) -> int:
        if cap == 0:  # it could not draft (budget spent, or a proposer with nothing to offer)
            return 0
        if k > 0:
            self._steps_without_drafts.pop(request_id, None)
            return k
        if learns_for_free:  # its step tests the cut draft anyway: a probe would add nothing
            return 0
        waited = self._steps_without_drafts.get(request_id, 0) + 1
        if waited >= PROBE_INTERVAL:
            self._steps_without_drafts.pop(request_id, None)
            return 1
        self._steps_without_drafts[request_id] = waited
        return 0

    def observe_step(self, scheduled: SchedulerOutput, sampled: list[SampledTokens],
                     chosen_ks: list[int], target_pass_seconds: float, verify_seconds: float,
                     draft_seconds: float) -> None:
        """Learn from one engine step: the target pass (timed as calibration times it), the rest of
        its verification (scheduling, commit), its drafting, and each verification's acceptance."""
        self.cost.observe_verify(scheduled.num_batched_tokens, target_pass_seconds)
        self.cost.observe_overhead(verify_seconds - target_pass_seconds)
        if chosen_ks:
            self.cost.observe_draft(max(chosen_ks), draft_seconds)
        for item, kept in zip(scheduled.sampling, sampled):
            if kept.error is not None:
                continue
            request_id = item.request.request_id
            offer = self._offered.get(request_id)
            num_tested, num_accepted = item.num_draft_tokens, len(kept.token_ids) - 1
            if (offer is not None and offer.chain is not None
                    and self._learns_for_free(item.draft_parents)):
                num_tested, num_accepted = tested_for_free(offer.chain, item.draft_token_ids,
                                                           kept.token_ids)
            if not num_tested:
                continue
            cut = self._cuts.get(request_id)
            # NOTE: the scheduler may have verified a prefix of the cut (its token budget)
            ranks = (cut[1][:item.num_draft_tokens]
                     if cut and cut[0][:item.num_draft_tokens] == item.draft_token_ids
                     else None)
            self.acceptance.observe(request_id, num_tested, num_accepted, item.draft_parents,
                                    kept.accepted_drafts, ranks,
                                    offer.num_offered if offer is not None else None)
        for request_id, cut in self._new_cuts.items():
            if cut is None:
                self._cuts.pop(request_id, None)
            else:
                self._cuts[request_id] = cut
        self._new_cuts.clear()
        self._offered.update(self._new_offered)
        self._new_offered.clear()

    def free(self, request_id: str) -> None:
        self.acceptance.free(request_id)
        self._cuts.pop(request_id, None)
        self._new_cuts.pop(request_id, None)
        self._offered.pop(request_id, None)
        self._new_offered.pop(request_id, None)
        self._steps_without_drafts.pop(request_id, None)


def tested_for_free(offered: list[int], verified: list[int], emitted: list[int]) -> tuple[int, int]:
    """(drafts tested, drafts kept) of a one-hot chain `offered` of which the step verified the
    prefix `verified` and emitted `emitted` (kept drafts, then the recovered or bonus token).

    When every verified draft was kept and the offer went on, the emitted token after them is the
    target's own token at the next offered draft's position: the draft would have been kept exactly
    when it equals that token (greedy; a keyed sample's Gumbel-max token, or a fresh sample drawn
    with the same chance p(draft)). So that draft counts as tested, at no row's cost."""
    num_verified, num_kept = len(verified), len(emitted) - 1
    if (num_kept < num_verified or num_verified >= len(offered)
            or offered[:num_verified] != verified):
        return num_verified, num_kept
    return num_verified + 1, num_kept + int(emitted[-1] == offered[num_verified])


def wilson_lower_bound(rate: float, num_observed: float, spreads: float) -> float:
    """The Wilson score interval's lower end for a rate seen over `num_observed` trials, `spreads`
    standard deviations wide: unlike mean - spreads * sd, it stays skeptical of a rate near 1 seen a
    few times (3 of 3 kept is no proof that drafts hold)."""
    z2, n = spreads * spreads, num_observed
    centre = rate + z2 / (2.0 * n)
    margin = spreads * math.sqrt(rate * (1.0 - rate) / n + z2 / (4.0 * n * n))
    return max(0.0, (centre - margin) / (1.0 + z2 / n))
