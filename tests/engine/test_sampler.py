"""engine/sample/: greedy argmax without probabilities, per-row top-k / top-p masks, the inverse-CDF draw
against its target distribution, seeded determinism whatever the batch, min_tokens bans and logprobs;
plain decoding goes through the rejection sampler with k = 0."""

from __future__ import annotations

import pytest
import torch

import engine.step.rejection as rejection_module
from engine.request import Request
from engine.sample.drafting import sample_drafts
from engine.sample.logprobs import compute_logprobs
from engine.sample.sampler import DRAW_BLOCK, draw_tokens, target_probs
from engine.sampling_params import SamplingParams
from engine.step.layout import StepLayout
from engine.step.rejection import RejectionSampler
from engine.step.types import SampledTokens, ScheduledRequest
from kernels.rejection_reference import inverse_cdf, to_fixed_point
from tests.helpers.one_request_law import apply_top_k_top_p, request_q

EOS = 0
VOCAB = 6
# a fixed distribution, deliberately not sorted: index -> probability
P = [0.05, 0.30, 0.02, 0.15, 0.38, 0.10]


def make_request(request_id: str = "a", num_output_tokens: int = 0, **params: object) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams(**params), frozenset({EOS}))
    request.output_token_ids = [5] * num_output_tokens
    return request


def layout_of(requests: list[Request], drafts: list[list[int]] | None = None) -> StepLayout:
    """A step where every request samples: 1 + k rows each (k = 0 without drafts)."""
    drafts = drafts or [[] for _ in requests]
    items = [ScheduledRequest(r, 1 + len(d), is_sampling=True, draft_token_ids=d)
             for r, d in zip(requests, drafts)]
    return StepLayout.build(items, torch.device("cpu"))


def sample(logits: torch.Tensor, requests: list[Request],
           drafts: list[list[int]] | None = None) -> list[SampledTokens]:
    return RejectionSampler()(logits, layout_of(requests, drafts))


def log_p() -> torch.Tensor:
    return torch.tensor(P, dtype=torch.float64).log()  # [VOCAB]


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


# ---------------------------------------------------------------- greedy


def test_greedy_rows_pick_argmax_without_probabilities_or_random_numbers(monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("an all-greedy step needs no p and no uniforms")

    monkeypatch.setattr(rejection_module, "target_probs", forbidden)
    monkeypatch.setattr(rejection_module, "draw_uniforms", forbidden)
    torch.manual_seed(0)
    logits = torch.randn(4, 50)  # [rows, vocab]
    requests = [make_request(f"r{i}", temperature=0.0, top_k=3, top_p=0.5) for i in range(4)]
    tokens = sample(logits, requests)
    assert [t.token_ids[0] for t in tokens] == logits.argmax(dim=-1).tolist()
    assert all(t.logprobs is None for t in tokens)


def test_greedy_rows_beside_random_rows_still_pick_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)  # [rows, vocab]
    requests = [make_request(f"r{i}", temperature=0.0 if i % 2 else 1.5) for i in range(6)]
    tokens = sample(logits, requests)
    argmax = logits.argmax(dim=-1).tolist()
    assert [tokens[i].token_ids[0] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


# ---------------------------------------------------------------- top-k / top-p

# sorted probabilities: 0.38 (4), 0.30 (1), 0.15 (3), 0.10 (5), 0.05 (0), 0.02 (2)
@pytest.mark.parametrize("top_k, top_p, expected", [
    (None, 1.0, {0, 1, 2, 3, 4, 5}),
    (1, 1.0, {4}),
    (3, 1.0, {4, 1, 3}),
    (6, 1.0, {0, 1, 2, 3, 4, 5}),
    (None, 0.2, {4}),          # the top token alone already reaches top_p
    (None, 0.5, {4, 1}),       # 0.38 < 0.5 <= 0.68
    (None, 0.8, {4, 1, 3}),    # 0.68 < 0.8 <= 0.83
    (None, 0.9, {4, 1, 3, 5}),
    (None, 1e-6, {4}),         # the top token always survives
    (2, 0.9, {4, 1}),          # top-k first, then the nucleus of what is left
    (4, 0.5, {4, 1}),          # renormalised over 4 tokens: 0.409 < 0.5 <= 0.731
])
def test_top_k_top_p_keep_set(top_k: int | None, top_p: float, expected: set[int]) -> None:
    masked = apply_top_k_top_p(log_p(), top_k, top_p)
    assert kept(masked) == expected
    finite = torch.isfinite(masked)
    torch.testing.assert_close(masked[finite], log_p()[finite])  # survivors are untouched


def test_top_k_top_p_work_row_by_row() -> None:
    logits = torch.stack([log_p(), log_p().roll(1)])  # [2, VOCAB]
    masked = apply_top_k_top_p(logits, 2, 0.6)
    assert kept(masked[0]) == {4, 1}
    assert kept(masked[1]) == {5, 2}


def test_a_drafters_q_applies_temperature_then_masks() -> None:
    logits = log_p().float()
    probs = request_q(logits, SamplingParams(temperature=0.5, top_k=3))
    expected = torch.zeros(VOCAB)
    expected[[4, 1, 3]] = (logits[[4, 1, 3]] / 0.5).softmax(dim=-1)
    torch.testing.assert_close(probs, expected)


def test_per_row_parameters_transform_each_row_as_its_own_request() -> None:
    """One batched call over rows of different temperature, top-k and top-p (and k) equals each
    request's distribution computed alone: no row borrows a neighbour's parameters."""
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=3),
              SamplingParams(top_p=0.8), SamplingParams(temperature=0.5, top_k=10, top_p=0.6),
              SamplingParams(temperature=0.0), SamplingParams(top_k=60)]
    requests = [Request(f"r{i}", [1], p, frozenset({EOS})) for i, p in enumerate(params)]
    drafts = [[1, 2], [], [3], [], [4, 5, 6], [7]]
    layout = layout_of(requests, drafts)
    logits = torch.randn(layout.num_rows, 50) * 3  # [rows, vocab]
    probs = target_probs(logits, layout.sampling_metadata)
    for index, request in enumerate(requests):
        rows = layout.rows_of(index)
        if request.params.is_greedy:
            continue
        torch.testing.assert_close(probs[rows.start:rows.stop],
                                   request_q(logits[rows.start:rows.stop], request.params),
                                   rtol=0, atol=0)


