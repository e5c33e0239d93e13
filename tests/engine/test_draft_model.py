"""The draft-model proposer: lossless whatever the draft, and its KV stays right after rejections."""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 13, 2, 7], [1] + list(range(30, 62)), [1, 60], [1, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=21)


@pytest.fixture(scope="module")
def expected(target) -> list[list[int]]:
    plain = LLM(target, dtype="float64", max_model_len=128, num_kv_blocks=64)
    outs = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def run(target: str, draft: str, k: int, params=GREEDY, **engine) -> list:
    llm = LLM(target, dtype="float64", max_model_len=128, num_kv_blocks=64, **engine,
              speculative_config={"method": "draft_model", "model": draft,
                                  "num_speculative_tokens": k})
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)


def test_target_as_its_own_draft_accepts_everything(target, expected):
    outs = run(target, target, k=3)
    assert [o.outputs[0].token_ids for o in outs] == expected
    for out in outs:
        assert out.spec_stats.draft_acceptance_rate == 1.0
        assert out.spec_stats.mean_acceptance_length > 3.0


@pytest.mark.parametrize("k", [1, 4])
def test_unrelated_draft_is_rejected_but_output_is_unchanged(target, expected, tmp_path, k):
    draft = build_tiny_checkpoint(tmp_path, "llama", seed=99, num_hidden_layers=1)
    outs = run(target, draft, k=k, max_num_batched_tokens=10)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.spec_stats.num_draft_tokens for o in outs) > 0


@pytest.mark.promise("greedy-lossless:draft_model")
def test_partly_right_draft_rolls_back_its_cache(target, expected, tmp_path):
    """A draft that shares the target's first layer agrees sometimes: every rollback path runs."""
    draft = build_tiny_checkpoint(tmp_path, "llama", seed=21, num_hidden_layers=1)
    outs = run(target, draft, k=3)
    assert [o.outputs[0].token_ids for o in outs] == expected
    rates = [o.spec_stats.draft_acceptance_rate for o in outs]
    assert 0.0 < sum(rates) / len(rates) < 1.0


def test_seeded_sampling_with_a_draft_is_reproducible(target):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=5)
    first = [o.outputs[0].token_ids for o in run(target, target, k=3, params=params)]
    again = [o.outputs[0].token_ids for o in run(target, target, k=3, params=params)]
    assert first == again


def test_vocab_mismatch_is_refused(target, tmp_path):
    draft = build_tiny_checkpoint(tmp_path, "llama", seed=1, vocab_size=64)
    with pytest.raises(ValueError, match="same tokenizer|differs from the target"):
        run(target, draft, k=2)


@pytest.mark.slow
def test_sampled_distribution_with_draft_probabilities_matches_plain(tmp_path):
    """q from a different small model: token 3 keeps the plain distribution (two-sample chi-square)."""
    import numpy as np
    from scipy.stats import chi2_contingency

    target = build_tiny_checkpoint(tmp_path / "t", "llama", seed=11, vocab_size=12,
                                   initializer_range=0.3)
    draft = build_tiny_checkpoint(tmp_path / "d", "llama", seed=12, vocab_size=12,
                                  num_hidden_layers=1, initializer_range=0.3)
    prompt, num = [1, 2, 3, 4], 3000
    counts = []
    for spec in (None, {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}):
        llm = LLM(target, dtype="float64", max_model_len=32, num_kv_blocks=4096,
                  max_num_seqs=256, speculative_config=spec)
        params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s)
                  for s in range(num)]
        outs = llm.generate([{"prompt_token_ids": prompt}] * num, params)
        counts.append(np.bincount([o.outputs[0].token_ids[2] for o in outs], minlength=12))
        if spec is not None:
            accepted = sum(o.spec_stats.num_accepted_draft_tokens for o in outs)
            assert 0 < accepted < sum(o.spec_stats.num_draft_tokens for o in outs)
    table = np.array(counts)
    table = table[:, table.sum(axis=0) > 0]
    assert chi2_contingency(table).pvalue > 1e-4, table


def test_a_draft_left_unverified_that_then_comes_true_still_drafts(target, expected):
    """A token budget too small for every request's draft leaves some drafts unverified; the token
    then committed at such a draft's position can equal the draft, whose K/V stays valid. The
    newest token must still be fed for the next draft's logits (this once crashed the engine)."""
    outs = run(target, target, k=4, max_num_batched_tokens=6)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0
