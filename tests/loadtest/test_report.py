"""The result of a run: counts that add up, per-request arrays per completed request, tables, and
a JSON file that strict parsers accept."""

from __future__ import annotations

import json

import pytest

from loadtest.client import RequestOutcome
from loadtest.metrics_scrape import SpecCounters
from loadtest.report import (
    PER_REQUEST_FIELDS,
    RUN_FIELDS,
    build_run_result,
    format_run,
    format_summary,
    write_result_file,
)
from loadtest.runner import CANCELLED_ERROR, RunOutcome

SETTINGS = {"label": "ngram", "base_url": "http://127.0.0.1:8000", "model": "m",
            "endpoint": "chat", "dataset": "synthetic", "request_rate": 2.0, "burstiness": 1.0,
            "max_concurrency": None, "max_requests": 4, "duration_limit_s": 10.0,
            "max_tokens": 16, "temperature": 0.0, "speculative_config": None}


def a_run() -> RunOutcome:
    ok = RequestOutcome(True, 0.0, 200, "", 10, 5, 0.2, [0.1, 0.1, 0.2, 0.2], 0.8, "hello")
    ok2 = RequestOutcome(True, 0.5, 200, "", 12, 1, 0.3, [], 0.3, "x")
    refused = RequestOutcome(False, 0.6, 429, "HTTP 429: queue full")
    cancelled = RequestOutcome(False, 0.7, None, f"{CANCELLED_ERROR} (10 s)")
    return RunOutcome([ok, ok2, refused, cancelled], duration=2.0)


def test_counts_add_up_and_arrays_follow_completed_requests():
    result = build_run_result(SETTINGS, a_run(), SpecCounters("ngram", 4, 12, 6, {1: 3}),
                              {"ttft": 250.0})
    assert set(RUN_FIELDS) | set(PER_REQUEST_FIELDS) | {"errors"} <= set(result)
    assert (result["sent"], result["completed"], result["failed"], result["cancelled"]) == (
        4, 2, 2, 1)
    assert result["error_counts"] == {"HTTP 429": 1, "cancelled": 1}
    assert result["errors"] == ["HTTP 429: queue full", f"{CANCELLED_ERROR} (10 s)"]
    assert all(len(result[name]) == 2 for name in PER_REQUEST_FIELDS)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (22, 6)
    assert result["output_throughput"] == pytest.approx(6 / 2.0)
    assert result["request_throughput"] == pytest.approx(2 / 2.0)
    assert result["request_goodput"] == pytest.approx(1 / 2.0)  # only the 200 ms TTFT one
    assert result["tpots"] == [pytest.approx(0.15), None]
    assert result["p50_itl_ms"] == pytest.approx(150.0)
    assert result["acceptance_rate"] == pytest.approx(0.5)
    assert result["mean_acceptance_length"] == pytest.approx(2.5)


def test_without_metrics_the_speculation_fields_are_empty():
    result = build_run_result(SETTINGS, a_run(), None, {})
    assert result["metrics_available"] is False
    assert result["acceptance_rate"] is None and result["request_goodput"] is None
    assert "no /metrics" in format_run(result)


def test_tables_and_the_result_file(tmp_path):
    runs = [build_run_result(SETTINGS | {"label": label, "request_rate": rate}, a_run(), None, {})
            for label, rate in (("none", "inf"), ("ngram", 2.0))]
    block = format_run(runs[1])
    assert "4 / 2 / 2" in block and "TTFT" in block
    summary = format_summary(runs).splitlines()
    assert len(summary) == 4 and "inf" in summary[2]
    path = tmp_path / "out" / "result.json"
    write_result_file(path, runs, ["specserve-loadtest", "--qps", "2"])
    document = json.loads(path.read_text(), parse_constant=pytest.fail)  # no NaN / Infinity
    assert [run["label"] for run in document["runs"]] == ["none", "ngram"]
    assert document["command_line"][-1] == "2"


def test_settings_must_be_complete():
    with pytest.raises(ValueError, match="lack"):
        build_run_result({"label": "x"}, a_run(), None, {})
