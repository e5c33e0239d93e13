"""Adaptive speculation inside the engine: still lossless (greedy tokens identical, sampled tokens
follow the target), seeded sampling still reproducible, and k really changes with acceptance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pinned_cost import PinnedCost
from spec_outputs import two_sample_chi2_pvalue
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.adaptive import StepCostModel
from engine.adaptive.policy import PROBE_INTERVAL

# repetitive prompts (n-gram drafts often right) beside ones it rarely guesses
PROMPTS = [
    [1, 5, 9, 13, 2, 7, 5, 9, 13, 2],
    [1] + list(range(30, 50)) + list(range(30, 42)),
    [1, 60],
    [1, 11, 12, 13, 11, 12, 13, 11, 12],
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def adaptive_llm(checkpoint: str, spec: dict = NGRAM, cost: StepCostModel | None = None,
                 **engine) -> LLM:
    llm = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64,
              speculative_config={**spec, "adaptive": True}, **engine)
    llm.engine.adaptive.cost = cost or PinnedCost()
    return llm


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, **extra)


def token_ids(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                          params)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("adaptive"), "llama", seed=5)


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    plain = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64)
    return token_ids(plain, [greedy()] * len(PROMPTS))


def chosen_ks(llm: LLM) -> list[int]:
    """Every k the engine chose from now on (recorded per step from its StepStats)."""
    record: list[int] = []
    original = llm.engine._step_stats

    def spy(*args, **kwargs):
        stats = original(*args, **kwargs)
        record.append(stats.sum_chosen_k)
        return stats
    llm.engine._step_stats = spy
    return record


@pytest.mark.promise("greedy-lossless:adaptive")
@pytest.mark.parametrize("caps", [[None] * 4, [None, 0, 2, None]])
def test_greedy_is_token_identical_while_k_changes(checkpoint, expected, caps):
    # extra rows cheap enough that the prior alone justifies drafting, until rejections say otherwise
    llm = adaptive_llm(checkpoint, cost=PinnedCost(per_token=0.001))
    record = chosen_ks(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [greedy(num_speculative_tokens=c) for c in caps])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0
    for cap, out in zip(caps, outs):
        if cap == 0:
            assert out.spec_stats.num_draft_tokens == 0
    # the batch's total k went to 0 at times, and to values between 0 and the most it may draft
    full = sum(4 if c is None else c for c in caps)
    assert 0 in record and any(0 < k < full for k in record)


def test_greedy_draft_model_is_token_identical(checkpoint, expected, tmp_path):
    draft = build_tiny_checkpoint(tmp_path / "draft", "llama", seed=5, num_hidden_layers=1)
    llm = adaptive_llm(checkpoint, {"method": "draft_model", "model": draft,
                                    "num_speculative_tokens": 3})
    assert token_ids(llm, [greedy()] * len(PROMPTS)) == expected


def test_acceptance_moves_k(checkpoint, tmp_path):
    """Drafts from a draft model that IS the target are always right: once probes show it, every
    request drafts the most it may. Drafts from an unrelated model are almost never right: k stays
    at 0, but for the occasional one-token probe."""
    unrelated = build_tiny_checkpoint(tmp_path / "unrelated", "llama", seed=99)
    probe, full = len(PROMPTS), 3 * len(PROMPTS)  # a batch total of k: all probing, all at most
    records = {}
    for name, draft in (("same", checkpoint), ("unrelated", unrelated)):
        llm = adaptive_llm(checkpoint, {"method": "draft_model", "model": draft,
                                        "num_speculative_tokens": 3})
        records[name] = chosen_ks(llm)
        token_ids(llm, greedy())
    same, unrelated = records["same"], records["unrelated"]
    first_probe = same.index(probe)
    assert same[:first_probe] == [0] * first_probe  # the prior alone did not justify drafting
    assert same[first_probe + 2:first_probe + 8] == [full] * 6
    assert set(unrelated) == {0, probe}
    assert unrelated.count(probe) <= len(unrelated) // PROBE_INTERVAL


def test_seeded_sampling_is_reproducible_with_adaptive_on(checkpoint):
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=1234)
    alone = adaptive_llm(checkpoint).generate({"prompt_token_ids": PROMPTS[0]}, params)
    crowded = adaptive_llm(checkpoint).generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        [params] + [SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)] * 3)
    assert alone[0].outputs[0].token_ids == crowded[0].outputs[0].token_ids
    # one-hot drafts: whatever k the policy chose, the text is the text without speculation
    plain = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64)
    no_spec = plain.generate({"prompt_token_ids": PROMPTS[0]}, params)
    assert alone[0].outputs[0].token_ids == no_spec[0].outputs[0].token_ids


def test_sampled_distribution_matches_plain_sampling(tmp_path):
    """Unseeded sampling with a draft model (q is a full distribution, α is high but varies by
    chance, and k follows it, so k depends on earlier random draws): token 3 has the target's
    distribution; a two-sample chi-square test over 3000 samples each."""
    path = build_tiny_checkpoint(tmp_path / "target", "llama", seed=11, vocab_size=12,
                                 initializer_range=0.05)
    draft = build_tiny_checkpoint(tmp_path / "draft", "llama", seed=12, vocab_size=12,
                                  initializer_range=0.05, num_hidden_layers=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    counts = []
    torch.manual_seed(0)
    for spec in (None, {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                        "adaptive": True}):
        llm = LLM(path, dtype="float64", max_model_len=32, num_kv_blocks=4096, max_num_seqs=256,
                  speculative_config=spec)
        if spec is not None:
            # batches of 256 on it: a draft position pays when its gain α^j exceeds ~0.5
            llm.engine.adaptive.cost = PinnedCost(base=0.5, per_token=0.001)
            record = chosen_ks(llm)
        params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": prompt}] * 3000, params)
        counts.append(np.bincount([o.outputs[0].token_ids[2] for o in outs], minlength=12))
    assert len(set(record)) > 2
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 1000
    assert two_sample_chi2_pvalue(*counts) > 1e-4, counts
