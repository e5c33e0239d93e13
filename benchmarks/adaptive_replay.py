"""Speculation replayed on recorded greedy outputs, without the model: a greedy request's text is the
same whatever k is, so what the proposer drafts at each step and how much of it verification keeps
follow from the reference output alone, and a step's seconds from a cost curve. The policy under
test (fixed k, or the engine's own AdaptiveSpeculation) runs unchanged, batch by batch, as the
engine drives it (engine/core.py: verify, commit, draft for the next step to the full budget,
choose, trim; then learn from this step's verification). A seeded sampled output replays as a
greedy one when the drafts are one-hot (suffix, n-gram): its text does not depend on k.

Deterministic: the same outputs and curve give the same steps and seconds on any machine, busy or
not. What it leaves out: prefill steps, drafting and host time (cost 0 here).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from engine.adaptive import AdaptiveSpeculation
from engine.adaptive.calibration import CALIBRATION_SIZES
from engine.proposers import build_proposer
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_config import SpeculativeConfig

_request_ids = itertools.count()
# seconds of a target pass over n tokens
CostCurve = Callable[[np.ndarray], np.ndarray]


@dataclass
class ReplayResult:
    num_steps: int  # decode steps (target passes after prefill)
    num_tokens: int  # output tokens emitted by those steps, all requests
    seconds: float  # the steps' cost on the curve
    num_draft_tokens: int  # drafts verified
    num_accepted: int  # drafts kept
    num_offered: int  # drafts the proposer offered (before any cut)
    num_lost_by_cut: int  # drafts cut by the policy that verification would have kept

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0


def adaptive_policy(spec: dict, cost: CostCurve) -> AdaptiveSpeculation:
    """The engine's policy for `spec`'s proposer, calibrated on `cost` as start-up would."""
    drafts_first = build_proposer(SpeculativeConfig.from_json(spec), None).drafts_for_free
    policy = AdaptiveSpeculation(has_soft_drafts=not drafts_first, drafts_first=drafts_first)
    for n in CALIBRATION_SIZES:
        policy.cost.calibrate(n, float(cost(np.array([n]))[0]))
    return policy


def replay(cases: Sequence[tuple[list[int], list[int]]], spec: dict, cost: CostCurve,
           fixed_k: int | None = None, policy: AdaptiveSpeculation | None = None,
           timing_noise: np.random.Generator | None = None,
           max_batch: int | None = None) -> ReplayResult:
    """Decode every (prompt, reference output) of `cases` together, as one batch, with the proposer
    of `spec` (a --speculative-config dict): fixed_k None runs the adaptive `policy` (what it
    learnt from earlier replays carries over, as in a running engine; None: a new one) with the
    budget spec["num_speculative_tokens"]; an int verifies up to that many drafts each step (0:
    no speculation). Each request emits its reference output exactly. `timing_noise`: the policy
    is told each step's seconds as a busy machine would time it (spread ±20%, one step in 20 taking
    twice as long), while the result counts the curve's seconds. `max_batch`: at most that many run
    at once, the next case joining as one finishes (a load tester at that concurrency)."""
    config = SpeculativeConfig.from_json(spec)
    proposer = build_proposer(config, None)
    budget = config.num_speculative_tokens if fixed_k is None else fixed_k
    if fixed_k is None and policy is None:
        policy = adaptive_policy(spec, cost)
    if fixed_k is not None:
        policy = None
    params = SamplingParams(temperature=0.0, max_tokens=max(len(ref) for _, ref in cases))
    requests = [Request(f"replay-{next(_request_ids)}", list(prompt), params, frozenset())
                for prompt, _ in cases]
    references = {r.request_id: ref for r, (_, ref) in zip(requests, cases)}
    waiting = list(requests)
    running: list[Request] = []
    result = ReplayResult(0, 0, 0.0, 0, 0, 0, 0)

    def admit() -> None:
        while waiting and len(running) < (max_batch or len(requests)):
            request = waiting.pop(0)
            # the prefill step (not counted) emits the request's first token
            request.output_token_ids.append(references[request.request_id][0])
            if len(references[request.request_id]) > 1:
                running.append(request)

    def propose() -> dict[str, tuple[list[int], list[int]]]:
        """request id -> (the draft offered, the draft kept for verification) of every running
        request, as the engine drafts at the end of a step, after its commit."""
        caps = [max(0, min(budget, len(references[r.request_id]) - r.num_output_tokens - 1))
                for r in running]
        proposals = (proposer.propose(running, caps, None) if budget
                     else [SimpleNamespace(token_ids=[]) for _ in running])
        if policy is None:
            return {r.request_id: (list(p.token_ids), list(p.token_ids))
                    for r, p in zip(running, proposals)}
        ks = policy.choose(running, [len(p.token_ids) for p in proposals], 0,
                           [None] * len(running))
        return {r.request_id: (list(p.token_ids),
                               list(policy.keep_best(r.request_id, p, k).token_ids))
                for r, p, k in zip(running, proposals, ks)}

    admit()
    drafts = propose()
    while running:
        num_batched = len(running) + sum(len(drafts[r.request_id][1]) for r in running)
        seconds = float(cost(np.array([num_batched]))[0])
        items, sampled = [], []
        for request in running:
            full, draft = drafts[request.request_id]
            truth = references[request.request_id][request.num_output_tokens:]
            kept = _common_prefix(full, truth)
            accepted = min(kept, len(draft))
            result.num_offered += len(full)
            result.num_draft_tokens += len(draft)
            result.num_accepted += accepted
            result.num_lost_by_cut += kept - accepted
            items.append(SimpleNamespace(request=request, num_draft_tokens=len(draft),
                                         draft_token_ids=draft, draft_parents=None))
            sampled.append(SimpleNamespace(token_ids=truth[:accepted + 1], error=None,
                                           accepted_drafts=None))
            request.output_token_ids += truth[:accepted + 1]
            result.num_tokens += accepted + 1
        result.num_steps += 1
        result.seconds += seconds
        finished = [r for r in running
                    if r.num_output_tokens >= len(references[r.request_id])]
        for request in finished:
            proposer.free(request.request_id)
        running[:] = [r for r in running if r not in finished]
        admit()
        # NOTE: the engine's order: the next step's drafts, then what this step's verification
        # taught (the policy pairs each verification with the offer it was cut from)
        drafts = propose() if running else {}
        if policy is not None:
            timed = seconds if timing_noise is None else seconds * _busy_factor(timing_noise)
            policy.observe_step(SimpleNamespace(num_batched_tokens=num_batched, sampling=items),
                                sampled, [len(d) for _, d in drafts.values()], timed, timed, 0.0)
            for request in finished:
                policy.free(request.request_id)
    return result


def _busy_factor(rng: np.random.Generator) -> float:
    """How much slower a step looks on a machine shared with other work."""
    return float(rng.lognormal(0.0, 0.2)) * (2.0 if rng.random() < 0.05 else 1.0)


def _common_prefix(draft: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


def affine_curve(base_seconds: float, per_row_seconds: float) -> CostCurve:
    """A pass costing base + per_row * n: the CPU's shape (weights read once, rows computed)."""
    return lambda n: base_seconds + per_row_seconds * np.asarray(n, dtype=np.float64)
