"""Adaptive speculation's choices, against brute force over every k it could have picked, on cost
curves shaped like a GPU (flat, then compute-bound) and a CPU (every token costs)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from adaptive_cases import (
    COST_SHAPES,
    DRAFT_COSTS,
    REAL_COST,
    flat_cost,
    policy_calibrated_on_a_busy_machine,
    rate,
    request,
)

from engine.adaptive import (
    AcceptanceTracker,
    AdaptiveSpeculation,
    StepCostModel,
    best_draft_lengths,
    geometric_chances,
)
from engine.adaptive.policy import MIN_RELATIVE_GAIN, PROBE_INTERVAL
from engine.adaptive.step_cost import STALE_AFTER, non_decreasing_fit
from engine.step.types import SampledTokens


def brute_force(alphas, caps, num_known, verify, draft) -> float:
    """The best rate over every k vector, or plain decoding's when nothing beats it by the margin."""
    plain = rate([0] * len(alphas), alphas, num_known, verify, draft)
    best = max(rate(ks, alphas, num_known, verify, draft)
               for ks in itertools.product(*(range(c + 1) for c in caps)))
    return best if best > plain * (1 + MIN_RELATIVE_GAIN) else plain


@pytest.mark.parametrize("shape", COST_SHAPES)
@pytest.mark.parametrize("drafting", DRAFT_COSTS)
def test_choice_is_the_brute_force_optimum(shape, drafting):
    verify, draft = COST_SHAPES[shape], DRAFT_COSTS[drafting]
    rng = np.random.default_rng(0)
    for _ in range(40):
        batch = int(rng.integers(1, 4))
        alphas = rng.choice([0.0, 0.1, 0.4, 0.7, 0.9, 0.97], size=batch)
        caps = rng.integers(0, 5, size=batch)
        num_known = batch + int(rng.choice([0, 0, 30]))  # sometimes a prefill chunk rides along
        ks = best_draft_lengths(geometric_chances(alphas, 4), caps, num_known, verify, draft)
        assert (ks <= caps).all() and (ks >= 0).all()
        got = rate(ks.tolist(), alphas, num_known, verify, draft)
        assert got == pytest.approx(brute_force(alphas, caps, num_known, verify, draft), rel=1e-9)


def test_one_request_follows_the_expected_length_formula():
    """k maximises (1 - α^(k+1)) / (1 - α) / step seconds; as α rises, k never falls."""
    verify = COST_SHAPES["cpu_linear"]
    previous = 0
    for alpha in np.linspace(0.0, 0.97, 30):
        k = int(best_draft_lengths(geometric_chances(np.array([alpha]), 8), np.array([8]), 1,
                                   verify, lambda d: 0.0)[0])
        expected = [(1 - alpha ** (j + 1)) / (1 - alpha) / verify(1 + j) for j in range(9)]
        best = int(np.argmax(expected))
        assert k == (best if expected[best] > expected[0] * (1 + MIN_RELATIVE_GAIN) else 0)
        assert k >= previous
        previous = k


def test_speculation_shrinks_as_the_batch_grows():
    """The same acceptance earns k > 0 alone and k = 0 in a big batch on a CPU-like curve, where
    each extra row costs the same but the fixed cost of a pass is shared by more requests."""
    verify = COST_SHAPES["cpu_linear"]
    ks_by_batch = {}
    for batch in (1, 4, 16, 64):
        ks = best_draft_lengths(geometric_chances(np.full(batch, 0.6), 5), np.full(batch, 5),
                                batch, verify, lambda d: 0.0)
        ks_by_batch[batch] = int(ks.max())
    assert ks_by_batch[1] > 0 and ks_by_batch[64] == 0
    assert list(ks_by_batch.values()) == sorted(ks_by_batch.values(), reverse=True)


