"""Tensor parallelism on the CPU (gloo, 2 ranks in 2 processes): the same greedy tokens as 1 rank, the
same bits run to run, speculation lossless with every proposer, the sampled law kept, the prefix
cache shared."""

from __future__ import annotations

import pytest
from bigram_drafters import (
    build_mostly_bigram_checkpoint,
    write_bigram_eagle3_head,
    write_bigram_eagle_head,
    write_bigram_mlp_speculator,
)
from pinned_cost import PinnedCost
from spec_outputs import two_sample_chi2_pvalue
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams

# two-rank engines: the full suite's (the quick tier keeps one rank's promises)
pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 13, 2, 7, 5, 9, 13, 2], [1, 60], [1] + list(range(30, 50)) + list(range(30, 40)),
           [1, 11, 12, 13, 11, 12, 13, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def generate(llm: LLM, params=GREEDY, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def uneven_heads(tmp_path_factory) -> str:
    """6 query heads in 3 KV groups: 2 groups on rank 0, 1 on rank 1 (SmolLM2's 9 / 3 shape)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("uneven"), "llama", seed=5,
                                 hidden_size=96, num_attention_heads=6, num_key_value_heads=3)


@pytest.mark.parametrize("kind, dtype", [("llama", "float32"), ("qwen2", "float64")])
def test_two_ranks_give_one_ranks_greedy_tokens(tmp_path, uneven_heads, kind, dtype):
    """float32 runs specserve's CPU kernels on each shard; qwen2 adds q/k/v biases."""
    model = uneven_heads if kind == "llama" else build_tiny_checkpoint(
        tmp_path / kind, kind, seed=7, hidden_size=96, num_attention_heads=6,
        num_key_value_heads=3)
    settings = {"dtype": dtype, "max_model_len": 128, "num_kv_blocks": 64}
    want = token_ids(generate(LLM(model, **settings)))
    sharded = LLM(model, tensor_parallel_size=2, **settings)
    try:
        assert token_ids(generate(sharded)) == want
    finally:
        sharded.close()


def test_two_ranks_repeat_bit_for_bit(uneven_heads):
    """The all-reduce sums in rank order: logprobs of two runs are the same bits."""
    llm = LLM(uneven_heads, dtype="float32", max_model_len=128, num_kv_blocks=64,
              tensor_parallel_size=2, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
        first, second = generate(llm, params), generate(llm, params)
        assert [o.outputs[0].logprobs for o in first] == [o.outputs[0].logprobs for o in second]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory) -> str:
    return build_mostly_bigram_checkpoint(tmp_path_factory.mktemp("bigram_target"))


@pytest.fixture(scope="module")
def bigram_plain_tokens(bigram_target) -> list[list[int]]:
    return token_ids(generate(LLM(bigram_target, dtype="float64", max_model_len=128,
                                  num_kv_blocks=64)))


DRAFTERS = {"eagle": write_bigram_eagle_head, "eagle3": write_bigram_eagle3_head,
            "mlp_speculator": write_bigram_mlp_speculator}
PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 6, "draft_tree": True},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "suffix_tree_adaptive": {"method": "suffix", "num_speculative_tokens": 6, "draft_tree": True,
                             "adaptive": True},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle_tree": {"method": "eagle", "num_speculative_tokens": 6, "draft_tree": True},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    "mlp_speculator": {"method": "mlp_speculator", "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("name", PROPOSERS)
def test_speculation_at_two_ranks_is_lossless(tmp_path, bigram_target, bigram_plain_tokens, name):
    """The target split over 2 ranks, the drafter whole on rank 0 (draft_tensor_parallel_size 1):
    the target's greedy tokens, with drafts accepted and rejected (trees move accepted K/V on
    both ranks)."""
    config = dict(PROPOSERS[name], draft_tensor_parallel_size=1)
    method = config["method"]
    if method == "draft_model":
        config["model"] = build_tiny_checkpoint(tmp_path / "draft", "llama", seed=41,
                                                num_hidden_layers=1, layer_scale=0.01)
    elif method in DRAFTERS:
        config["model"] = DRAFTERS[method](bigram_target, str(tmp_path / "drafter"))
    llm = LLM(bigram_target, dtype="float64", max_model_len=128, num_kv_blocks=64,
              tensor_parallel_size=2, speculative_config=config)
    if llm.engine.adaptive is not None:
        # NOTE: costs pinned, so the drafts depend on acceptance only: a calibration taken while
        # the suite loads both cores can make long drafts look too dear, and then every short
        # draft is accepted and the rejection path never runs
        llm.engine.adaptive.cost = PinnedCost(per_token=0.001)
    try:
        outs = generate(llm)
    finally:
        llm.close()
    assert token_ids(outs) == bigram_plain_tokens
    proposed = sum(o.spec_stats.num_draft_tokens for o in outs)
    accepted = sum(o.spec_stats.num_accepted_draft_tokens for o in outs)
    assert 0 < accepted < proposed, (accepted, proposed)


def test_sampling_at_two_ranks_follows_the_targets_law(uneven_heads):
    """The third token's counts over independent seeds at 2 ranks (with n-gram drafts verified)
    and at 1 rank come from one distribution (two-sample chi-square)."""
    num = 1500
    prompt = {"prompt_token_ids": [1, 5, 9, 13, 5, 9]}
    settings = {"dtype": "float64", "max_model_len": 32, "num_kv_blocks": 2048,
                "max_num_seqs": 256}

    def third_tokens(llm: LLM, seeds: range) -> list[int]:
        params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s)
                  for s in seeds]
        return [o.outputs[0].token_ids[2] for o in llm.generate([prompt] * num, params)]

    one = third_tokens(LLM(uneven_heads, **settings), range(num, 2 * num))
    sharded = LLM(uneven_heads, tensor_parallel_size=2, **settings,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        two = third_tokens(sharded, range(num))
    finally:
        sharded.close()
    counts = [[tokens.count(t) for t in range(96)] for tokens in (one, two)]
    assert two_sample_chi2_pvalue(*counts) > 1e-3


def test_prefix_cache_at_two_ranks(uneven_heads):
    """A second prompt sharing the first's blocks reads their K/V on both ranks: same tokens as
    computing it afresh, and its cached prefix counted."""
    shared = list(range(2, 40))
    first, second = [1] + shared + [50], [1] + shared + [60, 61]
    settings = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 64, "block_size": 8}
    fresh = token_ids(generate(LLM(uneven_heads, enable_prefix_caching=False, **settings),
                               prompts=[second]))
    llm = LLM(uneven_heads, tensor_parallel_size=2, **settings)
    try:
        generate(llm, prompts=[first])
        outs = generate(llm, prompts=[second])
    finally:
        llm.close()
    assert token_ids(outs) == fresh
    assert outs[0].num_cached_tokens >= 32


def test_a_drafter_sharded_over_ranks_is_refused():
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        LLM(None, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                      "draft_tensor_parallel_size": 2})
