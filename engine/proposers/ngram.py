"""Prompt lookup: if the context's last n tokens appeared earlier, guess that what followed then
follows again. Free to compute and strong wherever outputs copy their inputs (code edits, extraction).
With `tree`, several earlier occurrences are drafted at once as a tree of their continuations."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from engine.draft_tree import MAX_TREE_ROWS, depth_first
from engine.proposers.base import DraftProposal, Proposer
from engine.request import Request

# occurrences a draft tree is built from: the best-ranked ones (longest match, then most recent)
MAX_TREE_MATCHES = 16


def lookup_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-k tokens after the latest earlier occurrence of the longest matching suffix.

    tokens: [num_tokens] int64. Longer suffixes are tried first: they predict better.
    """
    num_tokens = len(tokens)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n:]
        # windows that start before the suffix itself: [num_tokens - n, n]
        windows = sliding_window_view(tokens[:num_tokens - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n  # the latest match: closest context, freshest copy
            return tokens[follow:follow + k].tolist()
    return []


def match_lengths(tokens: np.ndarray, max_n: int) -> np.ndarray:
    """[num_tokens - 1] int64: for each earlier position e, how many tokens ending at e (at most
    max_n) equal the context's last tokens; the continuation of a match at e starts at e + 1.

    tokens: [num_tokens] int64. One vectorised comparison per n, so O(num_tokens * max_n).
    """
    num_ends = len(tokens) - 1
    lengths = np.zeros(max(num_ends, 0), dtype=np.int64)
    is_match = np.ones_like(lengths, dtype=bool)
    for back in range(min(max_n, num_ends)):
        # the window ending at e reaches back to e - back; it must start at 0 or later
        is_match[:back] = False
        is_match[back:] &= tokens[:num_ends - back] == tokens[num_ends - back]
        if not is_match.any():
            break
        lengths += is_match
    return lengths


def lookup_tree(tokens: np.ndarray, min_n: int, max_n: int, k: int,
                max_matches: int = MAX_TREE_MATCHES) -> tuple[list[int], list[int]]:
    """A tree of at most k drafts (engine/draft_tree.py order) merging the continuations of up to
    max_matches earlier occurrences of the context's suffix; returns (token ids, parents).

    Matches rank by length (longest first, at most max_n), then recency. A draft's support is the
    matches whose continuation passes through it, compared longest matches first: one match of a
    longer n-gram outweighs any number of shorter ones, so the longest match decides, as in the
    chain draft, and shorter ones rank what it leaves open. The k best-supported drafts are kept
    (ties: the shallower draft, whose path is likelier to survive, then the better-ranked match),
    so with one longest match the main chain starts with `lookup_continuation`'s draft, and is it
    whenever that draft fills k.

    tokens: [num_tokens] int64. O(num_tokens * max_n + max_matches^2 * k), all vectorised.
    """
    k = min(k, MAX_TREE_ROWS - 1)
    lengths = match_lengths(tokens, max_n)
    ends = np.flatnonzero(lengths >= min_n)
    if k <= 0 or not len(ends):
        return [], []
    ends = ends[np.lexsort((-ends, -lengths[ends]))[:max_matches]]  # [m] longest, then latest
    num_matches = len(ends)
    match_ids = np.arange(num_matches)
    # the k tokens after each match, -1 past the context's end: [m, k]
    positions = ends[:, None] + 1 + np.arange(k)
    is_known = positions < len(tokens)
    follows = np.where(is_known, tokens[np.minimum(positions, len(tokens) - 1)], -1)
    # shares[i, j, d]: matches i and j continue alike for d + 1 tokens: [m, m, k]
    differs = follows[:, None, :] != follows[None, :, :]
    num_alike = np.where(differs.any(axis=2), differs.argmax(axis=2), k)  # [m, m]
    shares = num_alike[:, :, None] > np.arange(k)
    # a draft is the first d + 1 tokens after match i, named by the first match to continue so
    owner = shares.argmax(axis=1)  # [m, k]
    # support: how many matches of each length continue through the draft, shortest length
    # first: [num_lengths, m, k]
    length_ids = np.unique(lengths[ends], return_inverse=True)[1].reshape(-1)  # [m]
    is_length = np.eye(length_ids.max() + 1, dtype=np.int64)[length_ids]  # [m, num_lengths]
    support = np.einsum("ijd,jl->lid", shares, is_length)
    rows, depths = np.nonzero(is_known & (owner == match_ids[:, None]))  # [num_nodes] each
    # rank: support by the longest matches, then by shorter ones, then the shallower draft, then the
    # better-ranked match (lexsort sorts by its last key first). NOTE: a child never outranks its
    # parent (its matches are some of the parent's; on a tie the parent is shallower), so the best
    # k drafts form a tree; siblings keep this order, likeliest first
    best = np.lexsort((rows, depths, *-support[:, rows, depths]))[:k]
    rows, depths = rows[best], depths[best]
    index = np.full((num_matches, k), -1)
    index[rows, depths] = np.arange(len(best))
    parents = np.where(depths > 0, index[owner[rows, depths - 1], depths - 1], -1)
    return depth_first(follows[rows, depths].tolist(), parents.tolist())


class NgramProposer(Proposer):
    """Per step and request: a vectorised scan of the context, O(num_tokens * max_n); with `tree`,
    a vectorised merge of up to MAX_TREE_MATCHES continuations of k tokens,
    O(MAX_TREE_MATCHES^2 * k) (about 0.1 ms on a 2,000-token context, as much as the chain's scan)."""

    drafts_for_free = True

    def __init__(self, min_n: int, max_n: int, tree: bool = False) -> None:
        self.min_n, self.max_n = min_n, max_n
        # draft a tree of several matches' continuations, k its node budget, instead of one chain
        self.tree = tree

    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        proposals = []
        for request, k in zip(requests, max_num_tokens):
            if k <= 0:
                proposals.append(DraftProposal([]))
                continue
            tokens = np.asarray(request.prompt_token_ids + request.output_token_ids, dtype=np.int64)
            if self.tree:
                token_ids, parents = lookup_tree(tokens, self.min_n, self.max_n, k)
                proposals.append(DraftProposal(token_ids, parents=parents))
            else:
                proposals.append(
                    DraftProposal(lookup_continuation(tokens, self.min_n, self.max_n, k)))
        return proposals