def test_compute_bound_pass_never_speculates_and_a_flat_one_always_does():
    chances, caps = geometric_chances(np.array([0.2, 0.6, 0.9]), 4), np.array([4, 4, 4])
    assert best_draft_lengths(chances, caps, 3, COST_SHAPES["compute_bound"],
                              lambda d: 0.0).tolist() == [0, 0, 0]
    assert best_draft_lengths(chances, caps, 3, COST_SHAPES["gpu_flat_then_bound"],
                              lambda d: 0.0).tolist() == [4, 4, 4]


def test_expensive_drafting_turns_speculation_off():
    chances, caps = geometric_chances(np.array([0.7]), 4), np.array([4])
    verify = COST_SHAPES["gpu_flat_then_bound"]
    assert best_draft_lengths(chances, caps, 1, verify, lambda d: 0.001 * d)[0] > 0
    # each draft position costs as much as a target pass: drafting can only lose
    assert best_draft_lengths(chances, caps, 1, verify, lambda d: 0.010 * d)[0] == 0


def test_acceptance_follows_the_request_and_starts_from_the_engine_prior():
    tracker = AcceptanceTracker()
    for _ in range(30):
        tracker.observe("good", 4, 4)
        tracker.observe("bad", 4, 0)
    assert tracker.emission_chances("good", 4)[-1] > 0.8
    assert tracker.emission_chances("bad", 1)[0] < 0.2
    assert np.allclose(tracker.conditional_acceptance("new"), tracker.engine_acceptance)
    # half the first drafts were kept, and every kept first draft led to a kept fourth
    assert tracker.engine_acceptance[0] == pytest.approx(0.5, abs=0.05)
    assert tracker.engine_acceptance[3] > 0.9
    for _ in range(10):  # the good request's text stops being predictable
        tracker.observe("good", 4, 0)
    assert tracker.emission_chances("good", 1)[0] < 0.25
    tracker.free("good")
    assert np.allclose(tracker.conditional_acceptance("good"), tracker.engine_acceptance)


def test_a_request_copying_passages_is_told_apart_from_one_guessing():
    """Same mean acceptance per draft, different shapes: all-or-nothing drafts (a suffix match that
    holds or breaks at once) are worth going deep for; drafts that thin out with depth are not."""
    tracker = AcceptanceTracker()
    for step in range(40):
        tracker.observe("copying", 8, 8 if step % 2 else 0)
        tracker.observe("guessing", 8, 1)
    copying, guessing = tracker.emission_chances("copying", 8), tracker.emission_chances("guessing", 8)
    assert (np.diff(copying) <= 0).all() and (np.diff(guessing) <= 0).all()
    assert copying[-1] > 0.4 and guessing[1] < 0.2
    verify = COST_SHAPES["cpu_linear"]
    ks = best_draft_lengths(np.stack([copying, guessing]), np.array([8, 8]), 2, verify,
                            lambda d: 0.0)
    assert ks[0] == 8 and ks[1] <= 1


def test_cost_table_interpolates_keeps_order_and_is_pessimistic_beyond():
    cost = StepCostModel()
    for tokens, seconds in ((1, 0.010), (4, 0.012), (8, 0.011), (16, 0.020)):
        cost.observe_verify(tokens, seconds)
    predicted = cost.verify_seconds(np.array([1, 2, 4, 8, 12, 16, 32]))
    assert predicted[0] == pytest.approx(0.010) and predicted[1] == pytest.approx(0.010 + 0.0015 / 3)
    # the noisy cheaper 8-token pass is pooled with the 4-token one before it
    assert predicted[2] == predicted[3] == pytest.approx(0.0115)
    assert (np.diff(predicted) >= 0).all()
    assert predicted[-1] == pytest.approx(0.040)  # twice the tokens of the largest, twice its cost
    cost.observe_verify(16, 0.030)  # a new measurement moves the point part of the way
    assert 0.020 < cost.verify_seconds(np.array([16]))[0] < 0.030


