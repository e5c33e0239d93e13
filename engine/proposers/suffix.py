"""SuffixDecoding (arXiv 2411.04975): draft what most often followed the context's longest suffix,
in the request's own prompt + output or in recent outputs of finished requests of the same tenant
(suffix_cache.py). Free to compute, and strong wherever outputs repeat (agents, code edits,
templated answers). With `tree`, the likeliest continuations branch into a tree of drafts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.draft_tree import MAX_TREE_ROWS, depth_first
from engine.proposers.base import DraftProposal, Proposer
from engine.proposers.suffix_cache import TenantOutputCaches
from engine.proposers.suffix_tree import SuffixTree
from engine.request import Request


@dataclass
class _RequestState:
    # the request tracked, so a reused request id cannot inherit another request's tree
    request: Request
    # prompt + output tokens known so far (tree.tokens), indexed in their own tree
    tree: SuffixTree


class SuffixProposer(Proposer):
    """Per step and request: O(max_depth) per new token to index it, O(max_depth * log(max_depth))
    to match in each cached tree, O(k) per draft walked (up to max_depth walks in the request's own
    tree when its matches draft poorly); never O(context). `free` caches the output at
    O(max_depth) per token. With `tree`, each walk grows a tree best-first: O(k log k) plus the
    children it looks at."""

    drafts_for_free = True

    def __init__(self, max_depth: int, max_cached_tokens: int, min_token_prob: float,
                 factor: float, is_cache_shared_across_tenants: bool = False,
                 tree: bool = False) -> None:
        self.max_depth = max_depth
        self.min_token_prob = min_token_prob
        # the paper's MAX_SPEC = factor * match length: short matches are weak evidence
        self.factor = factor
        # draft a tree of the likeliest continuations, the cap its node budget, instead of a chain
        self.tree = tree
        self.cache = TenantOutputCaches(max_depth, max_cached_tokens,
                                        is_cache_shared_across_tenants)
        self._states: dict[str, _RequestState] = {}

    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        proposals = []
        for request, cap in zip(requests, max_num_tokens):
            state = self._states.get(request.request_id)
            if state is None or state.request is not request:
                state = self._states[request.request_id] = _RequestState(
                    request, SuffixTree(self.max_depth))
            if cap <= 0:
                # index lazily: a request that never speculates never pays for its tree
                proposals.append(DraftProposal([]))
                continue
            tree = state.tree
            tree.extend(request.token_ids_between(len(tree.tokens), request.num_tokens))
            cached_trees = self.cache.trees(request.cache_salt)
            if self.tree:
                proposals.append(self._draft_tree(tree, cached_trees, cap))
            else:
                proposals.append(DraftProposal(self._draft(tree, cached_trees, cap)))
        return proposals

    def free(self, request_id: str) -> None:
        """Drop the request's tree; its output joins its tenant's cache for later requests."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.add(state.request.cache_salt, state.request.output_token_ids)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._states)

    def _draft(self, tree: SuffixTree, cached_trees: list[SuffixTree], cap: int) -> list[int]:
        """The best-scoring draft (score: expected accepted tokens) from the request's own tree and
        from the deepest match in each of its tenant's cached trees; ties go to the request's own
        tree, then to newer outputs."""
        cap = min(cap, self.max_depth - 1)
        # a match plus its draft must fit in max_depth tokens, the deepest path the trees index
        max_match = self.max_depth - cap
        best_draft, best_score = [], 0.0
        for repeat in tree.repeats(max_match):
            # NOTE: in a loop the deepest match sits right behind the context's end, so little
            # follows it yet; shallower matches see further. Stop once none can score higher.
            max_draft = self._max_draft(repeat.depth, cap)
            if max_draft <= best_score:
                break
            draft, score = tree.continuation(repeat, repeat.length, max_draft, self.min_token_prob)
            if score > best_score:
                best_draft, best_score = draft, score
        for cached in cached_trees:
            node, offset, match_length = cached.longest_match(tree.tokens, max_match)
            if match_length == 0:
                continue
            draft, score = cached.continuation(node, offset, self._max_draft(match_length, cap),
                                               self.min_token_prob)
            if score > best_score:
                best_draft, best_score = draft, score
        return best_draft

    def _draft_tree(self, tree: SuffixTree, cached_trees: list[SuffixTree],
                    budget: int) -> DraftProposal:
        """`_draft`'s search with trees: the best-scoring tree (score: expected accepted tokens)
        of up to `budget` drafts, none deeper than the chain `_draft` would draft from its match.

        One source (a match in the request's own tree or in one cached tree) wins, as in `_draft`
        and in SuffixDecoding: each source's probabilities are estimated from its own counts, over
        different texts and match lengths, so they would not add up to one distribution in a
        merged tree."""
        budget = min(budget, MAX_TREE_ROWS - 1)
        depth = min(budget, self.max_depth - 1)
        # NOTE: as in `_draft` a match leaves room for a full-depth draft, but never less than half
        # the indexed depth: a large node budget spreads over branches, and 1-token matches
        # would make poor trees
        max_match = max(self.max_depth - depth, self.max_depth // 2)
        best_draft: tuple[list[int], list[int]] = ([], [])
        best_score = 0.0
        for repeat in tree.repeats(max_match):
            # a tree holds at most one accepted token per depth: its score is at most its depth
            max_draft = self._max_draft(repeat.depth, depth)
            if max_draft <= best_score:
                break
            token_ids, parents, score = SuffixTree.speculation_tree(
                repeat, repeat.length, budget, max_draft, self.min_token_prob)
            if score > best_score:
                best_draft, best_score = (token_ids, parents), score
        for cached in cached_trees:
            node, offset, match_length = cached.longest_match(tree.tokens, max_match)
            if match_length == 0:
                continue
            token_ids, parents, score = SuffixTree.speculation_tree(
                node, offset, budget, self._max_draft(match_length, depth), self.min_token_prob)
            if score > best_score:
                best_draft, best_score = (token_ids, parents), score
        token_ids, parents = depth_first(*best_draft)
        return DraftProposal(token_ids, parents=parents)

    def _max_draft(self, match_length: int, cap: int) -> int:
        return min(cap, int(match_length * self.factor))
