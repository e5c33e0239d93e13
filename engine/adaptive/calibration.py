"""Start-up calibration of the target pass: time verification-shaped passes of 1..N tokens, so the
first adaptive choices rest on measurements of this model on this device, not on a guess. Measured
once per machine, model and configuration; later starts read it back (calibration_cache.py)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from engine.adaptive.calibration_cache import cached_calibration
from engine.adaptive.step_cost import StepCostModel
from engine.kv.block_manager import BlockManager
from engine.request import Request
from engine.runner.worker import Worker
from engine.sampling_params import SamplingParams
from engine.step.layout import StepLayout
from engine.step.rejection import RejectionSampler
from engine.step.types import ForwardInput, ScheduledRequest, SequenceRows

# token counts timed at start-up (decode batches with their drafts); steps in between are
# interpolated, bigger ones extrapolated until real steps measure them
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
# the fastest of these runs counts: a run can only be slowed down by whatever else uses the machine
REPEATS = 3
CALIBRATION_REQUEST_ID = "specserve-adaptive-calibration"


def calibrate_verify_cost(cost: StepCostModel, worker: Worker, block_manager: BlockManager,
                          sampler: RejectionSampler, max_tokens: int,
                          cache_fields: Mapping[str, Any] | None = None) -> None:
    """Seed `cost` with the fastest of REPEATS timings of one request verifying n - 1 greedy drafts
    (n rows of logits, as a real verification) for each calibration size n <= max_tokens.

    `cache_fields`: what the timings depend on (engine/adaptive/calibration_cache.py); given, a
    calibration saved for the same fields is reused instead of measured, and a new one is saved."""
    capacity = block_manager.num_free_blocks * block_manager.block_size
    sizes = [n for n in CALIBRATION_SIZES if n <= min(max_tokens, capacity)]

    def measure() -> dict[int, float]:
        return measure_verify_cost(worker, block_manager, sampler, sizes)

    if cache_fields is None:
        fastest = measure()
    else:
        fastest = cached_calibration({**cache_fields, "sizes": sizes, "repeats": REPEATS}, measure)
    for num_tokens in sizes:
        cost.calibrate(num_tokens, fastest[num_tokens])


def measure_verify_cost(worker: Worker, block_manager: BlockManager, sampler: RejectionSampler,
                        sizes: list[int]) -> dict[int, float]:
    """The fastest of REPEATS timed verifications of each size in `sizes`.

    The sizes are timed in rounds, every size once per round, so a burst of other work on the
    machine (another process starting up) slows one run of many sizes, not every run of a few:
    the curve's shape survives it."""
    fastest = dict.fromkeys(sizes, float("inf"))
    # NOTE: one extra round first: the first pass of a size may pack weights or plan kernels
    for round_index in range(REPEATS + 1):
        for num_tokens in sizes:
            seconds = _time_verification(worker, block_manager, sampler, num_tokens)
            if round_index > 0:
                fastest[num_tokens] = min(fastest[num_tokens], seconds)
    return fastest


def _time_verification(worker: Worker, block_manager: BlockManager, sampler: RejectionSampler,
                       num_tokens: int) -> float:
    request = Request(CALIBRATION_REQUEST_ID, [0], SamplingParams(temperature=0.0, max_tokens=1),
                      frozenset())
    item = ScheduledRequest(request, num_tokens, is_sampling=True,
                            draft_token_ids=[0] * (num_tokens - 1))
    layout = StepLayout.build([item], worker.device)
    block_manager.allocate(CALIBRATION_REQUEST_ID, num_tokens)
    forward = ForwardInput([SequenceRows(CALIBRATION_REQUEST_ID, 0, [0] * num_tokens, None,
                                         block_manager.block_table(CALIBRATION_REQUEST_ID))],
                           layout.logits_rows)
    try:
        start = time.perf_counter()
        out = worker.execute(forward, layout.logits_indices)
        sampler(out.logits, layout)
        return time.perf_counter() - start
    finally:
        block_manager.free(CALIBRATION_REQUEST_ID)