def test_step_overhead_is_added_to_every_size():
    cost = StepCostModel()
    cost.observe_verify(1, 0.010)
    cost.observe_verify(9, 0.018)
    for _ in range(60):
        cost.observe_overhead(0.005)
    assert cost.step_seconds(np.array([1, 5])) == pytest.approx([0.015, 0.019], rel=1e-3)


def test_monotone_fit_pools_an_outlier_with_its_neighbours_only():
    fitted = non_decreasing_fit(np.array([1.0, 9.0, 2.0, 4.0, 5.0, 6.0]))
    assert fitted.tolist() == [1.0, 5.0, 5.0, 5.0, 5.0, 6.0]
    assert non_decreasing_fit(np.array([3.0, 1.0])).tolist() == [2.0, 2.0]
    assert non_decreasing_fit(np.array([1.0, 2.0])).tolist() == [1.0, 2.0]


def test_draft_cost_separates_the_fixed_part_from_each_position():
    cost = StepCostModel()
    for _ in range(60):
        cost.observe_draft(0, 0.001)
        cost.observe_draft(4, 0.001 + 4 * 0.003)
    assert cost.draft_seconds(0) == pytest.approx(0.001, rel=1e-3)
    assert cost.draft_seconds(2) == pytest.approx(0.007, rel=1e-2)



def test_a_request_left_at_zero_probes_one_draft_now_and_then():
    policy = AdaptiveSpeculation()
    policy.cost = flat_cost()
    for _ in range(20):
        policy.acceptance.observe("hopeless", 4, 0)
    ks = [policy.choose([request("hopeless", temperature=0.0)], [4], 0)[0]
          for _ in range(2 * PROBE_INTERVAL)]
    assert ks.count(1) == 2 and set(ks) == {0, 1}
    assert ks.index(1) == PROBE_INTERVAL - 1


def test_steps_with_nothing_to_draft_do_not_count_toward_a_probe():
    """A free proposer that offered no draft (cap 0) left no choice to the policy: only the steps
    where a draft existed and was dropped count, so the probe tests a real draft."""
    policy = AdaptiveSpeculation()
    policy.cost = flat_cost()
    for _ in range(20):
        policy.acceptance.observe("hopeless", 4, 0)
    hopeless = request("hopeless", temperature=0.0)
    ks = [policy.choose([hopeless], [4 if step % 2 else 0], 0)[0]
          for step in range(2 * PROBE_INTERVAL)]
    assert ks.count(1) == 1 and ks.index(1) == 2 * PROBE_INTERVAL - 1


def test_deep_positions_follow_the_engine_when_the_request_rarely_reaches_them():
    """Copied passages hold once they start: the engine has seen drafts kept whole or lost at the
    first token. A request whose last few first drafts failed has a low a_1 of its own, but its deep
    positions, which it has not reached lately, keep the engine's high estimate instead of being
    dragged down to its a_1."""
    tracker = AcceptanceTracker()
    for step in range(60):
        tracker.observe(f"earlier-{step}", 8, 8 if step % 2 else 0)
    for _ in range(3):
        tracker.observe("new", 1, 0)
    conditional = tracker.conditional_acceptance("new")
    assert conditional[0] < 0.3
    assert (conditional[1:8] > 0.9).all()


@pytest.mark.parametrize("has_soft_drafts, seeded_k", [(True, 3), (False, 0)])
def test_seeded_sampling_keeps_its_cap_only_with_soft_drafts(has_soft_drafts, seeded_k):
    """Sampled drafts make a seeded request's text depend on k, so it keeps its cap; with one-hot
    drafts its text does not depend on k, and it adapts as a greedy request does."""
    policy = AdaptiveSpeculation(has_soft_drafts=has_soft_drafts)
    policy.cost = flat_cost()
    for name in ("seeded", "greedy"):
        for _ in range(20):
            policy.acceptance.observe(name, 4, 0)
    ks = policy.choose([request("seeded", temperature=1.0, seed=7),
                        request("greedy", temperature=0.0)], [3, 3], 0)
    assert ks == [seeded_k, 0]