# ---------------------------------------------------------------- the inverse-CDF draw


def drafts_drawn(logits: torch.Tensor, num_draws: int, **params: object) -> list[int]:
    """num_draws drafts of one seeded request at the same position, in one drafting pass."""
    request = make_request("d", **params)
    tokens, _ = sample_drafts(logits.float().expand(num_draws, -1), [request] * num_draws,
                              [[] for _ in range(num_draws)])
    return tokens


def test_a_drafters_draws_match_q() -> None:
    num_draws = 20_000
    counts = torch.bincount(torch.tensor(drafts_drawn(log_p(), num_draws, seed=1234)),
                            minlength=VOCAB)
    chisquare = pytest.importorskip("scipy.stats").chisquare
    assert chisquare(counts.tolist(), [p * num_draws for p in P]).pvalue > 1e-4


@pytest.mark.parametrize("vocab", [7, DRAW_BLOCK, 3 * DRAW_BLOCK + 5])
def test_draw_tokens_is_the_reference_inverse_cdf(vocab: int) -> None:
    """The two-level draw finds the reference's token exactly: across block edges, at u = 0 and
    u just below 1, on rows with zeros, and on rows without mass (the fallback)."""
    gen = torch.Generator().manual_seed(vocab)
    probs = (torch.randn(64, vocab, generator=gen) * 3).softmax(dim=-1)  # [64, vocab]
    probs[::5] = torch.where(torch.rand(13, vocab, generator=gen) < 0.7, 0.0, probs[::5])
    probs[7] = 0.0
    uniforms = torch.rand(64, generator=gen, dtype=torch.float64)
    uniforms[:2] = torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)
    fallback = torch.arange(64) + 1
    expected = inverse_cdf(to_fixed_point(probs), uniforms, fallback)
    assert torch.equal(draw_tokens(probs, uniforms, fallback), expected)
    assert expected[7] == 8


def test_a_drafter_never_picks_a_masked_token() -> None:
    draws = set(drafts_drawn(log_p(), 2000, seed=0, top_k=2))
    assert draws == {4, 1}


def draws(seed: int, neighbours: int, drafts: list[int], num_steps: int = 48) -> list[list[int]]:
    """A seeded request's tokens, step after step (its drafts verified too, its output growing by
    what it kept), beside `neighbours` unseeded requests."""
    sampler = RejectionSampler()
    seeded = make_request("s", seed=seed)
    steps = []
    for _ in range(num_steps):
        requests = [make_request(f"n{i}") for i in range(neighbours)] + [seeded]
        layout = layout_of(requests, [[] for _ in range(neighbours)] + [drafts])
        logits = torch.zeros(layout.num_rows, 32)  # [rows, vocab]: uniform, every draw pure noise
        steps.append(sampler(logits, layout)[-1].token_ids)
        seeded.output_token_ids += steps[-1]
    return steps


