"""Prometheus export: folds the engine's StepStats and the HTTP layer's request timings into
`specserve:*` series on a registry this object owns (the engine never imports prometheus_client).

Speculation quality in PromQL (DESIGN.md vocabulary; the constants below hold the same text):

- acceptance rate α = rate(specserve:spec_decode_num_accepted_tokens_total[1m])
                      / rate(specserve:spec_decode_num_draft_tokens_total[1m])
  Why: the share of proposed draft tokens the target kept, i.e. how well the proposer guesses.
- block efficiency τ = 1 + rate(specserve:spec_decode_num_accepted_tokens_total[1m])
                           / rate(specserve:spec_decode_num_drafts_total[1m])
  Why: tokens a speculating request gets per target pass (accepted + the bonus or recovered token);
  it bounds the speed-up over plain decoding, so it is what to weigh against the drafting cost.
- mean k chosen = rate(specserve:spec_decode_k_chosen_total[1m])
                  / rate(specserve:spec_decode_k_choices_total[1m])
  share of requests speculating = rate(specserve:spec_decode_speculating_choices_total[1m])
                                  / rate(specserve:spec_decode_k_choices_total[1m])
  Why: with adaptive speculation, k per request follows cost and acceptance; these show how much
  speculation the engine judged worth its cost (fixed k: the configured k within request caps).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from engine.messages import StepStats

ACCEPTANCE_RATE_PROMQL = (
    "rate(specserve:spec_decode_num_accepted_tokens_total[1m])"
    " / rate(specserve:spec_decode_num_draft_tokens_total[1m])"
)
BLOCK_EFFICIENCY_PROMQL = (
    "1 + rate(specserve:spec_decode_num_accepted_tokens_total[1m])"
    " / rate(specserve:spec_decode_num_drafts_total[1m])"
)
MEAN_CHOSEN_K_PROMQL = (
    "rate(specserve:spec_decode_k_chosen_total[1m])"
    " / rate(specserve:spec_decode_k_choices_total[1m])"
)
SPECULATING_SHARE_PROMQL = (
    "rate(specserve:spec_decode_speculating_choices_total[1m])"
    " / rate(specserve:spec_decode_k_choices_total[1m])"
)

# one bucket per accepted count, so per-length shares can be read off exactly
ACCEPTANCE_LENGTH_BUCKETS = tuple(float(n) for n in range(17))
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
# NOTE: starts well below 10 ms: speculation makes several tokens arrive per target pass, so
# inter-token gaps of a millisecond or less are normal and must not all land in the first bucket.
INTER_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                       50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000,
                       50_000, 100_000)
# engine.request.FinishReason values, created up front so rate() sees them start at zero
FINISH_REASONS = ("stop", "length", "abort", "error")

_BASE_LABELS = ("model_name", "spec_method")


class ServerMetrics:
    """All specserve:* series for one served model. Owns its CollectorRegistry (never the global
    one), so several servers or tests can live in one process."""

    def __init__(self, model_name: str, speculative_method: str | None,
                 num_speculative_tokens: int) -> None:
        self.registry = CollectorRegistry()
        self._base = {"model_name": model_name, "spec_method": speculative_method or "none"}
        # NOTE: one lock around every update and every render, so a scrape never sees half a step
        # (α and τ from a single scrape are then exact ratios of what the engine reported).
        self._lock = threading.Lock()
        # the engine's running totals as last seen, per counter fed from one
        self._last_totals: dict[str, int] = {}

        # ---------------------------------------------------------------- scheduler state
        self._num_running = self._gauge("specserve:num_requests_running",
                                        "Requests in the running batch.")
        self._num_waiting = self._gauge("specserve:num_requests_waiting",
                                        "Requests queued, waiting to be scheduled.")
        self._kv_cache_usage = self._gauge("specserve:kv_cache_usage_perc",
                                           "Fraction of KV-cache blocks in use (0..1).")
        self._num_preemptions = self._counter("specserve:num_preemptions_total",
                                              "Requests preempted to free KV-cache blocks.")
        self._prefix_cache_queries = self._counter(
            "specserve:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache (requests of a tenant, caching on).")
        self._prefix_cache_hits = self._counter(
            "specserve:prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache, their K/V not computed again.")
        self._engine_steps = self._counter("specserve:engine_steps_total", "Engine steps run.")
        self._prompt_tokens = self._counter("specserve:prompt_tokens_total",
                                            "Prompt tokens prefilled.")
        self._generation_tokens = self._counter("specserve:generation_tokens_total",
                                                "Tokens generated (accepted + bonus/recovered).")

        # ---------------------------------------------------------------- speculation
        self._num_speculative_tokens = self._gauge(
            "specserve:spec_decode_num_speculative_tokens",
            "Configured k: draft tokens proposed per step for one request.")
        self._num_speculative_tokens.set(num_speculative_tokens)
        self._num_drafts = self._counter("specserve:spec_decode_num_drafts_total",
                                         "Drafts verified (one per speculating request per step).")
        self._num_draft_tokens = self._counter("specserve:spec_decode_num_draft_tokens_total",
                                               "Draft tokens proposed and verified.")
        self._num_accepted_tokens = self._counter(
            "specserve:spec_decode_num_accepted_tokens_total", "Draft tokens the target accepted.")
        self._accepted_per_position = Counter(
            "specserve:spec_decode_num_accepted_tokens_per_pos_total",
            "Drafts whose token at this 1-based position was accepted.",
            [*_BASE_LABELS, "position"], registry=self.registry)
        for position in range(1, num_speculative_tokens + 1):
            self._accepted_per_position.labels(**self._base, position=str(position))
        self._acceptance_length = self._histogram(
            "specserve:spec_decode_acceptance_length",
            "Draft tokens accepted per verified draft.", ACCEPTANCE_LENGTH_BUCKETS)
        self._draft_seconds = self._counter("specserve:spec_decode_draft_seconds_total",
                                            "Seconds spent proposing drafts.")
        self._verify_seconds = self._counter("specserve:spec_decode_verify_seconds_total",
                                             "Seconds spent in target passes and verification.")
        self._num_k_choices = self._counter(
            "specserve:spec_decode_k_choices_total",
            "Per-request choices of k made when drafting (one per decoding request per step).")
        self._sum_chosen_k = self._counter("specserve:spec_decode_k_chosen_total",
                                           "Sum of the k chosen in those choices.")
        self._num_speculating_choices = self._counter(
            "specserve:spec_decode_speculating_choices_total", "Choices of a k above 0.")
        self._current_k = self._gauge(
            "specserve:spec_decode_current_k",
            "Mean k chosen for the decoding requests of the latest step (0 when none).")
        self._speculating_share = self._gauge(
            "specserve:spec_decode_speculating_share",
            "Share of the latest step's decoding requests given a k above 0 (0..1).")

        # ---------------------------------------------------------------- per request
        self._time_to_first_token = self._histogram(
            "specserve:time_to_first_token_seconds",
            "Seconds from request arrival to its first token.", TTFT_BUCKETS)
        self._inter_token_latency = self._histogram(
            "specserve:inter_token_latency_seconds",
            "Seconds between consecutive tokens of one request.", INTER_TOKEN_LATENCY_BUCKETS)
        self._e2e_latency = self._histogram(
            "specserve:e2e_request_latency_seconds",
            "Seconds from request arrival to its last token.", E2E_LATENCY_BUCKETS)
        self._request_prompt_tokens = self._histogram(
            "specserve:request_prompt_tokens", "Prompt tokens per finished request.",
            TOKEN_COUNT_BUCKETS)
        self._request_generation_tokens = self._histogram(
            "specserve:request_generation_tokens", "Generated tokens per finished request.",
            TOKEN_COUNT_BUCKETS)
        self._request_success = Counter(
            "specserve:request_success_total", "Requests finished, by finish reason.",
            [*_BASE_LABELS, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self._request_success.labels(**self._base, finished_reason=reason)
        self._request_rejected = Counter(
            "specserve:request_rejected_total", "Requests refused, by HTTP status code.",
            [*_BASE_LABELS, "code"], registry=self.registry)

    # NOTE: prometheus_client strips a trailing `_total` from a counter's name and adds it back on
    # the sample, so passing the full name exposes exactly that name (plus a `_created` gauge).
    def _counter(self, name: str, documentation: str) -> Counter:
        counter = Counter(name, documentation, _BASE_LABELS, registry=self.registry)
        return counter.labels(**self._base)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(name, documentation, _BASE_LABELS, registry=self.registry).labels(**self._base)

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, documentation, _BASE_LABELS, buckets=buckets,
                         registry=self.registry).labels(**self._base)

    def _add_increase(self, counter: Counter, name: str, total: int) -> None:
        """Count the increase of one of the engine's running totals; a drop means the engine
        restarted and counts from zero."""
        increase = total - self._last_totals.get(name, 0)
        counter.inc(total if increase < 0 else increase)
        self._last_totals[name] = total

    def observe_step(self, stats: StepStats) -> None:
        """Fold one engine step into the series."""
        with self._lock:
            self._num_running.set(stats.num_running)
            self._num_waiting.set(stats.num_waiting)
            self._kv_cache_usage.set(stats.kv_cache_usage)
            self._add_increase(self._num_preemptions, "preemptions", stats.num_preemptions)
            self._add_increase(self._prefix_cache_queries, "prefix_cache_queries",
                               stats.prefix_cache_queries)
            self._add_increase(self._prefix_cache_hits, "prefix_cache_hits",
                               stats.prefix_cache_hits)
            if not stats.is_step:
                return  # a snapshot after an abort: the gauges above are all it carries
            self._engine_steps.inc()
            self._prompt_tokens.inc(stats.num_prompt_tokens)
            self._generation_tokens.inc(stats.num_generation_tokens)

            self._num_drafts.inc(stats.num_drafts)
            self._num_draft_tokens.inc(stats.num_draft_tokens)
            self._num_accepted_tokens.inc(stats.num_accepted_tokens)
            for position, num_accepted in enumerate(stats.accepted_per_position, start=1):
                self._accepted_per_position.labels(**self._base, position=str(position)).inc(
                    num_accepted)
            for num_accepted in stats.accepted_lengths:
                self._acceptance_length.observe(num_accepted)
            self._draft_seconds.inc(stats.draft_seconds)
            self._verify_seconds.inc(stats.verify_seconds)
            self._num_k_choices.inc(stats.num_k_choices)
            self._sum_chosen_k.inc(stats.sum_chosen_k)
            self._num_speculating_choices.inc(stats.num_speculating_choices)
            if stats.num_k_choices:
                self._current_k.set(stats.sum_chosen_k / stats.num_k_choices)
                self._speculating_share.set(stats.num_speculating_choices / stats.num_k_choices)

    def request_finished(self, *, ttft: float | None, inter_token_latencies: list[float],
                         e2e: float, num_prompt_tokens: int, num_generation_tokens: int,
                         finish_reason: str) -> None:
        """Record one finished request; ttft is None when it produced no token."""
        with self._lock:
            if ttft is not None:
                self._time_to_first_token.observe(ttft)
            for latency in inter_token_latencies:
                self._inter_token_latency.observe(latency)
            self._e2e_latency.observe(e2e)
            self._request_prompt_tokens.observe(num_prompt_tokens)
            self._request_generation_tokens.observe(num_generation_tokens)
            self._request_success.labels(**self._base, finished_reason=finish_reason).inc()

    def request_rejected(self, status_code: int) -> None:
        """Count a request refused before it reached the engine (4xx/5xx)."""
        with self._lock:
            self._request_rejected.labels(**self._base, code=str(status_code)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for a /metrics endpoint."""
        with self._lock:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
