"""A step cost model pinned to a line, for tests of adaptive speculation that must not depend on the
machine's timings."""

from __future__ import annotations

from engine.adaptive.step_cost import StepCostModel


class PinnedCost(StepCostModel):
    """A linear cost curve (seconds = base + per_token * tokens) that measurements do not move: the
    choices depend on acceptance only, so the test is the same on any machine."""

    def __init__(self, base: float = 0.010, per_token: float = 0.003) -> None:
        super().__init__()
        for tokens in (1, 4096):
            super().observe_verify(tokens, base + per_token * tokens)

    def calibrate(self, num_tokens: int, seconds: float) -> None:
        pass

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        pass

    def observe_draft(self, depth: int, seconds: float) -> None:
        pass

    def observe_overhead(self, seconds: float) -> None:
        pass
