"""Cost-aware speculation length: each step, choose every request's k (0 included) to maximise the
tokens emitted per second, from measured step costs and each request's recent acceptance."""

from engine.adaptive.acceptance import AcceptanceTracker
from engine.adaptive.policy import AdaptiveSpeculation, best_draft_lengths, geometric_chances
from engine.adaptive.step_cost import StepCostModel

__all__ = ["AcceptanceTracker", "AdaptiveSpeculation", "StepCostModel", "best_draft_lengths",
           "geometric_chances"]
