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


def sibling_ranks(parents: Sequence[int]) -> list[int]:
    """Each draft's place among its parent's children, in order (0: the first, likeliest child)."""
    seen: dict[int, int] = {}
    ranks = []
    for parent in parents:
        ranks.append(seen.get(parent, 0))
        seen[parent] = ranks[-1] + 1
    return ranks


def verification_outcomes(parents: Sequence[int] | None, num_drafts: int,
                          accepted: Sequence[int], ranks: Sequence[int] | None = None,
                          ) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
    """What one verification told about its drafts, from its accepted path: every child of a kept
    node (the root first) was kept or not, since one token follows a node. Returns (first children:
    (depth, kept) of each such child of rank 0; later siblings: (rank, kept) of the others). `ranks`:
    each draft's rank in the proposer's own tree when this one is cut from it (default: its rank
    here). A chain that kept a of k drafts: depths 1..a kept, and a + 1 not if a < k."""
    if parents is None:
        parents = chain_parents(num_drafts)
    ranks = sibling_ranks(parents) if ranks is None else ranks
    node_depths = depths(parents)
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    first_children: list[tuple[int, bool]] = []
    later_siblings: list[tuple[int, bool]] = []
    for parent, kept in zip([-1, *accepted], [*accepted, None]):
        for child in children.get(parent, ()):
            if ranks[child] == 0:
                first_children.append((node_depths[child], child == kept))
            else:
                later_siblings.append((ranks[child], child == kept))
    return first_children, later_siblings


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
