"""Penalties, logit_bias and min_p in engine/sample/: every logits row, inside a verification block
too, equals a token-by-token reference given that row's own history (the committed output, then
the drafts before it); the draft's q gets the same transform; a step that uses none of them pays
nothing."""

from __future__ import annotations

import pytest
import torch

import engine.sample.row_laws as row_laws_module
import engine.sample.sampler as sampler_module
from engine.request import Request
from engine.sample.drafting import sample_drafts
from engine.sample.row_laws import apply_min_p
from engine.sample.sampler import process_logits, target_probs
from engine.sampling_params import SamplingParams
from engine.step.layout import StepLayout
from engine.step.rejection import RejectionSampler
from engine.step.types import ScheduledRequest

EOS = 0
VOCAB = 12


def make_request(request_id: str, prompt: list[int], output: list[int],
                 **params: object) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=64, **params), frozenset({EOS}))
    request.output_token_ids = list(output)
    return request


def layout_of(requests: list[Request], drafts: list[list[int]]) -> StepLayout:
    items = [ScheduledRequest(r, 1 + len(d), is_sampling=True, draft_token_ids=d)
             for r, d in zip(requests, drafts)]
    return StepLayout.build(items, torch.device("cpu"))


def reference_row(logits: list[float], prompt: list[int], history: list[int],
                  params: SamplingParams, banned: set[int] = frozenset()) -> list[float]:
    """One row, token by token, as a reader of vLLM's docs would write it: bans and logit_bias,
    then repetition (prompt or output so far), then frequency and presence (output so far)."""
    bias = dict(params.logit_bias)
    out = []
    for token, value in enumerate(logits):
        value = float("-inf") if token in banned else value + bias.get(token, 0.0)
        count = history.count(token)
        if token in prompt or count:
            r = params.repetition_penalty
            value = value / r if value > 0 else value * r
        value -= params.frequency_penalty * count
        value -= params.presence_penalty * (count > 0)
        out.append(value)
    return out


# request, its drafts: repeated draft tokens, tokens already in the output, a prompt token, and a
# request beside them without any of the parameters
CASES = [
    ({"frequency_penalty": 1.5}, [5, 5, 3], [5, 5, 5]),
    ({"presence_penalty": -0.7, "temperature": 0.0}, [2], [2, 7, 2]),
    ({"repetition_penalty": 1.8}, [9, 4], [4, 4, 9]),
    ({}, [1, 2], [3]),
    ({"repetition_penalty": 0.6, "frequency_penalty": 0.3, "presence_penalty": 0.4,
      "logit_bias": {4: 2.5, 7: -100, 11: 0.25}}, [4, 7], [7, 7]),
    ({"logit_bias": {3: 1.0}, "min_tokens": 6}, [3], [3, 0]),
    ({"frequency_penalty": 2.0, "presence_penalty": 2.0}, [], []),  # prefill: empty output
]


def case_requests() -> tuple[list[Request], list[list[int]]]:
    requests, drafts = [], []
    for index, (params, output, draft) in enumerate(CASES):
        prompt = [1, 8, 9, 6]
        requests.append(make_request(f"r{index}", prompt, output, **params))
        drafts.append(draft)
    return requests, drafts


def test_every_row_equals_the_token_by_token_reference() -> None:
    requests, drafts = case_requests()
    layout = layout_of(requests, drafts)
    torch.manual_seed(0)
    logits = torch.randn(layout.num_rows, VOCAB, dtype=torch.float64) * 3  # [rows, vocab]
    got = process_logits(logits, layout.sampling_metadata, layout.draft_token_ids)
    for index, (request, draft) in enumerate(zip(requests, drafts)):
        for j, row in enumerate(layout.rows_of(index)):
            history = request.output_token_ids + draft[:j]
            banned = {EOS} if len(history) < request.params.min_tokens else set()
            want = reference_row(logits[row].tolist(), request.prompt_token_ids, history,
                                 request.params, banned)
            assert got[row].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12), (index, j)
    untouched = layout.rows_of(3)
    assert torch.equal(got[untouched.start:untouched.stop], logits[untouched.start:untouched.stop])


def test_a_repeated_draft_is_rejected_where_plain_decoding_would_not_repeat() -> None:
    """Greedy with a strong frequency penalty: the raw argmax is token 4 at every row. Decoding one
    token at a time gives 4, then (4 counted once) still 4, then not 4; so of drafts [4, 4, 4] the
    first two are kept and the third row picks the runner-up, token 6."""
    request = make_request("g", [1, 2], [], temperature=0.0, frequency_penalty=1.0)
    logits = torch.zeros(4, VOCAB, dtype=torch.float64)
    logits[:, 4] = 3.5
    logits[:, 6] = 2.0
    sampled = RejectionSampler()(logits, layout_of([request], [[4, 4, 4]]))
    assert sampled[0].token_ids == [4, 4, 6]


