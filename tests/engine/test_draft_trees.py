"""The model-free proposers' draft trees (`tree=True`): valid trees in engine/draft_tree.py's order
(depth-first, likeliest sibling first, every prefix a tree) within the node budget, holding the
best-supported (n-gram) or likeliest (suffix) continuations, checked against brute force; the main
chain is the chain proposer's draft where the evidence has one continuation."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from engine import SamplingParams
from engine.draft_tree import MAX_TREE_ROWS, check_parents, depth_first, depths, paths
from engine.proposers.ngram import NgramProposer, lookup_continuation, lookup_tree
from engine.proposers.suffix import SuffixProposer
from engine.proposers.suffix_tree import SuffixTree
from engine.request import Request
from engine.step.layout import DraftProposal

_request_ids = itertools.count()


def make_request(prompt: Sequence[int], output: Sequence[int] = (),
                 request_id: str | None = None) -> Request:
    request = Request(request_id or f"t{next(_request_ids)}", list(prompt),
                      SamplingParams(temperature=0.0), frozenset(), cache_salt="tenant")
    request.output_token_ids.extend(output)
    return request


def tree_paths(proposal: DraftProposal) -> list[tuple[int, ...]]:
    """Each draft's tokens from the root, itself last."""
    parents = proposal.parents or list(range(-1, len(proposal.token_ids) - 1))
    return [tuple(proposal.token_ids[j] for j in path) for path in paths(parents)]


def assert_valid_tree(proposal: DraftProposal, cap: int,
                      likelihood: Callable[[tuple[int, ...]], float] = lambda path: 0) -> None:
    """Within the cap, parents before children, depth-first, siblings distinct and likeliest first,
    and every prefix still a tree."""
    num_drafts = len(proposal.token_ids)
    assert num_drafts <= min(cap, MAX_TREE_ROWS - 1)
    parents = proposal.parents or list(range(-1, num_drafts - 1))
    check_parents(parents)
    node_paths = paths(parents)
    for node in range(1, num_drafts):
        # depth-first: a node hangs under the root or under its predecessor's path
        assert parents[node] == -1 or parents[node] in node_paths[node - 1], parents
    token_paths = tree_paths(proposal)
    assert len(set(token_paths)) == num_drafts, "two siblings draft the same token"
    for parent in set(parents):
        siblings = [likelihood(token_paths[j]) for j in range(num_drafts) if parents[j] == parent]
        assert siblings == sorted(siblings, reverse=True), (parent, siblings)
    for k in range(num_drafts + 1):
        DraftProposal(proposal.token_ids[:k], parents=parents[:k])  # validates
        assert proposal.first(k).token_ids == proposal.token_ids[:k]


# ---------------------------------------------------------------------- n-gram
def ngram_support(tokens: list[int], min_n: int, max_n: int, k: int,
                  max_matches: int) -> tuple[Counter, Counter]:
    """Brute force: each continuation prefix (up to k tokens) after an earlier match of the
    context's last n >= min_n tokens, and its support: the summed weights of the matches it follows,
    (max_matches + 1) ** (n - min_n) for a match of n tokens (at most max_n); and how many matches
    there are of each n."""
    num_tokens = len(tokens)
    support, num_matches = Counter(), Counter()
    for end in range(num_tokens - 1):
        n = 0
        while n < max_n and end - n >= 0 and tokens[end - n] == tokens[num_tokens - 1 - n]:
            n += 1
        if n >= min_n:
            num_matches[n] += 1
            follow = tokens[end + 1:end + 1 + k]
            for length in range(1, len(follow) + 1):
                support[tuple(follow[:length])] += (max_matches + 1) ** (n - min_n)
    return support, num_matches


def ngram_tree(tokens: list[int], min_n: int, max_n: int, k: int,
               max_matches: int = 16) -> DraftProposal:
    token_ids, parents = lookup_tree(np.array(tokens), min_n, max_n, k, max_matches)
    return DraftProposal(token_ids, parents=parents)


