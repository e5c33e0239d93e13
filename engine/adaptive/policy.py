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

The costs are only as good as their last measurement, and the policy measures only the pass sizes
it picks: when its choice rests on a size not timed in a while (step_cost.STALE_AFTER passes), it
verifies every draft once, at most once per that many passes, to time it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from engine.adaptive.acceptance import AcceptanceTracker
from engine.adaptive.step_cost import STALE_AFTER, StepCostModel
from engine.draft_tree import tested_depth
from engine.request import Request
from engine.scheduler import SampledTokens, SchedulerOutput

# speculate only when the model predicts at least this much more throughput than plain decoding:
# the margin absorbs noise in the measured costs
MIN_RELATIVE_GAIN = 0.03
# a request left at k = 0 this many steps in a row drafts one token, so a request whose text turned
# predictable is noticed (costs at most one extra row per PROBE_INTERVAL steps)
PROBE_INTERVAL = 16


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
    base_emitted = float(batch if num_expected_tokens is None else num_expected_tokens)
    plain_rate = base_emitted / (float(verify_seconds(np.array([num_known_tokens]))[0])
                                 + draft_seconds(0))
    max_depth = int(caps.max(initial=0))
    if max_depth == 0:
        return np.zeros(batch, dtype=np.int64)
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

    def __init__(self) -> None:
        self.cost = StepCostModel()
        self.acceptance = AcceptanceTracker()
        # request id -> steps in a row it could have drafted but was given k = 0
        self._steps_without_drafts: dict[str, int] = {}
        # the cost model's pass count at the last exploration: at most one per STALE_AFTER passes,
        # so a busy batch whose sizes vary (prefill chunks) pays for at most that share of them
        self._explored_at = -STALE_AFTER

    def choose(self, requests: Sequence[Request], caps: Sequence[int],
               num_prefill_tokens: int) -> list[int]:
        """k for each decoding request of the next step, each at most its cap.

        A seeded sampling request keeps its cap: its random numbers are consumed per draft, so a
        k that followed measured timings would make its text differ run to run.
        """
        if not requests:
            return []
        is_fixed = [r.params.seed is not None and not r.params.is_greedy for r in requests]
        adaptive = [i for i, keep in enumerate(is_fixed) if not keep]
        fixed = [i for i, keep in enumerate(is_fixed) if keep]
        num_known = len(requests) + num_prefill_tokens + sum(caps[i] for i in fixed)
        expected = len(adaptive) + sum(
            1.0 + float(self.acceptance.emission_chances(requests[i].request_id, caps[i]).sum())
            for i in fixed)
        min_depth = max((caps[i] for i in fixed), default=0)
        chosen = list(caps)
        if adaptive and self.cost.is_ready:
            depth = max(caps[i] for i in adaptive)
            lengths = best_draft_lengths(
                np.array([self.acceptance.emission_chances(requests[i].request_id, depth)
                          for i in adaptive]).reshape(len(adaptive), depth),
                np.array([caps[i] for i in adaptive]), num_known, self.cost.step_seconds,
                lambda depth: self.cost.draft_seconds(max(depth, min_depth)), expected)
            all_drafts = sum(caps[i] for i in adaptive)
            if (int(lengths.sum()) < all_drafts and self.cost.is_stale(num_known + all_drafts)
                    and self.cost.num_observed - self._explored_at >= STALE_AFTER):
                self._explored_at = self.cost.num_observed
                # NOTE: every draft verified, so this pass measures a stale point again: a choice
                # resting on a point timed while the machine was busy (start-up calibration beside
                # other processes) would otherwise never revisit it and keep drafts short for good
                return chosen
            for i, k in zip(adaptive, lengths.tolist()):
                chosen[i] = self._probe(requests[i].request_id, caps[i], k)
        return chosen

    def _probe(self, request_id: str, cap: int, k: int) -> int:
        if cap == 0:  # it could not draft (budget spent, or a proposer with nothing to offer)
            return 0
        if k > 0:
            self._steps_without_drafts.pop(request_id, None)
            return k
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
            if item.num_draft_tokens:
                # NOTE: of a tree, the depths tested, not its node count: a path that ended at a
                # leaf was not rejected one level deeper
                accepted = kept.kept_drafts[:len(kept.token_ids) - 1]
                self.observe_verification(
                    item.request.request_id,
                    tested_depth(item.draft_parents, item.num_draft_tokens, accepted),
                    len(accepted))

    def observe_verification(self, request_id: str, num_draft_tokens: int,
                             num_accepted: int) -> None:
        self.acceptance.observe(request_id, num_draft_tokens, num_accepted)

    def free(self, request_id: str) -> None:
        self.acceptance.free(request_id)
        self._steps_without_drafts.pop(request_id, None)

