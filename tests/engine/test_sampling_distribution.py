"""Sampled tokens follow the target's distribution through the whole engine, with enough tokens per
case that a 1% total-variation error is caught with probability >= 0.95 at a false-alarm rate of
1e-3. Deliberately broken samplers fail the same check.

The target is a real (tiny) Llama checkpoint wired as a bigram model: its attention and MLP outputs
are zero, so the next-token distribution depends only on the previous token, P[a] = softmax(L[a]).
Every emitted token, at every position and on every path (plain sampling, an accepted draft, a
recovered or a bonus token), must be a draw from P[previous token] after the request's temperature,
top-k and top-p. Because the previous token changes from position to position, a row of p or q taken
from the wrong position shows up too. P comes from transformers in float64, and the transforms are
written out here rather than borrowed from engine/.

The check itself lives in tests/helpers/sampling_law.py; every other proposer is checked in
test_sampling_distribution_proposers.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import sampling_law
import torch
from sampling_law import (
    EPSILON,
    FULL_EPSILON,
    TARGET_LOGITS,
    VOCAB,
    Case,
    K,
    assert_follows_target,
    chain_verdict,
    degrees_of_freedom,
    recover_from_p,
    reference_probs,
    required_num_tokens,
    sample,
)

import engine.sample.row_laws as row_laws_module
import engine.step.rejection as rejection_module
import kernels.rejection_reference as reference_module
from kernels import rejection_sample_reference

# the bigram model and its logits (tests/helpers/sampling_law.py), as this module's fixtures
restore_threads = sampling_law.restore_threads
target = sampling_law.target
draft = sampling_law.draft
target_logits = sampling_law.target_logits


# ---- the check itself ------------------------------------------------------------------------
def test_the_check_has_the_power_it_claims():
    """Simulated counts, no engine: with required_num_tokens tokens, an error of exactly EPSILON
    (each row moved in its hardest direction, mass shifted in proportion to p between two halves)
    is caught in >= 95% of trials, and a correct sampler passes."""
    probs = reference_probs(torch.tensor(TARGET_LOGITS), Case())  # [vocab, vocab]
    df = degrees_of_freedom(probs)
    num_tokens = required_num_tokens(df)
    moved = probs.clone()
    for a, p in enumerate(probs):
        # the split of row a's tokens into two sides with masses closest to 1/2 minimises chi2div
        side = min((torch.tensor([b in s for b in range(VOCAB)])
                    for r in range(1, VOCAB) for s in itertools.combinations(range(VOCAB), r)),
                   key=lambda s: abs(float(p[s].sum()) - 0.5))
        moved[a] = torch.where(side, p * (1 + EPSILON / p[side].sum()),
                               p * (1 - EPSILON / p[~side].sum()))
    stationary = torch.linalg.matrix_power(probs, 200)[0]  # visits per previous token
    row_totals = np.round(num_tokens * stationary.numpy()).astype(np.int64)
    rng = np.random.default_rng(0)
    rejections = {"correct": 0, "moved": 0}
    num_trials = 400
    for name, table in (("correct", probs), ("moved", moved)):
        for _ in range(num_trials):
            counts = np.stack([rng.multinomial(n, table[a].numpy())
                               for a, n in enumerate(row_totals)])
            rejections[name] += chain_verdict(counts, probs).rejects
    assert 0.5 * float((moved - probs).abs().sum(dim=1).max()) == pytest.approx(EPSILON)
    assert rejections["moved"] >= 0.92 * num_trials, rejections  # 0.95 expected, 0.011 s.d.
    assert rejections["correct"] <= 3, rejections  # 0.4 expected


# ---- the engine ------------------------------------------------------------------------------
PLAIN_CASES = [Case(temperature=0.7), Case(temperature=1.3, top_k=3),
               Case(temperature=1.0, top_p=0.8)]


@pytest.mark.promise("sampling-law")
@pytest.mark.parametrize("case", PLAIN_CASES, ids=str)
def test_plain_sampling_follows_the_target(target, target_logits, case):
    probs = reference_probs(target_logits, case)
    result = sample(target, case, probs, seed=1_000_000 * PLAIN_CASES.index(case))
    assert_follows_target(result, probs)


SPEC_CASES = {
    # one-hot drafts: x is accepted with probability p(x), else recovered from p with x removed
    "ngram": (Case(temperature=1.3), {"method": "ngram", "num_speculative_tokens": K,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    # drafts drawn from q != p, itself tempered and truncated like p
    "draft_model": (Case(temperature=0.7, top_k=3, top_p=0.9),
                    {"method": "draft_model", "num_speculative_tokens": K}),
}


@pytest.mark.promise("sampling-law")
@pytest.mark.parametrize("method", SPEC_CASES)
def test_speculative_sampling_follows_the_target(target, draft, target_logits, method):
    case, config = SPEC_CASES[method]
    if method == "draft_model":
        config = {**config, "model": draft}
    probs = reference_probs(target_logits, case)
    result = sample(target, case, probs, seed=7_000_000, speculative_config=config)
    assert_follows_target(result, probs)
    # most tokens came through verification, and both outcomes of the test happened often
    num_rejected = result.num_draft_tokens - result.num_accepted_tokens
    num_tokens = int(result.counts.sum())
    assert result.num_accepted_tokens > 0.1 * num_tokens, result
    assert num_rejected > 0.1 * num_tokens, result


# ---- broken samplers: the same check must reject them ----------------------------------------
def accept_with_probability_p(**args):
    """Accepts draft x with probability p(x) instead of min(1, p(x)/q(x)): the reference accepts
    when u * q(x) < p(x), so it is handed u / q(x)."""
    if args["draft_probs"] is None:  # a step without drafts to accept
        return rejection_sample_reference(**args)
    q_of_draft = args["draft_probs"].gather(1, args["draft_token_ids"][:, None])[:, 0]
    args["acceptance_uniforms"] = args["acceptance_uniforms"].double() / q_of_draft.double()
    return rejection_sample_reference(**args)


def bonus_from_the_last_draft_row(**args):
    """Off by one in the layout: draws the bonus token from the last draft's row of p, not from
    the row after it."""
    cu = args["cu_num_draft_tokens"]
    num_drafts = torch.diff(cu, prepend=cu.new_zeros(1))
    bonus_row = cu + torch.arange(len(cu))  # request i's rows are cu[i-1] + i .. cu[i] + i
    shifted = bonus_row[num_drafts > 0]
    probs = args["target_probs"].clone()
    probs[shifted] = probs[shifted - 1]
    return rejection_sample_reference(**dict(args, target_probs=probs))


def temperature_after_top_p(logits, metadata):
    """Truncates (top-k, top-p) the untempered distribution, then applies the temperature."""
    rows = metadata.request_of_row
    kept = row_laws_module.apply_top_k(logits.float(), metadata.top_k[rows], metadata.max_top_k)
    kept = row_laws_module.apply_top_p(kept, metadata.top_p[rows])
    return (kept / metadata.temperature[rows, None]).softmax(dim=-1)


DRAFT_T1 = (Case(temperature=1.0), {"method": "draft_model", "num_speculative_tokens": K})
BROKEN = {
    "accepts_with_p_not_min_1_p_over_q": (rejection_module, "rejection_sample",
                                          accept_with_probability_p, DRAFT_T1),
    "recovers_from_p_not_the_residual": (reference_module, "recovery_weights",
                                         recover_from_p, DRAFT_T1),
    "bonus_from_the_last_draft_row": (rejection_module, "rejection_sample",
                                      bonus_from_the_last_draft_row, DRAFT_T1),
    "temperature_after_top_p": (rejection_module, "target_probs", temperature_after_top_p,
                                (Case(temperature=0.7, top_k=3, top_p=0.9), None)),
}


@pytest.mark.promise("sampling-law-canaries")
@pytest.mark.parametrize("bug", BROKEN)
def test_a_broken_sampler_is_caught(target, draft, target_logits, monkeypatch, bug):
    """Each bug is a TV error of several percent, far above EPSILON, so a tenth of the tokens
    already rejects it; the check is chain_verdict, as above."""
    module, name, replacement, (case, config) = BROKEN[bug]
    monkeypatch.setattr(module, name, replacement)
    if config is not None:
        config = {**config, "model": draft}
    probs = reference_probs(target_logits, case)
    result = sample(target, case, probs, seed=9_000_000, speculative_config=config, fraction=0.1,
                    epsilon=FULL_EPSILON)
    verdict = chain_verdict(result.counts, probs)
    assert verdict.rejects, f"{bug} went unnoticed: {verdict}"


