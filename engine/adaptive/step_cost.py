"""What a step costs, learned from the steps the engine runs: seconds of a target pass (with its
verification) by the number of tokens it computes, and seconds of drafting by the draft depth.

The target's curve is kept as points, not a formula: on a GPU a pass costs nearly the same from 1 to a
few hundred tokens and then grows (compute-bound), on a CPU it grows from the first token; a table
of measured points, interpolated and made non-decreasing, serves both. Start-up calibration
(engine/adaptive/calibration.py) seeds the table; every step then moves its point by an
exponential average, so the table follows the real mix of batch sizes and context lengths.

A point the engine has not timed lately (a size the policy stopped picking, or one only calibration
timed) runs at the level of the nearest point it has: its seconds at calibration (its baseline)
times that point's measured / baseline. Otherwise a busy batch's own size, timed at 8 contexts of
hundreds of tokens, rises above the calibrated sizes after it (one short context), the monotone fit
pools them flat, and extra rows look free exactly where they cost most (8 requests at saturation).
The same rule follows the weights' format and the machine: the ratios are measured, never assumed.
"""

from __future__ import annotations

import math

import numpy as np

# weight of a new measurement in its point's average (~5 steps)
SMOOTHING = 0.2
# token counts up to this get a point each; above, points share a quarter-octave bucket
EXACT_UP_TO = 32
# a point not measured in this many target passes may no longer be what the machine does (start-up
# calibration ran beside other processes, the host's memory bandwidth moved): the policy then
# verifies every draft once to measure it again (policy.py)
STALE_AFTER = 64


def _bucket(num_tokens: int) -> int:
    if num_tokens <= EXACT_UP_TO:
        return num_tokens
    return EXACT_UP_TO + round(4 * math.log2(num_tokens / EXACT_UP_TO)) + 1


