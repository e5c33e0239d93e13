"""A per-request output is one RequestReport field, filled in RequestReport.of: it crosses the engine
queue, reaches the offline LLM's completions and the HTTP response's `metrics` without a line
elsewhere."""

from __future__ import annotations

import dataclasses

import server.api_responses as api_responses_module
from engine.messages import EngineOutputs, decode, encode
from engine.request import Request
from engine.request_report import RequestReport
from engine.sampling_params import SamplingParams
from engine.spec_stats import SpecStats
from engine.step.types import RequestUpdate
from server.api_responses import ResponseMetrics


def test_the_report_is_read_from_the_requests_fields_of_the_same_names() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(), frozenset({0}))
    request.spec_stats.observe(3, 2, 3)
    request.num_cached_tokens = 16
    report = RequestReport.of(request)
    for field in dataclasses.fields(RequestReport):
        assert getattr(report, field.name) == getattr(request, field.name), field.name


def test_the_report_crosses_the_queue_whole() -> None:
    stats = SpecStats()
    stats.observe(4, 1, 2)
    update = RequestUpdate("r", [5], report=RequestReport(stats, num_cached_tokens=32))
    (got,) = decode(encode(EngineOutputs([update]))).updates
    assert got.report == update.report and type(got.report.spec_stats) is SpecStats
    assert (got.spec_stats, got.num_cached_tokens) == (stats, 32)


@dataclasses.dataclass
class ReportWithPreemptions(RequestReport):
    num_preemptions: int = 0


def test_a_number_the_report_gains_reaches_the_http_metrics(monkeypatch) -> None:
    """Summed over the choices, under its own name; the numbers with places of their own (the
    speculation payload, usage's cached tokens) are not repeated."""
    assert set(ResponseMetrics.of([RequestReport()], 3).model_dump()) == {"speculative_decoding"}
    monkeypatch.setattr(api_responses_module, "RequestReport", ReportWithPreemptions)
    reports = [ReportWithPreemptions(num_cached_tokens=8, num_preemptions=2),
               ReportWithPreemptions(num_preemptions=1)]
    dumped = ResponseMetrics.of(reports, num_spec_tokens=3).model_dump()
    assert dumped["num_preemptions"] == 3
    assert set(dumped) == {"speculative_decoding", "num_preemptions"}
