"""The engine queue's codec (engine/messages.py): every message, and the SamplingParams, RequestUpdate,
SpecStats, logprobs and finish reasons inside them, arrive as the objects that were sent, equal
field for field, tuples as tuples; a request's parameters are not validated a second time; anything
else is refused."""

from __future__ import annotations

import pytest

import engine.sampling_params as sampling_params_module
from engine.messages import (
    AddRequest,
    EngineOutputs,
    StepStats,
    decode,
    encode,
)
from engine.request import FinishReason, TokenLogprobs
from engine.request_report import RequestReport
from engine.sampling_params import SamplingParams
from engine.spec_stats import SpecStats
from engine.step.types import RequestUpdate


def spec_stats() -> SpecStats:
    stats = SpecStats(verify_seconds=0.25, draft_seconds=0.125)
    for drafts, accepted in ((4, 2), (4, 0), (0, 0), (3, 3)):
        stats.observe(num_draft_tokens=drafts, num_accepted=accepted, num_emitted=accepted + 1)
    return stats


def test_a_request_arrives_with_its_parameters_as_sent(monkeypatch):
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=2**62, max_tokens=64,
                            stop=["END", "\n\n"], stop_token_ids=[3, 9], n=2, logprobs=5,
                            min_tokens=4, presence_penalty=0.5, repetition_penalty=1.2,
                            logit_bias={7: -2.0, 11: 1.5}, min_p=0.05)
    data = encode(AddRequest("r1", [1, 2, 3], params, cache_salt="tenant"))

    def validated_again(self):
        raise AssertionError("SamplingParams was validated a second time")

    monkeypatch.setattr(sampling_params_module.SamplingParams, "__post_init__", validated_again)
    message = decode(data)
    assert message == AddRequest("r1", [1, 2, 3], params, cache_salt="tenant")
    assert type(message.params) is SamplingParams
    assert message.params.stop == ("END", "\n\n") and message.params.logit_bias == ((7, -2.0),
                                                                                    (11, 1.5))
    assert hash(message.params) == hash(params)


def test_a_step_arrives_with_every_count_and_logprob():
    logprobs = [TokenLogprobs(5, -0.25, 1, [(5, -0.25), (8, -1.5)])]
    outputs = EngineOutputs(
        [RequestUpdate("a", [5], logprobs, finish_reason=FinishReason.STOP, stop_reason=2,
                    report=RequestReport(spec_stats(), num_cached_tokens=16)),
         RequestUpdate("b", [6, 7])],
        StepStats(num_running=2, accepted_per_position=[2, 1], accepted_lengths=[2, 0]))
    got = decode(encode(outputs))
    assert got == outputs
    assert got.updates[0].finish_reason is FinishReason.STOP
    assert type(got.updates[0].spec_stats) is SpecStats
    assert got.updates[0].spec_stats.mean_acceptance_length == 1 + 5 / 3
    assert got.updates[0].new_logprobs[0].top == [(5, -0.25), (8, -1.5)]


def test_a_type_the_codec_does_not_know_is_refused():
    with pytest.raises(TypeError, match="cannot cross the engine queue"):
        encode(RequestUpdate("a", [1], report=RequestReport(spec_stats=object())))