class StepCostModel:
    def __init__(self) -> None:
        # bucket -> [mean tokens, mean seconds] of the target passes that fell in it
        self._points: dict[int, list[float]] = {}
        # target passes observed, and bucket -> the count when it was last measured (calibration
        # included), and when last by an engine step
        self._num_observed = 0
        self._measured_at: dict[int, int] = {}
        self._stepped_at: dict[int, int] = {}
        # bucket -> its seconds at the table's reference level (calibration's): a point not timed by
        # a step lately is predicted from it and the level of its nearest timed neighbour
        self._baseline: dict[int, float] = {}
        # drafting: seconds of a step that drafted nothing, and seconds per draft position after that
        self._draft_base: float = 0.0
        self._draft_per_position: float = 0.0
        # the rest of a step (scheduling, commit), whatever its tokens: it dilutes every draft's cost
        self._step_overhead: float = 0.0
        self._curve: tuple[np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------------ learning
    def calibrate(self, num_tokens: int, seconds: float) -> None:
        """Start-up calibration timed a pass over `num_tokens` tokens (one sequence) at `seconds`."""
        self._observe(num_tokens, seconds, is_step=False)

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        """A target pass over `num_tokens` tokens (prefill chunks and drafts included) took `seconds`."""
        self._observe(num_tokens, seconds, is_step=True)

    def _observe(self, num_tokens: int, seconds: float, is_step: bool) -> None:
        if num_tokens < 1 or not math.isfinite(seconds):
            return
        bucket = _bucket(num_tokens)
        point = self._points.get(bucket)
        if point is None or self._num_observed - self._measured_at[bucket] >= STALE_AFTER:
            # a stale point says what the machine did then, not now: the new measurement replaces it
            self._points[bucket] = [float(num_tokens), seconds]
            self._baseline[bucket] = seconds / self._level_near(bucket) if is_step else seconds
        else:
            point[0] += SMOOTHING * (num_tokens - point[0])
            point[1] += SMOOTHING * (seconds - point[1])
        self._num_observed += 1
        self._measured_at[bucket] = self._num_observed
        if is_step:
            self._stepped_at[bucket] = self._num_observed
        self._curve = None

    def observe_overhead(self, seconds: float) -> None:
        """A step spent `seconds` outside its target pass and drafting."""
        if math.isfinite(seconds):
            self._step_overhead += SMOOTHING * (max(0.0, seconds) - self._step_overhead)

    def observe_draft(self, depth: int, seconds: float) -> None:
        """Proposing drafts of at most `depth` tokens for the batch took `seconds`."""
        if not math.isfinite(seconds):
            return
        if depth == 0:
            self._draft_base += SMOOTHING * (seconds - self._draft_base)
        else:
            per_position = max(0.0, seconds - self._draft_base) / depth
            self._draft_per_position += SMOOTHING * (per_position - self._draft_per_position)

    # ------------------------------------------------------------------ predicting
    @property
    def is_ready(self) -> bool:
        return bool(self._points)

    @property
    def num_observed(self) -> int:
        """Target passes observed so far: the clock staleness is counted on."""
        return self._num_observed

    def is_stale(self, num_tokens: int) -> bool:
        """True when the prediction for `num_tokens` rests on a point (the measured sizes on either
        side of it) that was not measured again in the last STALE_AFTER target passes."""
        below = [(point[0], bucket) for bucket, point in self._points.items() if point[0] <= num_tokens]
        above = [(point[0], bucket) for bucket, point in self._points.items() if point[0] >= num_tokens]
        neighbours = [max(below)[1]] if below else []
        neighbours += [min(above)[1]] if above else [max(self._points.items(),
                                                          key=lambda item: item[1][0])[0]]
        return any(self._num_observed - self._measured_at[b] >= STALE_AFTER for b in neighbours)

    def step_seconds(self, num_tokens: np.ndarray) -> np.ndarray:
        """Predicted seconds of steps computing `num_tokens` tokens, drafting aside."""
        return self.verify_seconds(num_tokens) + self._step_overhead

    def verify_seconds(self, num_tokens: np.ndarray) -> np.ndarray:
        """Predicted seconds of target passes over `num_tokens` tokens (any shape)."""
        tokens, seconds = self._monotone_curve()
        inside = np.interp(num_tokens, tokens, seconds)
        # NOTE: past the largest measured pass, assume cost grows in proportion to tokens (the
        # compute-bound regime): pessimistic, so speculation never looks cheaper than it is
        beyond = seconds[-1] * np.asarray(num_tokens, dtype=np.float64) / tokens[-1]
        return np.where(np.asarray(num_tokens) > tokens[-1], beyond, inside)

    def draft_seconds(self, depth: int) -> float:
        """Predicted seconds of drafting up to `depth` tokens (0: what a step without drafts costs)."""
        return self._draft_base + self._draft_per_position * depth

    def _monotone_curve(self) -> tuple[np.ndarray, np.ndarray]:
        if self._curve is None:
            if not self._points:
                raise RuntimeError("no target pass measured yet")
            # NOTE: which points steps timed lately, found once per rebuild (every step moves a
            # point, so the curve is rebuilt each step): not once per point and neighbour
            timed = [(point[0], bucket) for bucket, point in self._points.items()
                     if self._is_stepped_lately(bucket)]
            points = sorted((point[0], self._predicted_point(bucket, timed))
                            for bucket, point in self._points.items())
            tokens = np.array([p[0] for p in points])
            # NOTE: noise can make a bigger pass look cheaper than a smaller one; more tokens never
            # cost less, or extra drafts would look free
            self._curve = tokens, non_decreasing_fit(np.array([p[1] for p in points]))
        return self._curve

    def _is_stepped_lately(self, bucket: int) -> bool:
        stepped_at = self._stepped_at.get(bucket)
        return stepped_at is not None and self._num_observed - stepped_at < STALE_AFTER

    def _predicted_point(self, bucket: int, timed: list[tuple[float, int]]) -> float:
        """Seconds of the bucket's pass: as timed, if an engine step timed it lately; otherwise its
        baseline at the level of its nearest bucket that was (module docstring). `timed`: the
        (tokens, bucket) of the points steps timed lately."""
        if self._is_stepped_lately(bucket):
            return self._points[bucket][1]
        return self._baseline[bucket] * self._level_near(bucket, timed)

    def _level_near(self, bucket: int, timed: list[tuple[float, int]] | None = None) -> float:
        """Measured / baseline seconds of the nearest bucket (by tokens, the next smaller first) that
        an engine step timed lately; 1 when there is none."""
        tokens = self._points[bucket][0] if bucket in self._points else math.inf
        if timed is None:
            timed = [(point[0], other) for other, point in self._points.items()
                     if self._is_stepped_lately(other)]
        timed = [item for item in timed if item[1] != bucket]
        below = [item for item in timed if item[0] <= tokens]
        nearest = max(below) if below else min(timed, default=None)
        if nearest is None:
            return 1.0
        return self._points[nearest[1]][1] / self._baseline[nearest[1]]


def non_decreasing_fit(values: np.ndarray) -> np.ndarray:
    """The closest non-decreasing sequence in least squares (pool-adjacent-violators): a slow outlier
    is averaged with its neighbours instead of lifting every point after it."""
    # blocks of pooled neighbours: [mean, count], merged while a block's mean exceeds the next one's
    blocks: list[list[float]] = []
    for value in values.tolist():
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            previous = blocks[-1]
            previous[0] = (previous[0] * previous[1] + mean * count) / (previous[1] + count)
            previous[1] += count
    return np.repeat([b[0] for b in blocks], [int(b[1]) for b in blocks])