NGRAM_TREE_CASES = [
    # tokens, min_n, max_n, k, expected drafts, their parents
    # "1 2" went on with 3 twice (older), 5 once (newest): the majority leads, 5 branches off
    ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 5, 6, 1, 2], 2, 2, 4, [3, 8, 5, 6], [-1, 0, -1, 2]),
    # ties in support: the shallower draft first
    ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 5, 6, 1, 2], 2, 2, 3, [3, 5, 6], [-1, -1, 1]),
    ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 5, 6, 1, 2], 2, 2, 1, [3], [-1]),
    # equal support: the newer match first (the chain's choice), the other one a sibling
    ([9, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2, [8, 7], [-1, -1]),
    # one match of the 3-gram "7 8 9" outweighs the newer 2-gram "8 9" and 1-gram "9" matches
    ([7, 8, 9, 1, 8, 9, 2, 9, 3, 7, 8, 9], 1, 3, 3, [1, 8, 9], [-1, 0, 1]),
    ([7, 8, 9, 1, 8, 9, 2, 9, 3, 7, 8, 9], 1, 3, 6, [1, 8, 9, 2, 9, 3], [-1, 0, 1, 2, 3, 4]),
    # ... and where its continuation runs out, the shorter matches fill the budget
    ([7, 8, 9, 1, 8, 9, 2, 9, 3, 7, 8, 9], 1, 3, 12,
     [1, 8, 9, 2, 9, 3, 7, 8, 9, 2, 9, 3], [-1, 0, 1, 2, 3, 4, 5, 6, 7, -1, 9, 10]),
    ([5, 6, 7, 8], 1, 3, 4, [], []),  # nothing repeats
    ([4], 1, 3, 2, [], []),
    ([1, 2, 1, 2], 1, 2, 0, [], []),  # no budget
]


@pytest.mark.parametrize("tokens, min_n, max_n, k, expected, parents", NGRAM_TREE_CASES)
def test_ngram_tree_merges_the_continuations_of_several_matches(tokens, min_n, max_n, k, expected,
                                                                parents):
    proposal = ngram_tree(tokens, min_n, max_n, k)
    assert (proposal.token_ids, proposal.parents or list(range(-1, len(expected) - 1))) \
        == (expected, parents)


@pytest.mark.parametrize("seed", range(4))
def test_ngram_tree_keeps_the_best_supported_continuations(seed):
    """Random contexts over a few tokens (many matches): the kept drafts are the k best-supported
    of all the matches' continuations, in a valid tree; with one match of the longest n-gram the
    main chain starts with the chain draft (is it when that fills k); with one match allowed, the
    tree is the chain draft."""
    rng = random.Random(seed)
    num_trees = 0
    for _ in range(60):
        tokens = [rng.randrange(rng.randint(2, 4)) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 2)
        max_n, k = rng.randint(min_n, 4), rng.randint(0, 12)
        support, num_matches = ngram_support(tokens, min_n, max_n, k, max_matches=100)
        proposal = ngram_tree(tokens, min_n, max_n, k, max_matches=100)
        assert_valid_tree(proposal, k, lambda path: support[path])
        num_trees += proposal.is_tree
        kept = sorted(((support[p], len(p)) for p in tree_paths(proposal)), reverse=True)
        best = sorted(((count, len(p)) for p, count in support.items()),
                      key=lambda item: (-item[0], item[1]))[:k]
        assert kept == sorted(best, reverse=True)

        chain = lookup_continuation(np.array(tokens), min_n, max_n, k)
        main_chain = proposal.main_chain().token_ids
        if num_matches and num_matches[max(num_matches)] == 1:
            assert main_chain[:len(chain)] == chain
            assert len(chain) < k or main_chain == chain
        single = ngram_tree(tokens, min_n, max_n, k, max_matches=1)
        assert (single.token_ids, single.parents) == (chain, None)
    assert num_trees > 10


def test_ngram_proposer_budgets():
    """Caps 0, 1, k and past the tree's row limit; tree=False drafts the same chains as before."""
    prompt = random.Random(7).choices(range(3), k=300)
    requests = [make_request(prompt) for _ in range(5)]
    caps = [0, 1, 5, 20, 200]
    trees = NgramProposer(1, 3, tree=True).propose(requests, caps, None)
    for proposal, cap in zip(trees, caps):
        assert len(proposal.token_ids) == min(cap, MAX_TREE_ROWS - 1)
        assert_valid_tree(proposal, cap)
    assert any(proposal.is_tree for proposal in trees)
    chains = NgramProposer(1, 3).propose(requests, caps, None)
    for proposal, cap in zip(chains, caps):
        assert proposal.parents is None
        assert proposal.token_ids == lookup_continuation(np.array(prompt), 1, 3, cap)


# ---------------------------------------------------------------------- suffix
def suffix_tree_proposer(min_token_prob: float = 0.1, factor: float = 1.0,
                         max_depth: int = 24) -> SuffixProposer:
    return SuffixProposer(max_depth, 1000, min_token_prob, factor, tree=True)


def suffix_draft(suffix: SuffixProposer, request: Request, cap: int) -> tuple[list, list | None]:
    proposal = suffix.propose([request], [cap], None)[0]
    return proposal.token_ids, proposal.parents


# "9 1 2" went on with "3 9 1 ..." twice and "4 9 ..." once
TWO_WAYS = [9, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]


