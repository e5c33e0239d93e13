"""Suffix decoding: the suffix tree counts patterns exactly, drafts follow the most frequent
continuation for as long as the match earns, the cache of finished outputs helps later requests and
stays bounded, and greedy output with suffix drafts is token-identical to plain decoding."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence

import pytest
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.proposers.suffix import SuffixProposer
from engine.proposers.suffix_cache import OutputCache
from engine.proposers.suffix_tree import SuffixTree
from engine.request import Request
from engine.spec_config import SpeculativeConfig

_request_ids = itertools.count()


def make_request(prompt: Sequence[int], output: Sequence[int] = (),
                 request_id: str | None = None) -> Request:
    # NOTE: one tenant for every request here; tests/engine/test_suffix_tenancy.py covers tenancy
    request = Request(request_id or f"r{next(_request_ids)}", list(prompt),
                      SamplingParams(temperature=0.0), frozenset(), cache_salt="tenant")
    request.output_token_ids.extend(output)
    return request


def proposer(max_depth: int = 24, max_cached_tokens: int = 1000, min_token_prob: float = 0.1,
             factor: float = 1.0) -> SuffixProposer:
    return SuffixProposer(max_depth, max_cached_tokens, min_token_prob, factor)


def draft(suffix: SuffixProposer, request: Request, cap: int = 4) -> list[int]:
    return suffix.propose([request], [cap], None)[0].token_ids


# ---------------------------------------------------------------------- the tree
def pattern_counts(sequences: list[list[int]], max_depth: int) -> Counter:
    """Brute force: how many suffixes, cut at max_depth, start with each pattern."""
    counts = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + max_depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def tree_count(tree: SuffixTree, pattern: tuple[int, ...]) -> int:
    found = tree.locate(list(pattern), 0, len(pattern))
    return 0 if found is None else found[0].count


@pytest.mark.parametrize("seed", range(6))
def test_tree_counts_every_pattern_exactly(seed):
    """Closed sequences plus one open sequence fed in uneven chunks (as steps commit them) count
    each pattern as often as brute force does, with O(tokens) nodes."""
    rng = random.Random(seed)
    max_depth, vocab = rng.randint(2, 7), rng.randint(2, 4)
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    tree = SuffixTree(max_depth)
    for seq in sequences[:-1]:
        tree.add_sequence(seq)
    tree.add_sequence([])
    position = 0
    while position < len(sequences[-1]):
        step = rng.randint(1, 5)
        tree.extend(sequences[-1][position:position + step])
        position += step
    expected = pattern_counts(sequences, max_depth)
    assert {p: tree_count(tree, p) for p in expected} == dict(expected)
    assert tree_count(tree, (vocab,)) == 0
    num_nodes, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        num_nodes += 1
        stack += node.children.values()
        assert node.num_continued == sum(c.count for c in node.children.values()) <= node.count
        if node.children:
            assert node.best_child.count == max(c.count for c in node.children.values())
    assert num_nodes <= 2 * sum(map(len, sequences)) + 1


# ---------------------------------------------------------------------- drafting
DRAFT_CASES = [
    # prompt, cap, expected draft
    ([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 4, [4, 5, 6]),  # 3 tokens matched: at most 3 drafted
    ([1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4], 4, [5, 6, 7, 9]),
    ([1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4], 2, [5, 6]),  # the engine's cap wins
    ([1, 2, 3, 4, 5, 6, 9, 1], 4, [2]),  # a 1-token match earns a 1-token draft
    ([1, 2, 3, 4, 5, 6], 4, []),  # nothing repeats: no draft
    ([1, 2, 3, 1, 2, 3], 0, []),  # cap 0: no draft
    ([5, 1, 2, 7, 6, 1, 2, 7, 3, 1, 2, 8, 4, 1, 2], 1, [7]),  # 7 followed "1 2" twice, 8 once
    ([5, 1, 2, 8, 6, 1, 2, 7, 3, 1, 2, 8, 4, 1, 2], 1, [8]),
    # a loop: the deepest match ("7 7 7 7 7") is followed by one 7 so far, a 3-token one by three
    ([7, 7, 7, 7, 7, 7], 4, [7, 7, 7]),
]


@pytest.mark.parametrize("prompt, cap, expected", DRAFT_CASES)
def test_draft_follows_the_most_frequent_continuation(prompt, cap, expected):
    assert draft(proposer(), make_request(prompt), cap) == expected


@pytest.mark.parametrize("prompt, cap, expected", DRAFT_CASES)
def test_a_draft_tree_of_one_continuation_is_the_chain_draft(prompt, cap, expected):
    """With `tree`, where the evidence does not branch (or the cap leaves no room to) the tree is
    the chain draft (tests/engine/test_draft_trees.py covers branching)."""
    suffix = SuffixProposer(24, 1000, 0.1, 1.0, tree=True)
    proposal = suffix.propose([make_request(prompt)], [cap], None)[0]
    assert (proposal.token_ids, proposal.parents) == (expected, None)


def test_longer_matches_earn_longer_drafts():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2]
    assert draft(proposer(factor=1.0), make_request(prompt), 8) == [3, 4]
    assert draft(proposer(factor=2.0), make_request(prompt), 8) == [3, 4, 5, 6]
    assert draft(proposer(factor=0.5), make_request(prompt), 8) == [3]


def test_draft_stops_where_the_path_gets_unlikely():
    """After "0 1 2" came "3" three times out of three, then "5" two times out of three."""
    prompt = [0, 1, 2, 3, 5, 0, 1, 2, 3, 5, 0, 1, 2, 3, 4, 0, 1, 2]
    assert draft(proposer(min_token_prob=0.5), make_request(prompt), 3) == [3, 5, 0]
    assert draft(proposer(min_token_prob=0.7), make_request(prompt), 3) == [3]
    assert draft(proposer(min_token_prob=0.0), make_request([0, 1, 0, 2, 0, 3, 0]), 1) == [1]


def test_draft_fills_the_cap_and_never_passes_it():
    suffix = proposer(factor=4.0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 6  # a loop: there is always more to copy
    for cap in range(8):
        assert len(draft(suffix, make_request(prompt), cap)) == cap


def test_incremental_appends_draft_like_a_rebuild():
    """One proposer fed the tokens as steps commit them drafts what a fresh one drafts from the
    whole context at every step."""
    rng = random.Random(3)
    stream = [rng.randrange(6) for _ in range(300)]
    incremental = proposer(max_depth=8)
    request = make_request(stream[:20])
    position = 20
    while position < len(stream):
        position += rng.randint(1, 5)
        request.output_token_ids[:] = stream[20:position]
        rebuilt = make_request(stream[:20], stream[20:position])
        assert draft(incremental, request, 4) == draft(proposer(max_depth=8), rebuilt, 4)


def test_free_drops_the_request_state():
    suffix = proposer()
    first = make_request([1, 2, 3, 1, 2], request_id="a")
    assert draft(suffix, first) == [3, 1]
    assert suffix.num_tracked_requests == 1
    suffix.free("a")
    suffix.free("a")  # freeing twice, or an unknown id, is harmless
    assert suffix.num_tracked_requests == 0
    # the same id for a new request starts from its own tokens, not the old tree
    assert draft(suffix, make_request([4, 5, 6], request_id="a")) == []


# ---------------------------------------------------------------------- the cache of outputs
def test_cached_output_helps_a_later_request():
    output = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    later_prompt = [7, 8] + output[:6]
    suffix = proposer()
    assert draft(suffix, make_request(later_prompt)) == []
    earlier = make_request([1, 2, 3], output, request_id="earlier")
    suffix.propose([earlier], [0], None)  # tracked, though never drafted for
    suffix.free("earlier")
    assert suffix.cache.num_cached_tokens == len(output)  # outputs only, not prompts
    assert draft(suffix, make_request(later_prompt)) == output[6:10]


def test_cache_off_caches_nothing():
    suffix = proposer(max_cached_tokens=0)
    suffix.propose([make_request([1], [40, 41, 42, 43], request_id="a")], [4], None)
    suffix.free("a")
    assert suffix.cache.num_cached_tokens == 0
    assert draft(suffix, make_request([40, 41, 42])) == []


def test_eviction_keeps_the_cache_bounded_and_drops_the_oldest():
    cache = OutputCache(max_depth=8, max_cached_tokens=100)
    outputs = [[1000 * i + t for t in range(17)] for i in range(40)]
    for output in outputs:
        cache.add(output)
        assert cache.num_cached_tokens <= 100
    assert cache.num_cached_tokens >= 50
    cache.add(list(range(500)))  # longer than a generation: its last tokens are kept
    assert cache.num_cached_tokens <= 100

    def occurs(tokens: list[int]) -> bool:
        return any(tree.locate(tokens, 0, len(tokens)) for tree in cache.trees)

    assert occurs(list(range(492, 500))) and not occurs([0, 1])
    assert occurs(outputs[-1][:5]) and not occurs(outputs[0][:5])


# ---------------------------------------------------------------------- config
def test_suffix_config_parses_with_defaults():
    config = SpeculativeConfig.from_json('{"method": "suffix", "num_speculative_tokens": 4, '
                                         '"suffix_factor": 2, "suffix_min_token_prob": 0.25}')
    assert (config.suffix_factor, config.suffix_min_token_prob) == (2, 0.25)
    assert (config.suffix_max_depth, config.suffix_max_cached_tokens) == (24, 65536)


@pytest.mark.parametrize("settings, message", [
    ({"suffix_max_depth": 1}, "suffix_max_depth must be in"),
    ({"suffix_max_depth": 4}, "must exceed num_speculative_tokens"),
    ({"suffix_max_depth": 24.0}, "'suffix_max_depth' must be int"),
    ({"suffix_max_cached_tokens": -1}, "suffix_max_cached_tokens must be >= 0"),
    ({"suffix_min_token_prob": 1.5}, r"suffix_min_token_prob must be in \[0, 1\]"),
    ({"suffix_min_token_prob": "0.1"}, "'suffix_min_token_prob' must be Real"),
    ({"suffix_factor": 0}, "suffix_factor must be a finite number > 0"),
    ({"suffix_factor": float("inf")}, "suffix_factor must be a finite number > 0"),
    ({"suffix_factor": True}, "'suffix_factor' must be Real"),
])
def test_bad_suffix_configs_fail_clearly(settings, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json({"method": "suffix", "num_speculative_tokens": 4, **settings})


# ---------------------------------------------------------------------- lossless end to end
PROMPTS = [
    [1, 5, 9, 13, 2, 7, 5, 9, 13, 2],
    [1] + list(range(30, 50)) + list(range(30, 42)),
    [1, 60],
    [1, 11, 12, 13, 11, 12, 13, 11, 12],
]
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("suffix_llama"), "llama", seed=5)


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    plain = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64)
    outs = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy())
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.promise("greedy-lossless:suffix")
@pytest.mark.parametrize("caps, setup", [
    ([None, None, None, None], {}),
    # per-request caps (None = engine k, 0 = off), tiny KV blocks, a token budget that cuts drafts
    ([1, None, 0, 2], {"block_size": 4, "max_num_batched_tokens": 6}),
])
def test_greedy_suffix_is_token_identical_and_a_warm_cache_accepts_more(checkpoint, expected, caps,
                                                                          setup):
    llm = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64,
              speculative_config=SUFFIX, **setup)
    params = [greedy(num_speculative_tokens=cap) for cap in caps]
    num_accepted = []
    for _ in range(2):  # the second batch drafts from the first batch's outputs too
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        for cap, out in zip(caps, outs):
            assert (out.spec_stats.num_draft_tokens == 0) == (cap == 0)
        num_accepted.append(sum(o.spec_stats.num_accepted_draft_tokens for o in outs))
    assert 0 < num_accepted[0] < num_accepted[1]
    assert llm.engine.proposer.num_tracked_requests == 0
