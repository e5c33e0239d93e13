"""SuffixDecoding (arXiv 2411.04975): draft what most often followed the context's longest suffix,
in the request's own prompt + output or in recent outputs of finished requests of the same tenant
(suffix_cache.py). Free to compute, and strong wherever outputs repeat (agents, code edits,
templated answers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    O(max_depth) per token."""

    drafts_for_free = True

    def __init__(self, max_depth: int, max_cached_tokens: int, min_token_prob: float,
                 factor: float, is_cache_shared_across_tenants: bool = False) -> None:
        self.max_depth = max_depth
        self.min_token_prob = min_token_prob
        # the paper's MAX_SPEC = factor * match length: short matches are weak evidence
        self.factor = factor
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

    def _max_draft(self, match_length: int, cap: int) -> int:
        return min(cap, int(match_length * self.factor))
