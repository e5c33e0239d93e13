"""A sweep against one server: the same requests at each offered rate, with the server's
speculation counters read around every run."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loadtest.arrivals import arrival_gaps, send_offsets
from loadtest.client import SamplingOptions, request_body
from loadtest.datasets import LoadRequest
from loadtest.metrics_scrape import scrape_spec_counters
from loadtest.report import build_run_result
from loadtest.runner import RunBounds, run_load
from loadtest.target import Endpoint


@dataclass(frozen=True)
class SweepPlan:
    """What every run of a sweep shares; only the offered rate changes between runs."""

    requests: list[LoadRequest]
    dataset: str
    sampling: SamplingOptions
    request_rates: list[float]       # offered QPS per run; inf = unpaced
    burstiness: float
    max_concurrency: int | None
    duration_s: float
    slos_ms: dict[str, float]
    seed: int                        # the same arrival pattern (scaled) at every rate


def run_sweep(endpoint: Endpoint, plan: SweepPlan, label: str,
              speculative_config: dict[str, Any] | None,
              on_run: Callable[[dict[str, Any]], None] = lambda run: None) -> list[dict[str, Any]]:
    """One run per offered rate; `on_run` sees each result as soon as it exists."""
    bodies = [request_body(request, endpoint, plan.sampling) for request in plan.requests]
    results = []
    for rate in plan.request_rates:
        offsets = send_offsets(arrival_gaps(len(bodies), rate, plan.burstiness, plan.seed))
        before = scrape_spec_counters(endpoint.base_url)
        run = run_load(endpoint, bodies, RunBounds(offsets, plan.max_concurrency, plan.duration_s))
        after = scrape_spec_counters(endpoint.base_url)
        spec = after.since(before) if before is not None and after is not None else None
        settings = {
            "label": label, "base_url": endpoint.base_url, "model": endpoint.model,
            "endpoint": endpoint.api, "dataset": plan.dataset,
            "request_rate": "inf" if math.isinf(rate) else rate,
            "burstiness": plan.burstiness, "max_concurrency": plan.max_concurrency,
            "max_requests": len(bodies), "duration_limit_s": plan.duration_s,
            "max_tokens": plan.sampling.max_tokens, "temperature": plan.sampling.temperature,
            "speculative_config": speculative_config,
        }
        result = build_run_result(settings, run, spec, plan.slos_ms)
        on_run(result)
        results.append(result)
    return results
