"""Draft proposers: cheap guesses of the next k tokens that the target verifies in one pass."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.proposers.base import DraftProposal, Proposer
from engine.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.worker import Worker


def build_proposer(config: SpeculativeConfig, worker: Worker) -> Proposer:
    """The proposer for `config`; model-based ones share the target's dtype, device and KV sizing."""
    if config.method == "ngram":
        from engine.proposers.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        from engine.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(config.model, worker.dtype, worker.device,
                                  worker.kv_spec.num_blocks, worker.kv_spec.block_size,
                                  worker.arch.vocab_size)
    if config.method == "suffix":
        from engine.proposers.suffix import SuffixProposer

        return SuffixProposer(config.suffix_max_depth, config.suffix_max_cached_tokens,
                              config.suffix_min_token_prob, config.suffix_factor,
                              is_cache_shared_across_tenants=config.suffix_cache_scope == "global")
    if config.method == "mlp_speculator":
        from engine.proposers.mlp_speculator import MLPSpeculatorProposer

        model = worker.model
        return MLPSpeculatorProposer(config.model, model.embed_tokens, model.lm_head,
                                     worker.arch.hidden_size, worker.arch.vocab_size, worker.dtype,
                                     worker.device)
    if config.method == "eagle":
        from engine.proposers.eagle import EagleProposer

        model = worker.model
        return EagleProposer(config.model, worker.arch, model.embed_tokens, model.lm_head,
                             worker.dtype, worker.device, worker.kv_spec.num_blocks,
                             worker.kv_spec.block_size)
    raise ValueError(f"unknown speculative method {config.method!r}")


__all__ = ["DraftProposal", "Proposer", "build_proposer"]
