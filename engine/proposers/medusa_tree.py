"""Medusa draft trees. Head d's logits do not depend on the drafts before it (every head reads the same
hidden state), so a tree is the heads' top-k guesses combined across depths, in one of two shapes:

- `medusa_choices` (FasterDecoding's static trees): each choice is a path of ranks, [0, 1] meaning
  "head 0's best token, then head 1's second best after it". The list is in priority order; a budget
  of n nodes keeps its first n choices (each moved after its ancestors, so the cut is a tree).
- otherwise the top-BRANCH cartesian product cut to the node budget by path probability, grown as
  EAGLE trees grow (eagle_tree.TreeGrowth), each level's candidates scored by the next head.

Either way a node's rank is taken after the request's own transforms along its path (penalties,
grammar, temperature, top-k, top-p: engine/sample/drafting.py), and its token is chosen without
randomness: the rejection sampler verifies the tree as one-hot drafts, lossless for greedy and
sampled requests alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.proposers.base import DraftProposal
from engine.proposers.eagle_tree import TreeGrowth, draft_log_probs
from engine.request import Request

Choice = tuple[int, ...]


def cut_choices(choices: Sequence[Choice], budget: int) -> list[Choice]:
    """The first `budget` choices by priority, each after its ancestors (a choice listed before its
    parent takes the parent's place in line): an ancestor-closed tree."""
    position = {choice: index for index, choice in enumerate(choices)}

    def priority(choice: Choice) -> tuple[int, int]:
        return max(position[choice[:depth]] for depth in range(1, len(choice) + 1)), len(choice)

    return sorted(choices, key=priority)[:budget]


def choice_tree(request: Request, choices: Sequence[Choice], logits: torch.Tensor) -> DraftProposal:
    """The tree of `choices` (ancestor-closed) for one request; logits: [depth, vocab], head d's at
    row d. A choice whose rank falls on a token its path forbids is left out, with its subtree."""
    tokens: dict[Choice, int] = {}
    for depth in range(1, max(map(len, choices), default=0) + 1):
        level = [c for c in choices if len(c) == depth and (depth == 1 or c[:-1] in tokens)]
        if not level:
            break
        parents = list(dict.fromkeys(c[:-1] for c in level))
        paths = [[tokens[parent[:i]] for i in range(1, len(parent) + 1)] for parent in parents]
        log_q = draft_log_probs(logits[depth - 1].expand(len(parents), -1), request, paths)
        most = min(max(c[-1] for c in level) + 1, log_q.shape[-1])
        values, token_ids = log_q.topk(most, dim=-1)  # [len(parents), most]
        ranked = {parent: sorted(zip(row_values, row_ids), key=lambda pair: (-pair[0], pair[1]))
                  for parent, row_values, row_ids in zip(parents, values.tolist(),
                                                          token_ids.tolist())}
        for choice in level:
            candidates = ranked[choice[:-1]]
            if choice[-1] < len(candidates) and candidates[choice[-1]][0] > float("-inf"):
                tokens[choice] = candidates[choice[-1]][1]
    # NOTE: rank paths in lexicographic order are depth-first, each node's likeliest child first
    order = sorted(tokens)
    index = {choice: i for i, choice in enumerate(order)}
    return DraftProposal([tokens[c] for c in order], None,
                         [index[c[:-1]] if len(c) > 1 else -1 for c in order])


def grown_tree(request: Request, budget: int, logits: torch.Tensor) -> DraftProposal:
    """The `budget` likeliest nodes of the heads' top-BRANCH product for one request; logits:
    [depth, vocab], head d's at row d."""
    growth = TreeGrowth(request, budget, logits.new_zeros(0))
    growth.expand([-1], logits[0][None])
    for depth in range(1, len(logits)):
        if not growth.frontier:
            break
        growth.expand(growth.frontier, logits[depth].expand(len(growth.frontier), -1))
    return growth.proposal()
