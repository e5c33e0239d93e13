"""Percentiles, TPOT and goodput arithmetic on hand-made request outcomes."""

from __future__ import annotations

import pytest

from loadtest.client import RequestOutcome
from loadtest.stats import (
    distribution_fields,
    goodput,
    meets_slos,
    parse_slo,
    time_per_output_token,
)


def done(ttft: float, latency: float, output_len: int) -> RequestOutcome:
    return RequestOutcome(is_success=True, start_time=0.0, status_code=200, ttft=ttft,
                          latency=latency, output_len=output_len)


def test_distribution_is_in_milliseconds_with_linear_percentiles():
    fields = distribution_fields("ttft", [i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert fields["mean_ttft_ms"] == pytest.approx(50.5)
    assert fields["median_ttft_ms"] == pytest.approx(50.5)
    assert fields["p50_ttft_ms"] == pytest.approx(50.5)
    assert fields["p90_ttft_ms"] == pytest.approx(90.1)
    assert fields["p99_ttft_ms"] == pytest.approx(99.01)
    assert fields["std_ttft_ms"] == pytest.approx(28.866, abs=1e-3)


def test_an_empty_sample_has_no_statistics():
    fields = distribution_fields("itl", [])
    assert set(fields) == {"mean_itl_ms", "median_itl_ms", "std_itl_ms", "p50_itl_ms",
                           "p90_itl_ms", "p99_itl_ms"}
    assert all(value is None for value in fields.values())


def test_tpot_spreads_the_time_after_the_first_token():
    assert time_per_output_token(done(ttft=0.5, latency=2.5, output_len=5)) == pytest.approx(0.5)
    assert time_per_output_token(done(ttft=0.5, latency=0.5, output_len=1)) is None


def test_goodput_counts_requests_within_every_slo():
    outcomes = [
        done(ttft=0.1, latency=1.1, output_len=11),   # tpot 100 ms: good
        done(ttft=0.3, latency=1.3, output_len=11),   # ttft too slow
        done(ttft=0.1, latency=3.1, output_len=11),   # tpot 300 ms: too slow
        done(ttft=0.1, latency=0.1, output_len=1),    # no tpot to judge: good
        RequestOutcome(is_success=False, start_time=0.0, error="HTTP 429: full"),
    ]
    slos = {"ttft": 200.0, "tpot": 150.0}
    assert [meets_slos(o, slos) for o in outcomes] == [True, False, False, True, False]
    assert goodput(outcomes, slos, duration_s=4.0) == pytest.approx(0.5)
    assert goodput(outcomes, {}, duration_s=4.0) is None


def test_slo_parsing():
    assert parse_slo("ttft:500") == ("ttft", 500.0)
    assert parse_slo("e2el:1e4") == ("e2el", 10_000.0)
    for bad in ("ttft", "itl:5", "tpot:fast", "tpot:-1", "tpot:inf"):
        with pytest.raises(ValueError):
            parse_slo(bad)