def test_a_point_not_measured_lately_is_stale_until_measured_again():
    cost = StepCostModel()
    for tokens in (1, 4, 16):
        cost.observe_verify(tokens, 0.010 + 0.001 * tokens)
    assert not cost.is_stale(9)  # interpolated between fresh points
    for _ in range(STALE_AFTER):
        cost.observe_verify(1, 0.011)
    assert not cost.is_stale(1)
    assert cost.is_stale(9) and cost.is_stale(16) and cost.is_stale(100)  # 4, 16 not re-measured
    cost.observe_verify(4, 0.014)
    cost.observe_verify(16, 0.026)
    assert not cost.is_stale(9) and not cost.is_stale(100)



def test_a_cost_timed_on_a_busy_machine_is_measured_again_instead_of_trusted_for_good():
    """The policy verifies every draft once, learns the real cost of that pass, and from then on
    drafts deep where the stale table kept drafts short."""
    policy = policy_calibrated_on_a_busy_machine()
    copying = request("copying", temperature=0.0)
    ks = []
    for _ in range(4):
        k = policy.choose([copying], [8], 0)[0]
        ks.append(k)
        policy.cost.observe_verify(1 + k, float(REAL_COST(1 + k)))
    assert ks[0] == 8  # the stale point is measured again
    assert ks[-1] == 8  # and, now known to be cheap, chosen for its own sake


def test_exploration_happens_at_most_once_per_stale_period():
    """A batch whose pass sizes keep changing (prefill chunks) could find a stale point every step:
    exploring stays at one pass in STALE_AFTER, so its cost is bounded."""
    policy = policy_calibrated_on_a_busy_machine()
    copying = request("copying", temperature=0.0)
    ks = []
    for _ in range(2 * STALE_AFTER):
        ks.append(policy.choose([copying], [8], 0)[0])
        policy.cost.observe_verify(1, float(REAL_COST(1)))  # the explored pass is never timed here
    assert ks.count(8) == 2 and ks.index(8) == 0 and ks[STALE_AFTER] == 8


def test_a_tree_verification_counts_first_children_by_depth_and_later_siblings_by_rank():
    """Of a tree, what was learned counts, not its node count: every child of a kept node was the
    next token or not; a path kept to a leaf says nothing one level deeper. Ranks are the
    proposer's, also when the policy cut the tree."""
    from types import SimpleNamespace

    from engine.draft_tree import verification_outcomes

    # root ─┬─ a ─ b          a, b: drafts 0, 1 (b a leaf)
    #       └─ c ─┬─ d ─ e    c, d, e: drafts 2, 3, 4; f: draft 5 (c's second child)
    #             └─ f
    parents = [-1, 0, -1, 2, 3, 2]
    assert verification_outcomes(parents, 6, [0, 1]) == ([(1, True), (2, True)], [(1, False)])
    assert verification_outcomes(parents, 6, [2, 3]) == ([(1, False), (2, True), (3, False)],
                                                         [(1, True), (1, False)])
    assert verification_outcomes(parents, 6, [2, 5]) == ([(1, False), (2, False)],
                                                         [(1, True), (1, True)])
    assert verification_outcomes(parents, 6, []) == ([(1, False)], [(1, False)])
    assert verification_outcomes(None, 4, [0, 1]) == ([(1, True), (2, True), (3, False)], [])
    # c alone, cut from the tree above: still the proposer's second guess
    assert verification_outcomes(None, 1, [0], ranks=[1]) == ([], [(1, True)])

    def acceptance_after(path: list[int]) -> AcceptanceTracker:
        policy = AdaptiveSpeculation()
        item = SimpleNamespace(request=request("tree", temperature=0.0), num_draft_tokens=6,
                               draft_token_ids=[10, 11, 12, 13, 14, 15], draft_parents=parents)
        kept = SampledTokens([7] * (len(path) + 1), accepted_drafts=path)
        for _ in range(20):
            policy.observe_step(SimpleNamespace(num_batched_tokens=7, sampling=[item]), [kept],
                                [6], 0.01, 0.011, 0.001)
        return policy.acceptance

    to_leaf, cut_short = acceptance_after([0, 1]), acceptance_after([2, 3])
    assert to_leaf.conditional_acceptance("tree")[:2].min() > 0.9
    assert cut_short.conditional_acceptance("tree")[2] < 0.2 < 0.5 <= \
        to_leaf.conditional_acceptance("tree")[2]
    # a's path fails (the first guess at depth 1 is not kept), c's is: c's chance comes from b_1
    assert cut_short.conditional_acceptance("tree")[0] < 0.1
    assert 0.3 < cut_short.sibling_acceptance[0] < 0.7  # c kept, f not, every time