@pytest.mark.parametrize("drafts", [[], [3, 9]], ids=["k0", "k2"])
def test_same_seed_same_tokens_whatever_the_batch(drafts: list[int]) -> None:
    torch.manual_seed(0)
    first = draws(seed=7, neighbours=1, drafts=drafts)
    torch.manual_seed(99)  # the neighbours' global stream changes; the seeded stream must not
    assert draws(seed=7, neighbours=3, drafts=drafts) == first
    assert draws(seed=8, neighbours=1, drafts=drafts) != first
    assert len({tuple(t) for t in first}) > 1


# ---------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("num_output_tokens, min_tokens, expected", [
    (0, 2, 3),   # EOS (0) and the stop token (1) are banned: the next best is 3
    (1, 2, 3),
    (2, 2, EOS),
    (5, 0, EOS),
])
def test_min_tokens_bans_eos_and_stop_tokens(num_output_tokens: int, min_tokens: int,
                                              expected: int) -> None:
    logits = torch.tensor([[9.0, 8.0, 0.0, 7.0, 1.0]])  # [1, vocab]
    request = make_request(num_output_tokens=num_output_tokens, temperature=0.0,
                           min_tokens=min_tokens, stop_token_ids=[1])
    assert sample(logits, [request])[0].token_ids == [expected]
    assert logits[0, EOS] == 9.0  # the caller's logits are not modified


def test_min_tokens_bans_only_the_rows_before_it_is_reached() -> None:
    """A verification's rows are output tokens n, n + 1, ...: only those before min_tokens are banned."""
    logits = torch.tensor([[9.0, 0.0, 5.0, 1.0]] * 3)  # [3 rows, vocab]: argmax EOS, then 2
    request = make_request(num_output_tokens=1, temperature=0.0, min_tokens=2)
    # row 0 (output token 1) bans EOS, so 2 matches the first draft; row 1 may emit EOS
    assert sample(logits, [request], [[2, 2]])[0].token_ids == [2, EOS]


# ---------------------------------------------------------------- logprobs


def test_compute_logprobs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 40)  # [rows, vocab]
    order = logits.argsort(dim=-1, descending=True)
    token_ids = [int(order[0, 0]), int(order[1, 4]), int(order[2, 39])]
    rows = compute_logprobs(logits, torch.tensor(token_ids), 5)
    expected = torch.log_softmax(logits, dim=-1)
    for row, (rank, num_top) in enumerate(zip([1, 5, 40], [3, 0, 5])):
        [lp] = rows.token_logprobs(row, [token_ids[row]], num_top)
        assert lp.token_id == token_ids[row]
        assert lp.logprob == pytest.approx(float(expected[row, token_ids[row]]), abs=1e-6)
        assert lp.rank == rank
        assert [t for t, _ in lp.top] == order[row, :num_top].tolist()
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(expected[row, order[row, :num_top]].tolist(), abs=1e-6)


def test_sampler_logprobs_are_raw_not_tempered() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 30)  # [rows, vocab]
    requests = [make_request("t", temperature=0.3, seed=1, logprobs=2), make_request("g")]
    tokens = sample(logits, requests)
    assert tokens[0].logprobs is not None and tokens[1].logprobs is None
    lp = tokens[0].logprobs[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert lp.token_id == tokens[0].token_ids[0]
    assert lp.logprob == pytest.approx(float(expected[lp.token_id]), abs=1e-6)
    assert [t for t, _ in lp.top] == expected.topk(2).indices.tolist()


def test_logprobs_of_verified_tokens_come_from_their_own_rows() -> None:
    torch.manual_seed(0)
    requests = [make_request("a", temperature=0.0), make_request("b", temperature=0.0, logprobs=1)]
    logits = torch.randn(5, 20)  # a: 2 rows, b: 3 rows
    drafts = [[int(logits[0].argmax())], [int(logits[2].argmax()), int(logits[3].argmax())]]
    tokens = sample(logits, requests, drafts)
    assert tokens[1].token_ids == logits[2:5].argmax(dim=-1).tolist()  # both drafts, then bonus
    expected = torch.log_softmax(logits[2:5], dim=-1)
    assert [lp.logprob for lp in tokens[1].logprobs] == pytest.approx(
        expected.max(dim=-1).values.tolist(), abs=1e-6)
