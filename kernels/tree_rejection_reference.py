"""Verifying a TREE of drafts, in torch: the executable specification (one request).

A tree's node 0 is the request's newest committed token; every other node is a draft token whose
parent comes before it. The target scores every node in one pass, so p[u] is its distribution of
the token after node u (rows 0..N-1, one per node):

    node   0      1     2     3     4             0 ── 1 ── 3
    token  t      a     b     c     d                  │    └─ 4
    parent -      0     0     1     1                  └─ 2

Walk from the root. At node u, try its children in order:
- greedy: the child whose token is argmax p[u], if any; else emit argmax p[u] and stop;
- sampling (multi-draft rejection sampling, as SpecInfer): child c with token x, drawn from q_c,
  is accepted when u_c < p(x) / q_c(x), with p the residual so far (p[u] at the first child); when
  rejected, the residual becomes norm(max(0, p - q_c)). A one-hot child (q_c = δ_x: an n-gram match,
  a suffix-tree continuation, a top-k expansion) is accepted with probability p(x) and rejected by
  zeroing x. When every child is rejected, the token emitted is drawn from the residual; at a leaf
  (every drafted token accepted) the bonus token is drawn from p[leaf].
Each child's test is an ordinary rejection step against what is left of p, so the token emitted at
every depth follows p exactly whatever the drafts are, the chain case (one child per node) included.

The result is the accepted path (node ids after the root) and the tokens to commit: the accepted
drafts, then the recovered or bonus token. Draws use the chain sampler's fixed-point inverse CDF
(rejection_reference.py).

This is the specification in exact arithmetic's spirit (float64, p renormalised). The engine's
batched sampler (tree_rejection.py, and its Triton kernel, which agree bit for bit) follows the chain
sampler's conventions at the edges instead, so that a chain gives the chain sampler's tokens exactly:
a draft with q(x) = 0 is accepted where p(x) > 0, a residual is "empty" when its fixed-point total
is, and the test and residual are computed in float32 on p as given. Both follow p; they differ
only at those rounding edges, and agree on every random tree the tests draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.rejection_reference import FIXED_POINT_BITS


@dataclass
class DraftTree:
    token_ids: list[int]  # [N]: node 0 the newest committed token, then drafts
    parents: list[int]  # [N]: parents[0] = -1; parents[i] < i
    # [N, vocab] q of each node's token (row 0 unused), or None: every draft is one-hot
    draft_probs: Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents) or not self.parents or self.parents[0] != -1:
            raise ValueError("a tree needs node 0 (the root, parent -1) and one parent per node")
        if any(not 0 <= parent < node for node, parent in enumerate(self.parents) if node):
            raise ValueError("every node's parent must come before it")

    def children(self, node: int) -> list[int]:
        return [child for child, parent in enumerate(self.parents) if parent == node]

    def depth(self, node: int) -> int:
        depth = 0
        while node:
            node, depth = self.parents[node], depth + 1
        return depth


@dataclass
class TreeVerdict:
    accepted_nodes: list[int]  # the accepted path, root excluded
    token_ids: list[int]  # the accepted drafts, then the recovered or bonus token


def verify_tree(tree: DraftTree, target_probs: Tensor, is_greedy: bool,
                acceptance_uniforms: Tensor | None = None,
                sample_uniforms: Tensor | None = None) -> TreeVerdict:
    """target_probs: [N, vocab] p after each node. acceptance_uniforms: [N] in [0, 1), one per node
    (read when the node is tried); sample_uniforms: [N] in [0, 1), one per node (read for the token
    drawn after it)."""
    node, path = 0, []
    while True:
        p = target_probs[node].double()
        if is_greedy:
            choice = int(p.argmax())
            child = next((c for c in tree.children(node) if tree.token_ids[c] == choice), None)
            if child is None:
                return TreeVerdict(path, [tree.token_ids[n] for n in path] + [choice])
            node = child
            path.append(node)
            continue
        residual = p / p.sum()
        accepted = None
        for child in tree.children(node):
            token = tree.token_ids[child]
            q = None if tree.draft_probs is None else tree.draft_probs[child].double()
            q_token = 1.0 if q is None else float(q[token])
            if q_token > 0 and float(acceptance_uniforms[child]) * q_token < float(residual[token]):
                accepted = child
                break
            residual = _reject(residual, token, q)
        if accepted is None:
            token = _draw(residual, float(sample_uniforms[node]))
            return TreeVerdict(path, [tree.token_ids[n] for n in path] + [token])
        node = accepted
        path.append(node)


def _reject(residual: Tensor, token: int, q: Tensor | None) -> Tensor:
    """What is left of p after a rejected draft, normalized: max(0, p - q), or p without `token` for
    one-hot q; p itself when that leaves nothing (p <= q), as the chain sampler does."""
    if q is None:
        left = residual.clone()
        left[token] = 0.0
    else:
        left = (residual - q).clamp_min(0.0)
    total = float(left.sum())
    return left / total if total > 0 else residual


def _draw(weights: Tensor, uniform: float) -> int:
    """Inverse CDF over fixed-point weights: exact, and never a zero-weight token."""
    fixed = torch.floor(weights / weights.sum() * 2.0**FIXED_POINT_BITS).to(torch.int64)
    cdf = fixed.cumsum(0)
    total = int(cdf[-1])
    point = min(int(uniform * total), total - 1)
    return int(torch.searchsorted(cdf, torch.tensor(point), right=True))
