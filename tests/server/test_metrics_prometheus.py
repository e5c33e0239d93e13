"""A real Prometheus scrapes ServerMetrics and evaluates the documented PromQL for α and τ, so the
expressions in server/metrics.py are checked against the query engine, not against our arithmetic."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_server import PrometheusServer, find_prometheus_binary

from engine.messages import StepStats
from server.metrics import ACCEPTANCE_RATE_PROMQL, BLOCK_EFFICIENCY_PROMQL, ServerMetrics

# NOTE: CI sets SPECSERVE_REQUIRE_PROMETHEUS=1 (.ci/run installs the package), so there a missing
# binary fails instead of skipping
pytestmark = pytest.mark.skipif(
    find_prometheus_binary() is None and not os.environ.get("SPECSERVE_REQUIRE_PROMETHEUS"),
    reason="needs the prometheus binary (apt-get install -y prometheus; .ci/run installs it)")

# Every step verifies two k=4 drafts, accepting 3 and 2 tokens: α = 5/8, τ = 1 + 5/2.
# NOTE: feeding the same step keeps every counter in a fixed ratio at every scrape, so rate()'s
# extrapolation scales numerator and denominator alike and the ratios come out exact.
STEP = StepStats(num_running=2, num_generation_tokens=7, num_drafts=2, num_draft_tokens=8,
                 num_accepted_tokens=5, accepted_per_position=[2, 2, 1, 0], accepted_lengths=[3, 2])
EXPECTED_ACCEPTANCE_RATE = 5 / 8
EXPECTED_BLOCK_EFFICIENCY = 1 + 5 / 2
MEDIAN_ACCEPTANCE_LENGTH_PROMQL = (
    "histogram_quantile(0.5, rate(specserve:spec_decode_acceptance_length_bucket[1m]))")
FEED_INTERVAL_S = 0.2
TEST_DEADLINE_S = 30.0


@contextmanager
def serving(metrics: ServerMetrics) -> Iterator[str]:
    """Serve metrics.render() on 127.0.0.1 from a background thread; yields "host:port"."""

    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, content_type = metrics.render()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # keep scrapes out of the test output

    server = ThreadingHTTPServer(("127.0.0.1", 0), MetricsHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def feeding(metrics: ServerMetrics, stats: StepStats, interval_s: float) -> Iterator[None]:
    """Observe `stats` every interval_s in the background, so counters grow between scrapes."""
    stop = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            metrics.observe_step(stats)
            stop.wait(interval_s)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def test_prometheus_computes_alpha_and_tau_from_scraped_series():
    deadline = time.monotonic() + TEST_DEADLINE_S

    def time_left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    metrics = ServerMetrics("tiny", "ngram", num_speculative_tokens=4)
    with (serving(metrics) as target,
          PrometheusServer(target, ready_timeout_s=10) as prometheus,
          feeding(metrics, STEP, FEED_INTERVAL_S)):
        acceptance_rate = prometheus.wait_for_number(ACCEPTANCE_RATE_PROMQL, timeout_s=time_left())
        block_efficiency = prometheus.wait_for_number(BLOCK_EFFICIENCY_PROMQL,
                                                      timeout_s=time_left())
        median_acceptance_length = prometheus.wait_for_number(MEDIAN_ACCEPTANCE_LENGTH_PROMQL,
                                                              timeout_s=time_left())
        [configured_k] = prometheus.query("specserve:spec_decode_num_speculative_tokens")

    assert acceptance_rate == pytest.approx(EXPECTED_ACCEPTANCE_RATE, rel=1e-6)
    assert block_efficiency == pytest.approx(EXPECTED_BLOCK_EFFICIENCY, rel=1e-6)
    # half the drafts accept 2 tokens and half 3: the median falls on the upper edge of bucket le=2
    assert median_acceptance_length == pytest.approx(2.0, abs=1e-6)
    assert configured_k["value"][1] == "4"
    assert configured_k["metric"]["model_name"] == "tiny"
    assert configured_k["metric"]["spec_method"] == "ngram"