def test_a_tree_is_valued_and_cut_node_by_node():
    """Each node's chance is its parent's times its own (a_depth for a first child, b_rank for a
    later sibling); the policy's cut keeps the likeliest nodes, which form a tree, and the cut is
    observed with the proposer's ranks: learning that second guesses pay survives cutting."""
    from types import SimpleNamespace

    from engine.step.layout import DraftProposal

    tracker = AcceptanceTracker()
    parents = [-1, 0, -1, 2, 3, 2]
    a, b = tracker.conditional_acceptance("fresh"), tracker.sibling_acceptance
    expected = np.empty(6)
    expected[0] = a[0]
    expected[1] = expected[0] * a[1]
    expected[2] = b[0]
    expected[3] = expected[2] * a[1]
    expected[4] = expected[3] * a[2]
    expected[5] = expected[2] * b[0]
    assert np.allclose(tracker.tree_chances("fresh", parents), expected)

    policy = AdaptiveSpeculation()
    proposal = DraftProposal([10, 11, 12, 13, 14, 15], None, parents)
    item = SimpleNamespace(request=request("r", temperature=0.0))
    for _ in range(30):
        # the proposer's second guess c is always the one kept; the policy sends the 2 likeliest
        cut = policy.keep_best("r", proposal, 2)
        kept_c = [j for j, token in enumerate(cut.token_ids) if token == 12]
        item.draft_token_ids, item.draft_parents = cut.token_ids, cut.parents
        item.num_draft_tokens = len(cut.token_ids)
        kept = SampledTokens([7] * (len(kept_c) + 1), accepted_drafts=kept_c)
        policy.observe_step(SimpleNamespace(num_batched_tokens=3, sampling=[item]), [kept],
                            [2], 0.01, 0.011, 0.001)
    chances = policy.acceptance.tree_chances("r", parents)
    # b_1 also counts f, c's second child, never kept when it was sent; a's chance is retested
    # now and then (untested, the request's counts decay back toward the engine's)
    assert chances[2] > 0.5 and chances[2] > chances[0]
    assert 12 in policy.keep_best("r", proposal, 1).token_ids
    assert policy.keep_best("r", proposal, 6) is proposal
    assert policy.keep_best("r", DraftProposal([1, 2, 3]), 2).token_ids == [1, 2]


def test_a_chain_is_recorded_as_the_tree_of_one_branch():
    """The chain fast path (slices) records what the general tree path records for a chain, past
    the last tracked position too."""
    from engine.adaptive.acceptance import MAX_POSITIONS, _PositionCounts
    from engine.draft_tree import verification_outcomes

    for num_drafts in (1, 3, 8, MAX_POSITIONS, MAX_POSITIONS + 5):
        for num_accepted in range(num_drafts + 1):
            chain, tree = _PositionCounts(), _PositionCounts()
            for counts in (chain, tree):  # something to decay first
                counts.add_chain(4, 2, 0.9)
            chain.add_chain(num_drafts, num_accepted, 0.8)
            tree.add(verification_outcomes(None, num_drafts, list(range(num_accepted)))[0], 0.8)
            assert np.array_equal(chain.accepted, tree.accepted)
            assert np.array_equal(chain.rejected, tree.rejected)
