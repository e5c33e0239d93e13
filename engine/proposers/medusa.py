"""Medusa drafting: every head reads the target's hidden state at the row that produced a request's
newest token, and head i guesses the token i + 1 places after it (medusa_heads.py). One pass of the
heads gives a whole draft's logits, so drafting costs a few small matmuls and one batched LM-head
pass per step, whatever k is, and keeps no state between steps (nothing to roll back or free).

A chain drafts position i from head i through the shared propose loop (chain.py): greedy requests
take each head's argmax; sampled ones draw from each head's q after their own transforms
(engine/sample/drafting.py), and q rides along to the rejection sampler, so the output follows the
target's law. Never Medusa's "typical acceptance", which would change it. With `tree`, the heads'
top guesses are combined into a tree (medusa_tree.py) verified as one-hot drafts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.models.build import optimize_for_cpu
from engine.proposers.base import DraftProposal, Proposer
from engine.proposers.chain import draft_chains
from engine.proposers.medusa_tree import Choice, choice_tree, cut_choices, grown_tree
from engine.proposers.published_medusa import load_medusa_heads
from engine.request import Request
from engine.runner.target_handle import TargetHandle

logger = logging.getLogger("specserve.engine")


class MedusaProposer(Proposer):
    def __init__(self, folder: str, target: TargetHandle, num_speculative_tokens: int,
                 tree: bool = False, choices: Sequence[Choice] | None = None) -> None:
        self.heads = load_medusa_heads(folder, target.arch, target.dtype, target.device)
        optimize_for_cpu(self.heads, target.dtype, target.device, fused_ops=False)
        config = self.heads.config
        self.num_heads = config.num_heads
        # the target's own LM head, read-only, for heads that score with it
        self.target_lm_head = target.lm_head if config.vocab_projection == "target" else None
        # draft a tree of up to cap nodes instead of a chain of cap tokens
        self.tree = tree
        self.choices = None if choices is None else [tuple(choice) for choice in choices]
        most_ahead = max(map(len, self.choices)) if self.choices else \
            (0 if tree else num_speculative_tokens)
        if most_ahead > self.num_heads:
            what = "medusa_choices reach" if self.choices else "num_speculative_tokens asks for"
            raise ValueError(f"{what} {most_ahead} tokens ahead; the {self.num_heads} Medusa heads "
                             f"in {folder} draft at most {self.num_heads} (one position each)")
        logger.info("Medusa: %d heads x %d blocks, scored by %s (%s)", self.num_heads,
                    config.num_layers, "the target's LM head" if self.target_lm_head is not None else
                    f"their own projection ({config.vocab_projection})", config.trained_for)

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        rows = [i for i, cap in enumerate(max_num_tokens) if cap > 0]
        if target_hidden is None or not rows:
            return [DraftProposal([]) for _ in requests]
        depth = min(self.num_heads, max(max_num_tokens[i] for i in rows))
        if self.choices:
            depth = min(depth, max(map(len, self.choices)))
        # every drafting request's heads at once: [depth, len(rows), vocab]
        logits = self.heads.logits(target_hidden[rows], depth, self.target_lm_head)
        if self.tree:
            return self._trees(requests, max_num_tokens, rows, logits)
        position = {i: p for p, i in enumerate(rows)}

        def advance(step: int, active: list[int],
                    drafts: dict[int, list[int]]) -> tuple[list[int], torch.Tensor]:
            return active, logits[step, [position[i] for i in active]]  # [len(active), vocab]

        return draft_chains(requests, [min(cap, depth) for cap in max_num_tokens], advance)

    def _trees(self, requests: list[Request], caps: list[int], rows: list[int],
               logits: torch.Tensor) -> list[DraftProposal]:
        proposals = [DraftProposal([]) for _ in requests]
        for p, i in enumerate(rows):
            if self.choices:
                proposals[i] = choice_tree(requests[i], cut_choices(self.choices, caps[i]),
                                           logits[:, p])
            else:
                proposals[i] = grown_tree(requests[i], caps[i], logits[:, p])
        return proposals
