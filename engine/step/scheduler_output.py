"""The scheduler's plan for one step, built once and read by every part of the step."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.step.layout import StepLayout
from engine.step.types import ForwardInput, ScheduledRequest


@dataclass
class SchedulerOutput:
    # in batch order: the flattened forward lays their tokens out one request after another
    scheduled: list[ScheduledRequest]
    # sum of num_new_tokens (<= max_num_batched_tokens)
    num_batched_tokens: int
    # rows, drafts and sampling tensors of this step, built once from `scheduled`
    layout: StepLayout
    # the target pass: the scheduled rows with their block tables (what tensor-parallel ranks get)
    forward: ForwardInput
    # requests sent back to waiting this step; their K/V was freed and will be recomputed
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampling(self) -> list[ScheduledRequest]:
        """The scheduled requests whose logits pick new tokens this step, in batch order."""
        return self.layout.sampling
