"""The law of seeded sampling is still the target's p (issue 28): keyed uniforms, the keyed
inverse-CDF token deciding one-hot drafts (chains and trees), and rejection sampling with keyed
uniforms for soft drafts. Sampler-level runs over a 4-token bigram target, one step of 16,000
requests each with its own seed and output position, sized so that a 2% total-variation error is
caught with probability >= 0.95 at a false-alarm rate of 1e-3; broken variants of the keys fail
the same check in the same run.

Every emitted token, accepted draft or final token, must follow P[previous token] (Anderson-
Goodman chi-square over the transitions, as tests/engine/test_sampling_distribution.py argues)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2
from tiers import is_quick

import engine.sample.metadata as metadata_module
from engine.request import Request
from engine.sample.keyed_random import SAMPLE_STREAM
from engine.sampling_params import SamplingParams
from engine.step.layout import StepLayout
from engine.step.rejection import RejectionSampler
from engine.step.types import ScheduledRequest

VOCAB = 4
# row a: the target's logits after token a (the bigram P)
TARGET_LOGITS = torch.tensor([[2.0, 0.5, -0.5, 1.0], [0.0, 1.8, 1.2, -1.0],
                              [1.5, -0.8, 0.3, 1.1], [-0.6, 0.9, 2.2, 0.4]])
P = TARGET_LOGITS.double().softmax(dim=-1)  # [VOCAB, VOCAB]
# one-hot drafts are drawn from P itself (each kept with probability p(x)); soft ones from Q, P's
# logits shifted by one token, so a draft is kept about half the time and max(0, p - q) spreads
# over 2-3 tokens (a residual on one token would hide a biased draw)
Q = TARGET_LOGITS.roll(1, dims=1).softmax(dim=-1)  # [VOCAB, VOCAB] float32
# NOTE: the quick tier (`--quick`) checks for twice the error on a third of the requests; the
# broken keys (canaries) are always run on FULL_NUM_REQUESTS // 4, as in the full suite
FULL_NUM_REQUESTS = 16_000
NUM_REQUESTS = 5_000 if is_quick() else FULL_NUM_REQUESTS
# a chain of 3, and a tree: d0 -> d1 -> d2 under the newest token, d3 its second child
SHAPES = {"chain": None, "tree": [-1, 0, 1, -1]}
EPSILON, ALPHA, POWER = (0.04 if is_quick() else 0.02), 1e-3, 0.95


def required_num_tokens(df: int) -> int:
    """Tokens that catch a TV error of EPSILON with probability POWER (the derivation is in
    test_sampling_distribution.required_num_tokens): lambda* / (4 EPSILON^2)."""
    critical = chi2.isf(ALPHA, df)
    lam = brentq(lambda x: ncx2.sf(critical, df, x) - POWER, 1e-3, 1e4)
    return math.ceil(lam / (4 * EPSILON**2))


def pvalue(counts: np.ndarray) -> tuple[float, int]:
    """(Pearson's chi-square p-value of transition counts [prev, emitted] against P, tokens)."""
    row_totals = counts.sum(axis=1, keepdims=True)
    expected = row_totals * P.numpy()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(statistic, VOCAB * (VOCAB - 1))), int(counts.sum())


def sample_step(shape: str, soft: bool, num_requests: int = NUM_REQUESTS) -> np.ndarray:
    """One sampler step over `num_requests` seeded requests (seed 10^6 + i, output position
    i mod 53, newest token i mod 4), each verifying 4 drafts, one-hot ones drawn from P, soft ones
    from q = Q; returns the [VOCAB, VOCAB] transition counts of what they emitted."""
    gen = torch.Generator().manual_seed(len(shape) + 2 * soft)
    parents = SHAPES[shape] or [-1, 0, 1, 2]
    newest = torch.arange(num_requests) % VOCAB  # [num_requests]
    contexts, drafts = [], []  # per draft slot: [num_requests] the token it follows, and its own
    for parent in parents:
        contexts.append(newest if parent < 0 else drafts[parent])
        drafter = Q if soft else P.float()
        drafts.append(torch.multinomial(drafter[contexts[-1]], 1, generator=gen)[:, 0])
    drafts_t, contexts_t = torch.stack(drafts, 1), torch.stack(contexts, 1)  # [num_requests, 4]
    q = Q[contexts_t] if soft else None  # [num_requests, 4, VOCAB]
    items = []
    for i, request_drafts in enumerate(drafts_t.tolist()):
        request = Request(f"r{i}", [1, i % VOCAB], SamplingParams(seed=10**6 + i), frozenset())
        request.output_token_ids = [i % VOCAB] * (i % 53)
        items.append(ScheduledRequest(request, 1 + len(parents), True, request_drafts,
                                      None if q is None else q[i], SHAPES[shape]))
    rows = torch.cat([newest[:, None], drafts_t], 1).reshape(-1)  # [num_rows] each row's context
    layout = StepLayout.build(items, torch.device("cpu"))
    sampled = RejectionSampler()(TARGET_LOGITS[rows], layout)  # [num_rows, VOCAB] logits
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for i, kept in enumerate(sampled):
        previous = [i % VOCAB] + kept.token_ids[:-1]
        np.add.at(counts, (previous, kept.token_ids), 1)
    return counts


def keys_at_the_request_position(seed: int, num_output_tokens: int, parents: list[int] | None,
                                 num_drafts: int) -> list[tuple[int, int, int]]:
    """Broken: every row keyed at the request's position, not its own (no depth added)."""
    keys = ORIGINAL_KEYS(seed, num_output_tokens, parents, num_drafts)
    return [(s, num_output_tokens, stream) for s, _, stream in keys]


def acceptance_on_the_sample_stream(seed: int, num_output_tokens: int, parents: list[int] | None,
                                    num_drafts: int) -> list[tuple[int, int, int]]:
    """Broken: a draft's acceptance uniform is the sample uniform of its position."""
    keys = ORIGINAL_KEYS(seed, num_output_tokens, parents, num_drafts)
    return [(s, position, SAMPLE_STREAM) for s, position, _ in keys]


ORIGINAL_KEYS = metadata_module.uniform_keys
BROKEN: dict[str, tuple[Callable, bool]] = {
    "one_hot_keyed_at_the_request_position": (keys_at_the_request_position, False),
    "soft_acceptance_on_the_sample_stream": (acceptance_on_the_sample_stream, True),
}


@pytest.mark.promise("sampling-law")
@pytest.mark.parametrize("soft", [False, True], ids=["one_hot", "soft"])
@pytest.mark.parametrize("shape", SHAPES)
def test_seeded_tokens_follow_the_target(shape: str, soft: bool) -> None:
    counts = sample_step(shape, soft)
    p, num_tokens = pvalue(counts)
    assert num_tokens >= required_num_tokens(VOCAB * (VOCAB - 1)), num_tokens
    assert num_tokens > 1.5 * NUM_REQUESTS  # many drafts were kept, many rejected (< 4 each)
    assert p > ALPHA, f"seeded {shape} ({'soft' if soft else 'one-hot'}): p-value {p:.2e}"


@pytest.mark.promise("sampling-law-canaries")
@pytest.mark.parametrize("bug", BROKEN)
def test_broken_keys_are_caught(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    """Each bug moves the law by far more than EPSILON: a quarter of the requests catch it."""
    replacement, soft = BROKEN[bug]
    monkeypatch.setattr(metadata_module, "uniform_keys", replacement)
    p, num_tokens = pvalue(sample_step("chain", soft, FULL_NUM_REQUESTS // 4))
    assert p < ALPHA, f"{bug} went unnoticed: p-value {p:.2e} over {num_tokens} tokens"
