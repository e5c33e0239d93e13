"""Cost curves, requests and policies shared by the adaptive speculation tests."""

from __future__ import annotations

import numpy as np

from engine.adaptive import AdaptiveSpeculation, StepCostModel
from engine.adaptive.step_cost import STALE_AFTER
from engine.request import Request
from engine.sampling_params import SamplingParams

COST_SHAPES = {
    # seconds of a target pass over n tokens
    "gpu_flat_then_bound": lambda n: 0.010 * np.maximum(1.0, np.asarray(n, float) / 64),
    "cpu_linear": lambda n: 0.020 + 0.004 * np.asarray(n, float),
    "cpu_steep": lambda n: 0.004 + 0.010 * np.asarray(n, float),
    "compute_bound": lambda n: 0.010 * np.asarray(n, float),
}
DRAFT_COSTS = {"free": lambda depth: 0.0, "per_position": lambda depth: 0.002 * depth}


def rate(ks, alphas, num_known, verify, draft) -> float:
    emitted = sum(sum(a ** j for j in range(k + 1)) for a, k in zip(alphas, ks))
    return emitted / (float(verify(num_known + sum(ks))) + draft(max(ks)))



def request(request_id: str, **params) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=64, **params), frozenset())


def flat_cost() -> StepCostModel:
    cost = StepCostModel()
    for tokens in (1, 64, 128):
        cost.observe_verify(tokens, 0.010 * max(1, tokens / 64))
    return cost



REAL_COST = COST_SHAPES["cpu_linear"]


def policy_calibrated_on_a_busy_machine() -> AdaptiveSpeculation:
    """Start-up calibration timed passes of 2..9 tokens while the machine was busy (4x their real
    cost); since then, STALE_AFTER one-row passes at their real cost. The request "copying" has had
    every draft kept."""
    policy = AdaptiveSpeculation()
    for tokens in range(1, 10):
        policy.cost.observe_verify(tokens, float(REAL_COST(tokens)) * (4.0 if tokens > 1 else 1.0))
    for _ in range(40):
        policy.acceptance.observe("copying", 8, 8)
    for _ in range(STALE_AFTER):
        policy.cost.observe_verify(1, float(REAL_COST(1)))
    return policy

