"""Draft proposers: cheap guesses of the next k tokens that the target verifies in one pass."""

from __future__ import annotations

from engine.proposers.base import DraftProposal, Proposer
from engine.runner.target_handle import TargetHandle
from engine.spec_config import SpeculativeConfig


def build_proposer(config: SpeculativeConfig, target: TargetHandle) -> Proposer:
    """The proposer for `config`; model-based ones share the target's dtype, device and KV sizing."""
    if config.method == "ngram":
        from engine.proposers.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                             tree=config.draft_tree)
    if config.method == "draft_model":
        from engine.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(config.model, target)
    if config.method == "suffix":
        from engine.proposers.suffix import SuffixProposer

        return SuffixProposer(config.suffix_max_depth, config.suffix_max_cached_tokens,
                              config.suffix_min_token_prob, config.suffix_factor,
                              is_cache_shared_across_tenants=config.suffix_cache_scope == "global",
                              tree=config.draft_tree)
    if config.method == "mlp_speculator":
        from engine.proposers.mlp_speculator import MLPSpeculatorProposer

        return MLPSpeculatorProposer(config.model, target)
    if config.method in ("eagle", "eagle3"):
        from engine.proposers.eagle import EagleProposer

        return EagleProposer(config.model, target, config.method, tree=config.draft_tree)
    if config.method == "medusa":
        from engine.proposers.medusa import MedusaProposer

        return MedusaProposer(config.model, target, config.num_speculative_tokens,
                              tree=config.draft_tree, choices=config.medusa_choices)
    if config.method == "mtp":
        from engine.proposers.mtp import MtpProposer

        return MtpProposer(target, tree=config.draft_tree)
    raise ValueError(f"unknown speculative method {config.method!r}")


__all__ = ["DraftProposal", "Proposer", "TargetHandle", "build_proposer"]
