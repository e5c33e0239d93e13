"""Draft proposers: cheap guesses of the next k tokens that the target verifies in one pass."""

from __future__ import annotations

from engine.proposers.base import DraftProposal, Proposer
from engine.spec_config import SpeculativeConfig


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from engine.proposers.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative method {config.method!r} is not built yet")


__all__ = ["DraftProposal", "Proposer", "build_proposer"]
