"""When requests are sent: gaps between arrivals drawn from a gamma distribution with mean 1/QPS.

The shape parameter is the burstiness: 1 gives a Poisson process (exponential gaps, coefficient of
variation 1); below 1 arrivals come in bursts (CV = 1/sqrt(burstiness) > 1); above 1 they are more
even, approaching a fixed interval. QPS = inf sends everything at once (then a concurrency limit,
if any, is what paces the run).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_gaps(num_requests: int, qps: float, burstiness: float = 1.0,
                 seed: int = 0) -> list[float]:
    """Seconds to wait before each request (the first gap included), reproducible per seed."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not qps > 0:
        raise ValueError(f"qps must be > 0 (inf for no pacing), got {qps}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(qps):
        return [0.0] * num_requests
    # gamma(shape k, scale θ) has mean kθ and CV 1/sqrt(k): θ = 1 / (QPS · k) keeps the mean 1/QPS
    scale = 1.0 / (qps * burstiness)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=scale, size=num_requests).tolist()


def send_offsets(gaps: list[float]) -> list[float]:
    """Seconds after the start of a run at which each request is due."""
    return np.cumsum(gaps).tolist() if gaps else []
