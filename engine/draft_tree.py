"""The shape of a tree of drafts, as parent indices: what proposers return, the target verifies in
one pass and the rejection sampler walks.

A request's drafts d_0 .. d_{n-1} form a tree under its newest committed token (the root):
`parents[j]` is the index of d_j's parent draft, or -1 when d_j follows the root. Parents come before
children, depth-first with the likeliest child first, so the first branch (d_0, its first child, ...)
is the main chain and a prefix of the drafts is itself a tree. A chain is the tree whose parents are
-1, 0, 1, ...; `None` stands for it everywhere.

    drafts   a  b  c  d           root ── a ── b
    parents -1  0  0 -1                    │    (a's second child)
                                           ├── c
                                           └─(root's second child) d
"""

from __future__ import annotations

from collections.abc import Sequence

# a tree's verification rows (root + drafts) attend through a 64-bit ancestor mask per row
MAX_TREE_ROWS = 64


def chain_parents(num_drafts: int) -> list[int]:
    return list(range(-1, num_drafts - 1))


def check_parents(parents: Sequence[int]) -> None:
    """Raises ValueError unless `parents` is a tree in the order above."""
    if len(parents) + 1 > MAX_TREE_ROWS:
        raise ValueError(f"a draft tree holds at most {MAX_TREE_ROWS - 1} drafts, got "
                         f"{len(parents)}")
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"draft {node}'s parent {parent} must be -1 or an earlier draft")


def is_chain(parents: Sequence[int] | None) -> bool:
    return parents is None or all(parent == node - 1 for node, parent in enumerate(parents))


def main_chain_length(parents: Sequence[int] | None, num_drafts: int) -> int:
    """How many drafts from d_0 on form the first branch."""
    if parents is None:
        return num_drafts
    length = 0
    while length < len(parents) and parents[length] == length - 1:
        length += 1
    return length


def depths(parents: Sequence[int]) -> list[int]:
    """Each draft's depth below the root (d_0 is at depth 1)."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


def tested_depth(parents: Sequence[int] | None, num_drafts: int, accepted: Sequence[int]) -> int:
    """How many depths a verification tested: those of the accepted path, plus the next one when
    the path's last node (the root if none was accepted) has children to test there. A chain that
    kept a of k drafts tested a + 1 depths (a < k) or k."""
    if parents is None:
        return min(len(accepted) + 1, num_drafts)
    last = accepted[-1] if accepted else -1
    return len(accepted) + (last in parents)


def paths(parents: Sequence[int]) -> list[list[int]]:
    """Each draft's path from the root: the drafts on it, itself last."""
    path: list[list[int]] = []
    for node, parent in enumerate(parents):
        path.append(([] if parent < 0 else path[parent]) + [node])
    return path


def row_parents(num_known: int, parents: Sequence[int] | None, num_drafts: int) -> list[int]:
    """Parents over a verification's rows (its known tokens as a chain, then the drafts): row r's
    parent row, -1 for the first."""
    rows = list(range(-1, num_known - 1))
    drafts = chain_parents(num_drafts) if parents is None else parents
    return rows + [num_known - 1 if parent < 0 else num_known + parent for parent in drafts]


def row_paths(parents: Sequence[int] | None, num_drafts: int) -> list[list[int]]:
    """For a verification's rows (row 0 after the newest token, row 1 + j after draft j): the drafts
    each row has seen, in order (what counts as output before the token it chooses)."""
    if parents is None:
        return [list(range(row)) for row in range(num_drafts + 1)]
    return [[]] + paths(parents)


def depth_first(token_ids: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """The same tree in engine/draft_tree.py order: depth-first, each node's children in the order
    they are listed. `parents` lists every parent before its children."""
    children: list[list[int]] = [[] for _ in parents]
    roots = []
    for node, parent in enumerate(parents):
        (roots if parent < 0 else children[parent]).append(node)
    ordered_ids: list[int] = []
    ordered_parents: list[int] = []
    position = [0] * len(parents)
    stack = [(node, -1) for node in reversed(roots)]
    while stack:
        node, parent = stack.pop()
        position[node] = len(ordered_ids)
        ordered_ids.append(token_ids[node])
        ordered_parents.append(parent)
        stack += [(child, position[node]) for child in reversed(children[node])]
    return ordered_ids, ordered_parents
