"""Speculation is lossless: greedy tokens are identical with and without it, in any batch mix, and
sampled tokens follow the same distribution."""

from __future__ import annotations

import pytest
from spec_outputs import third_token_law, two_sample_chi2_pvalue
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams

# prompts that repeat themselves, so prompt lookup finds drafts (some right, most wrong: random model)
PROMPTS = [
    [1, 5, 9, 13, 2, 7, 5, 9, 13, 2],
    [1] + list(range(30, 50)) + list(range(30, 42)),
    [1, 60],
    [1, 11, 12, 13, 11, 12, 13, 11, 12],
]
MAX_TOKENS = 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)


def token_ids(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    plain = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64)
    return token_ids(plain, [greedy()] * len(PROMPTS))


# per-request speculation caps in one batch: None = engine k, 0 = off, others cap k
BATCH_MIXES = {
    "all_speculate": [None, None, None, None],
    "mixed_on_off": [None, 0, None, 0],
    "mixed_k": [1, 4, 0, 2],
}
ENGINE_SETUPS = {
    "roomy": {},
    "tight_token_budget": {"max_num_batched_tokens": 6},  # drafts get cut to fit
    "tiny_blocks": {"block_size": 4},
}


@pytest.mark.promise("greedy-lossless:ngram")
@pytest.mark.parametrize("setup", ENGINE_SETUPS)
@pytest.mark.parametrize("mix", BATCH_MIXES)
def test_greedy_ngram_is_token_identical(checkpoint, expected, mix, setup):
    llm = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64,
              speculative_config=NGRAM, **ENGINE_SETUPS[setup])
    params = [greedy(num_speculative_tokens=cap) for cap in BATCH_MIXES[mix]]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    drafted = [o.spec_stats.num_draft_tokens for o in outs]
    for cap, num_drafts in zip(BATCH_MIXES[mix], drafted):
        assert (num_drafts == 0) == (cap == 0)
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0


def test_greedy_ngram_survives_preemption(checkpoint, expected):
    llm = LLM(checkpoint, dtype="float64", max_model_len=72, num_kv_blocks=18, block_size=4,
              speculative_config=NGRAM)
    assert token_ids(llm, [greedy()] * len(PROMPTS)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == 18


def test_spec_stats_add_up(checkpoint):
    llm = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64,
              speculative_config=NGRAM)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy())[0]
    stats = out.spec_stats
    assert stats.num_emitted_tokens == MAX_TOKENS == len(out.outputs[0].token_ids)
    assert sum(stats.acceptance_histogram) == stats.num_spec_steps
    assert sum(a * n for a, n in enumerate(stats.acceptance_histogram)) == \
        stats.num_accepted_draft_tokens == sum(stats.accepted_per_position)
    assert 1.0 <= stats.mean_acceptance_length <= 5.0
    assert stats.verify_seconds > 0 and stats.draft_seconds > 0


def test_stop_inside_an_accepted_block_drops_the_rest(checkpoint, expected):
    llm = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64,
              speculative_config=NGRAM)
    want = expected[0]
    stop_at = want[10]
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       greedy(stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == want[:want.index(stop_at) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)


def test_sampled_distribution_matches_plain_sampling(tmp_path):
    """Token 3 of the output (verified from drafts most of the time) has the same distribution with
    and without speculation: a two-sample chi-square test over 3000 samples each."""
    path = build_tiny_checkpoint(tmp_path, "llama", seed=11, vocab_size=12, initializer_range=0.05)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain, _ = third_token_law(path, None, prompt, 3000)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    speculative, outs = third_token_law(path, spec, prompt, 3000)
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 100
    assert two_sample_chi2_pvalue(plain, speculative) > 1e-4, (plain, speculative)


def test_drafts_are_dropped_before_anyone_is_preempted(checkpoint):
    """With the pool nearly full, a request's drafts go before another request's KV does."""
    from engine.request import Request
    from engine.step.layout import DraftProposal, DraftTokens
    from engine.step.types import SampledTokens

    llm = LLM(checkpoint, dtype="float64", max_model_len=16, num_kv_blocks=4, block_size=4)
    scheduler = llm.engine.scheduler
    for request_id in ("a", "b"):
        scheduler.add_request(Request(request_id, [1, 2, 3, 4, 5, 6, 7], greedy(), frozenset()))
    first = scheduler.schedule()  # both prefill: 2 blocks each, the pool is full
    scheduler.commit(first, [SampledTokens([9]), SampledTokens([9])])
    # would need a third block for "a"
    scheduler.update_draft_token_ids(DraftTokens({"a": DraftProposal([1, 2, 3, 4])}))
    assert scheduler.drafts["a"].token_ids == [1, 2, 3, 4]
    second = scheduler.schedule()
    assert second.preempted_ids == []
    assert [item.num_draft_tokens for item in second.scheduled] == [0, 0]
    assert "a" not in scheduler.drafts


def test_logprobs_with_speculation_come_from_the_target(checkpoint):
    """Each emitted token's logprob is the target's at its own position, accepted draft or not."""
    params = greedy(logprobs=2)
    plain = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64)
    spec = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64,
               speculative_config=NGRAM)
    want = plain.generate({"prompt_token_ids": PROMPTS[3]}, params)[0].outputs[0]
    got = spec.generate({"prompt_token_ids": PROMPTS[3]}, params)[0]
    assert got.spec_stats.num_accepted_draft_tokens > 0
    assert got.outputs[0].token_ids == want.token_ids
    for mine, theirs in zip(got.outputs[0].logprobs, want.logprobs, strict=True):
        assert mine.token_id == theirs.token_id and mine.rank == theirs.rank == 1
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-9)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
