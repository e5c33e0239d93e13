"""The arithmetic of a report: latency distributions in milliseconds, TPOT per request, and
goodput (requests per second that met every service-level objective)."""

from __future__ import annotations

import math

import numpy as np

from loadtest.client import RequestOutcome

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def distribution_fields(metric: str, values_s: list[float]) -> dict[str, float | None]:
    """mean / median / std / p50 / p90 / p99 of `metric` in ms; None for an empty sample."""
    keys = [f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms",
            *(f"p{p}_{metric}_ms" for p in PERCENTILES)]
    if not values_s:
        return dict.fromkeys(keys)
    values_ms = np.asarray(values_s, dtype=float) * 1000.0
    numbers = [values_ms.mean(), np.median(values_ms), values_ms.std(),
               *np.percentile(values_ms, PERCENTILES)]
    return {key: float(value) for key, value in zip(keys, numbers)}


def time_per_output_token(outcome: RequestOutcome) -> float | None:
    """Seconds per token after the first; None when the request made fewer than two tokens."""
    if outcome.output_len < 2:
        return None
    return (outcome.latency - outcome.ttft) / (outcome.output_len - 1)


def parse_slo(text: str) -> tuple[str, float]:
    """`ttft:500` -> ("ttft", 500.0): a metric and its limit in milliseconds."""
    metric, sep, limit = text.partition(":")
    if not sep or metric not in GOODPUT_METRICS:
        raise ValueError(f"an SLO is METRIC:MS with METRIC in {GOODPUT_METRICS}, got {text!r}")
    try:
        limit_ms = float(limit)
    except ValueError:
        raise ValueError(f"the limit of {text!r} is not a number of milliseconds") from None
    if not (limit_ms > 0 and math.isfinite(limit_ms)):
        raise ValueError(f"the limit of {text!r} must be a positive number of milliseconds")
    return metric, limit_ms


def meets_slos(outcome: RequestOutcome, slos_ms: dict[str, float]) -> bool:
    """A successful request that met every SLO; TPOT is not judged for a one-token answer."""
    if not outcome.is_success:
        return False
    observed_s = {"ttft": outcome.ttft, "tpot": time_per_output_token(outcome),
                  "e2el": outcome.latency}
    return all(observed_s[metric] is None or observed_s[metric] * 1000.0 <= limit_ms
               for metric, limit_ms in slos_ms.items())


def goodput(outcomes: list[RequestOutcome], slos_ms: dict[str, float],
            duration_s: float) -> float | None:
    """Requests per second that met every SLO; None when no SLO was given."""
    if not slos_ms:
        return None
    num_good = sum(meets_slos(outcome, slos_ms) for outcome in outcomes)
    return num_good / duration_s if duration_s > 0 else 0.0
