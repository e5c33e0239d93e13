"""EAGLE draft trees, grown level by level as EAGLE-2 does: each frontier node's top-BRANCH tokens
by draft probability become candidates scored by the cumulative log-probability of their path; the
best BRANCH of a level are the next frontier (a beam); the `cap` best nodes overall are the tree.

    root ─┬─ a (-0.2) ─┬─ a1 (-0.5)     frontier after level 1: a, b
          │            └─ a2 (-1.9)     after level 2: a1, b1 (its best); ...
          └─ b (-1.1) ─── b1 (-1.4)     the tree: the cap best of a, b, a1, b1, a2, ...

A child never scores above its parent (log q <= 0), and ties go to the node made first, so the cap
best nodes are closed under ancestors: a tree. Its tokens are chosen without randomness, so the
rejection sampler verifies them as one-hot drafts (probs None), lossless for greedy and sampled
requests alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.draft_tree import depth_first
from engine.proposers.base import DraftProposal
from engine.request import Request
from engine.sample.drafting import draft_logits
from engine.sample.sampler import draft_probs

# children per expanded node, and the frontier (beam) kept per level. EAGLE-2's usual setting spends
# 60 nodes at 10 per node; budgets here are 8-32 (MAX_TREE_DRAFT_TOKENS), where a 5th sibling's path
# rarely outranks a node one level deeper, while a beam of 4 still lets the second and third guesses
# at a position grow chains of their own. Rows per pass stay at most 1 + cap whatever BRANCH is.
BRANCH = 4
# levels grown at most (one head pass each): deeper nodes are rarely reached in one verification
MAX_TREE_DEPTH = 8


@dataclass
class TreeNode:
    token_id: int
    # the parent node's index in TreeGrowth.nodes, -1 under the request's newest token
    parent: int
    # log q summed along the root-to-node path
    score: float
    depth: int
    # the drafts from the root to this node, itself last (the "earlier drafts" of its children)
    path: list[int]
    # the head's h at this node once computed (its children's feature)
    hidden: torch.Tensor | None = None


@dataclass
class TreeGrowth:
    """One request's tree while it grows."""

    request: Request
    cap: int
    # h at the request's newest token (the level-1 nodes' feature)
    root_hidden: torch.Tensor
    nodes: list[TreeNode] = field(default_factory=list)
    # nodes to expand next (their h is computed by the next pass), best first
    frontier: list[int] = field(default_factory=list)

    @property
    def max_depth(self) -> int:
        return min(self.cap, MAX_TREE_DEPTH)

    def rank(self, index: int) -> tuple[float, int]:
        return -self.nodes[index].score, index

    def best(self) -> list[int]:
        """The cap best nodes, best first: ancestor-closed, each parent before its children."""
        return sorted(range(len(self.nodes)), key=self.rank)[:self.cap]

    def expand(self, parents: list[int], logits: torch.Tensor) -> None:
        """Add the top-BRANCH children of each node of `parents` (-1: the root), whose next-token
        logits are `logits` [len(parents), vocab]; then choose the next frontier."""
        nodes = [self.nodes[parent] if parent >= 0 else None for parent in parents]
        paths = [[] if node is None else node.path for node in nodes]
        log_q = draft_log_probs(logits, self.request, paths)  # [len(parents), vocab]
        values, token_ids = log_q.topk(min(BRANCH, log_q.shape[-1]), dim=-1)  # [len(parents), B]
        candidates = []
        for parent, node, path, row_values, row_ids in zip(parents, nodes, paths, values.tolist(),
                                                           token_ids.tolist()):
            score, depth = (0.0, 0) if node is None else (node.score, node.depth)
            # NOTE: equal probabilities in token order, whatever order topk returns them in
            for value, token_id in sorted(zip(row_values, row_ids),
                                          key=lambda pair: (-pair[0], pair[1])):
                if value == float("-inf"):
                    break  # outside the draft vocabulary, or banned at this position
                candidates.append(len(self.nodes))
                self.nodes.append(TreeNode(token_id, parent, score + value, depth + 1,
                                           path + [token_id]))
        if not candidates or self.nodes[candidates[0]].depth >= self.max_depth:
            self.frontier = []
            return
        # NOTE: a node outside the cap best can never return (later nodes score no higher and come
        # later), nor can its descendants: only the level's best within the cap best grow on
        kept = set(self.best())
        self.frontier = [i for i in sorted(candidates, key=self.rank)[:BRANCH] if i in kept]

    def pass_rows(self) -> list[int]:
        """The nodes a pass over the frontier runs, after the root row: the frontier and its
        ancestors, parents first (at most cap: all of them rank among the cap best)."""
        rows: set[int] = set()
        for index in self.frontier:
            while index >= 0 and index not in rows:
                rows.add(index)
                index = self.nodes[index].parent
        return sorted(rows)

    def feature(self, index: int) -> torch.Tensor:
        """The head's input feature at a node's row: its parent's h."""
        parent = self.nodes[index].parent
        hidden = self.root_hidden if parent < 0 else self.nodes[parent].hidden
        assert hidden is not None, "a pass row's parent was expanded by an earlier pass"
        return hidden

    def proposal(self) -> DraftProposal:
        """The cap best nodes, depth-first, likeliest child first."""
        best = self.best()
        position = {index: i for i, index in enumerate(best)}
        token_ids = [self.nodes[index].token_id for index in best]
        parents = [-1 if self.nodes[index].parent < 0 else position[self.nodes[index].parent]
                   for index in best]
        if not token_ids:
            return DraftProposal([])
        token_ids, parents = depth_first(token_ids, parents)
        return DraftProposal(token_ids, None, parents)


def draft_log_probs(logits: torch.Tensor, request: Request,
                    paths: list[list[int]]) -> torch.Tensor:
    """log q of the token after each of `paths`, transformed as the target's p will be there
    (engine/sample/drafting.py, as a chain's drafts): a greedy request's at temperature 1, a
    sampled one's after its temperature, min_p, top-k and top-p. logits: [len(paths), vocab];
    returns [len(paths), vocab] float32."""
    processed, metadata = draft_logits(logits, [request] * len(paths), paths)
    if request.params.is_greedy:
        return processed.float().log_softmax(dim=-1)
    return draft_probs(processed, metadata).log()