@pytest.mark.parametrize("min_token_prob, cap, expected, parents", [
    (0.3, 4, [3, 9, 1, 4], [-1, 0, 1, -1]),  # 4 (1/3) is above 0.3: a second branch
    (0.3, 3, [3, 9, 1], None),  # ... but 9 and 1 (2/3 each) come first
    (0.3, 8, [3, 9, 1, 4, 9, 1], [-1, 0, 1, -1, 3, 4]),  # depth 3: the match has 3 tokens
    (0.4, 8, [3, 9, 1], None),  # 4 is below 0.4: the chain alone
    (0.3, 1, [3], None),
    (0.3, 0, [], None),
])
def test_suffix_tree_branches_where_the_second_continuation_is_likely_enough(
        min_token_prob, cap, expected, parents):
    suffix = suffix_tree_proposer(min_token_prob)
    assert suffix_draft(suffix, make_request(TWO_WAYS), cap) == (expected, parents)
    chain = SuffixProposer(24, 1000, min_token_prob, 1.0).propose([make_request(TWO_WAYS)], [cap],
                                                                  None)[0]
    assert chain.parents is None and chain.token_ids == expected[:len(chain.token_ids)]


def test_suffix_tree_depth_follows_the_match_length_rule():
    """A 2-token match drafts 2 deep (factor 1) or 4 (factor 2), whatever the node budget."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2]
    for factor, expected in [(1.0, [3, 4]), (2.0, [3, 4, 5, 6]), (0.5, [3])]:
        assert suffix_draft(suffix_tree_proposer(factor=factor), make_request(prompt), 12) \
            == (expected, None)


def test_suffix_tree_drafts_from_the_cached_outputs():
    output = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    suffix = suffix_tree_proposer()
    earlier = make_request([1, 2, 3], output, request_id="earlier")
    suffix.propose([earlier], [0], None)
    suffix.free("earlier")
    assert suffix_draft(suffix, make_request([7, 8] + output[:6]), 4) == (output[6:10], None)


def pattern_counts(seq: list[int], max_depth: int) -> Counter:
    """Brute force: how many suffixes, cut at max_depth, start with each pattern."""
    return Counter(tuple(seq[start:end]) for start in range(len(seq))
                   for end in range(start + 1, min(start + max_depth, len(seq)) + 1))


def continuation_probs(counts: Counter, pattern: tuple[int, ...], vocab: int, max_draft: int,
                       min_prob: float) -> dict[tuple[int, ...], float]:
    """Brute force: every continuation of `pattern` up to max_draft tokens whose probability (the
    product of count(next) / sum of the counts of all nexts) is at least min_prob."""
    probs, frontier = {}, [((), 1.0)]
    while frontier:
        path, prob = frontier.pop()
        if len(path) == max_draft:
            continue
        nexts = {t: counts[pattern + path + (t,)] for t in range(vocab)}
        total = sum(nexts.values())
        for token, count in nexts.items():
            if count and prob * (count / total) >= min_prob:
                probs[path + (token,)] = prob * (count / total)
                frontier.append((path + (token,), probs[path + (token,)]))
    return probs


@pytest.mark.parametrize("seed", range(4))
def test_speculation_tree_keeps_the_likeliest_paths(seed):
    """Random sequences and patterns: SuffixTree.speculation_tree keeps the budget's likeliest
    continuations (brute-force probabilities), each above min_prob and within the depth, with the
    sum of their probabilities as score; laid out depth-first by the proposer, the main chain is
    the chain walk's draft once the budget holds the whole tree."""
    rng = random.Random(seed)
    num_trees = 0
    for _ in range(40):
        max_depth, vocab = rng.randint(3, 8), rng.randint(2, 4)
        seq = [rng.randrange(vocab) for _ in range(rng.randint(5, 50))]
        tree = SuffixTree(max_depth)
        tree.extend(seq)
        start = rng.randrange(len(seq))
        pattern = tuple(seq[start:start + rng.randint(0, max_depth - 1)])
        node, offset = tree.locate(list(pattern), 0, len(pattern))
        min_prob, max_draft = rng.choice([0.0, 0.2, 0.4]), rng.randint(1, 6)
        probs = continuation_probs(pattern_counts(seq, max_depth), pattern, vocab, max_draft,
                                   min_prob)
        for budget in (0, 1, 3, 7, MAX_TREE_ROWS - 1):
            token_ids, parents, score = SuffixTree.speculation_tree(node, offset, budget, max_draft,
                                                                   min_prob)
            ordered_ids, ordered_parents = depth_first(token_ids, parents)
            proposal = DraftProposal(ordered_ids, parents=ordered_parents)
            assert_valid_tree(proposal, budget, lambda path: probs[path])
            num_trees += proposal.is_tree
            kept = sorted((probs[path] for path in tree_paths(proposal)), reverse=True)
            assert kept == pytest.approx(sorted(probs.values(), reverse=True)[:budget])
            assert score == pytest.approx(sum(kept))
            assert max(depths(parents), default=0) <= max_draft
            if budget >= len(probs):
                chain, _ = SuffixTree.continuation(node, offset, max_draft, min_prob)
                assert proposal.main_chain().token_ids == chain
    assert num_trees > 10