def test_greedy_uses_the_biased_logits() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 10.0
    requests = [make_request("ban", [1], [], temperature=0.0, logit_bias={5: -100}),
                make_request("pick", [1], [], temperature=0.0, logit_bias={9: 100})]
    sampled = RejectionSampler()(logits, layout_of(requests, [[], []]))
    assert sampled[0].token_ids != [5] and sampled[1].token_ids == [9]


def test_logprobs_stay_raw() -> None:
    """Logprobs are the target's before any processing (vLLM's default), penalties or not."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    request = make_request("l", [1], [], temperature=0.0, logit_bias={7: 100}, logprobs=1)
    [sampled] = RejectionSampler()(logits, layout_of([request], [[]]))
    assert sampled.token_ids == [7]
    assert sampled.logprobs[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[7]))


# ---------------------------------------------------------------- min_p


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_keeps_tokens_at_least_min_p_times_the_top(min_p: float) -> None:
    probs = torch.tensor([0.05, 0.30, 0.02, 0.15, 0.38, 0.10], dtype=torch.float64)
    masked = apply_min_p(probs.log()[None], torch.tensor([min_p]))[0]
    assert torch.isfinite(masked).tolist() == (probs >= min_p * probs.max()).tolist()


def test_min_p_comes_after_temperature_and_before_top_k_top_p() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 40, dtype=torch.float64) * 2
    params = {"temperature": 0.5, "min_p": 0.05, "top_k": 6, "top_p": 0.8}
    request = make_request("m", [1], [], **params)
    layout = layout_of([request], [[]])
    probs = target_probs(logits, layout.sampling_metadata)[0].double()
    # the reference: temperature, min_p on probabilities, top-k, top-p, renormalise
    p = (logits[0] / 0.5).softmax(-1)
    keep = (p >= 0.05 * p.max()).nonzero().flatten().tolist()
    keep = sorted(keep, key=lambda t: -float(p[t]))[:6]
    mass = p[keep] / p[keep].sum()
    cut = int((mass.cumsum(0) - mass < 0.8).sum())
    want = torch.zeros_like(p)
    want[keep[:cut]] = p[keep[:cut]] / p[keep[:cut]].sum()
    torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the draft's q


@pytest.mark.parametrize("index", [0, 1, 2, 4, 5])
def test_draft_q_gets_the_same_transform_at_its_position(index: int) -> None:
    """A drafting pass's q at draft position j equals p's transform at verification row j."""
    requests, drafts = case_requests()
    request, draft = requests[index], drafts[index]
    layout = layout_of(requests, drafts)
    torch.manual_seed(3)
    logits = torch.randn(layout.num_rows, VOCAB, dtype=torch.float64) * 3
    processed = process_logits(logits, layout.sampling_metadata, layout.draft_token_ids)
    for j, row in enumerate(layout.rows_of(index)):
        [token], q = sample_drafts(logits[row][None], [request], [draft[:j]])
        q = None if q is None else q[0]
        if request.params.is_greedy:
            assert token == int(processed[row].argmax())
            continue
        want = (processed[row] / request.params.temperature).softmax(-1)
        torch.testing.assert_close(q.double(), want, rtol=1e-5, atol=1e-7)
        assert q[token] > 0


# ---------------------------------------------------------------- the fast path


def test_a_step_without_these_parameters_builds_and_does_nothing(monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("no request uses penalties")

    monkeypatch.setattr(sampler_module, "apply_penalties", forbidden)
    monkeypatch.setattr(row_laws_module, "apply_min_p", forbidden)
    requests = [make_request("a", [1, 2], [3, 3], temperature=0.7, top_k=3),
                make_request("b", [1], [4], temperature=0.0)]
    layout = layout_of(requests, [[3, 3], [4]])
    metadata = layout.sampling_metadata
    assert (metadata.penalties, metadata.logit_bias, metadata.min_p) == (None, None, None)
    logits = torch.randn(layout.num_rows, VOCAB)
    assert process_logits(logits, metadata, layout.draft_token_ids) is logits
    RejectionSampler()(logits, layout)


def test_only_the_penalised_requests_rows_are_built() -> None:
    requests = [make_request("a", [1], [3], temperature=0.7),
                make_request("b", [2, 2], [5, 6], presence_penalty=1.0),
                make_request("c", [1], [], temperature=0.0)]
    layout = layout_of(requests, [[1, 2], [5, 5, 5], []])
    penalties = layout.sampling_metadata.penalties
    assert penalties.rows.tolist() == list(layout.rows_of(1))
    assert penalties.prompt is None  # no repetition penalty: no prompt tokens sent
    # rows 1, 2, 3 of "b" see 1, 2, 3 of its drafts (drafts 2, 3, 4 of the step)
    pair_rows, pair_drafts = penalties.draft_pairs
    assert list(zip(pair_rows.tolist(), pair_drafts.tolist())) == [
        (1, 2), (2, 2), (2, 3), (3, 2), (3, 3), (3, 4)]
