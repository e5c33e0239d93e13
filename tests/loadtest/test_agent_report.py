"""The agent-loop report's arithmetic on hand-made requests: tokens per second of request time and
of wall time, τ = Σ(steps + accepted) / Σ steps per kind and overall, and failures left out."""

from __future__ import annotations

import pytest

from loadtest.agent_loop import AgentLoopOutcome, AgentLoopPlan, AgentRequest
from loadtest.agent_report import (
    KindSummary,
    build_agent_result,
    format_agent_comparison,
    format_agent_result,
)
from loadtest.client import RequestOutcome, SamplingOptions
from loadtest.target import Endpoint

ENDPOINT = Endpoint("http://127.0.0.1:9", "tiny", "chat", None)
PLAN = AgentLoopPlan(num_sessions=1, num_turns=2, max_tool_calls_per_turn=3,
                     sampling=SamplingOptions(64), duration_s=60.0, max_concurrency=None)


def request(kind: str, tokens: int, latency: float, steps: int = 0, accepted: int = 0,
            drafted: int = 0, error: str = "") -> AgentRequest:
    spec = {"num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted}
    outcome = RequestOutcome(is_success=not error, start_time=0.0, error=error,
                             output_len=tokens, ttft=latency / 2, latency=latency,
                             spec_decoding=spec if steps else None)
    return AgentRequest(kind, session=0, turn=0, outcome=outcome)


REQUESTS = [
    request("call", tokens=20, latency=1.0, steps=10, accepted=10, drafted=40),
    request("call", tokens=10, latency=1.0, steps=5, accepted=5, drafted=20),
    request("answer", tokens=60, latency=2.0, steps=20, accepted=40, drafted=80),
    request("answer", tokens=0, latency=0.0, error="cancelled at the duration limit (60 s)"),
]


def test_a_kind_summary_sums_completed_requests_only():
    answers = KindSummary.of(REQUESTS[2:])
    assert (answers.num_sent, answers.num_completed, answers.num_failed) == (2, 1, 1)
    assert answers.tokens_per_request_second == pytest.approx(60 / 2.0)
    assert answers.mean_acceptance_length == pytest.approx((20 + 40) / 20)
    assert answers.acceptance_rate == pytest.approx(40 / 80)


def test_the_result_per_kind_and_overall():
    outcome = AgentLoopOutcome(REQUESTS, [[]], num_sessions_finished=0, duration=8.0)
    result = build_agent_result("suffix", ENDPOINT, PLAN, {"method": "suffix"}, outcome)
    call, answer, overall = (result["kinds"][name] for name in ("call", "answer", "overall"))
    assert call["tokens_per_request_second"] == pytest.approx(30 / 2.0)
    assert call["output_throughput"] == pytest.approx(30 / 8.0)
    assert call["mean_acceptance_length"] == pytest.approx((15 + 15) / 15)
    assert overall["output_tokens"] == 90
    assert overall["tokens_per_request_second"] == pytest.approx(90 / 4.0)
    assert overall["output_throughput"] == pytest.approx(90 / 8.0)
    # τ pools steps: (10+5+20 steps + 10+5+40 accepted) / 35 steps, not a mean of per-request τ
    assert overall["mean_acceptance_length"] == pytest.approx(90 / 35)
    assert (overall["sent"], overall["failed"], answer["failed"]) == (4, 1, 1)
    assert result["error_counts"] == {"cancelled": 1}
    assert len(result["requests"]) == 4
    assert "answer" in format_agent_result(result)


def test_without_speculation_tau_is_unknown_and_ratios_compare_to_the_first_run():
    plain = [request("call", tokens=30, latency=3.0), request("answer", tokens=60, latency=6.0)]
    base = build_agent_result("none", ENDPOINT, PLAN, None,
                              AgentLoopOutcome(plain, [[]], 1, duration=10.0))
    assert base["kinds"]["overall"]["mean_acceptance_length"] is None
    assert base["kinds"]["overall"]["acceptance_rate"] is None
    fast = build_agent_result("suffix", ENDPOINT, PLAN, {"method": "suffix"},
                              AgentLoopOutcome(REQUESTS, [[]], 0, duration=8.0))
    table = format_agent_comparison([base, fast]).splitlines()
    assert table[2].split()[-2:] == ["1.00", "1.00"]
    # x req: (90 / 4 s) / (90 / 9 s); x wall: (90 / 8 s) / (90 / 10 s)
    assert table[3].split()[-2:] == [f"{9 / 4:.2f}", f"{10 / 8:.2f}"]
