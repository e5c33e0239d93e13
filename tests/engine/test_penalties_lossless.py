"""Greedy output with penalties, logit_bias and min_p is token-identical with and without speculation,
for one-hot drafts (n-gram, suffix) and a draft model, in a batch that mixes penalised and plain
requests; the penalties do change the output, so a sampler that ignored them, or applied them once
per step instead of at every verification position, fails here."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from spec_outputs import token_ids
from tiny_models import build_tiny_checkpoint

import engine.sample.penalties as penalties_module
from engine import LLM, SamplingParams

# prompts that repeat themselves, so prompt lookup and suffix trees find drafts
PROMPTS = [
    [1, 5, 9, 13, 2, 7, 5, 9, 13, 2],
    [1] + list(range(30, 50)) + list(range(30, 42)),
    [1, 60],
    [1, 11, 12, 13, 11, 12, 13, 11, 12],
]
MAX_TOKENS = 32
# NOTE: one thread: tiny tensors, and OpenMP hand-offs crawl on a machine busy with other work
ENGINE = {"dtype": "float64", "max_model_len": 128, "num_kv_blocks": 64, "num_threads": 1}
# mostly mild enough that drafts copied from repetitive text are still accepted, and strong enough
# that every penalised output changes
PENALTIES = {
    "strong": {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    "frequency_presence": {"frequency_penalty": 0.05, "presence_penalty": 0.2},
    "presence": {"presence_penalty": 0.3},
    "repetition": {"repetition_penalty": 1.2},
    # logit_bias: see batch_params (it bans the tokens the plain output uses most)
    "logit_bias": {},
    "everything": {"frequency_penalty": 0.2, "presence_penalty": -0.1, "repetition_penalty": 1.05,
                   "min_p": 0.3},
}


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)


@pytest.fixture(scope="module", autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=5)


@pytest.fixture(scope="module")
def partial_draft(tmp_path_factory) -> str:
    """Shares the target's first layer: some drafts accepted, some not."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=5,
                                 num_hidden_layers=1)


@pytest.fixture(scope="module")
def unpenalised(target) -> list[list[int]]:
    outs = LLM(target, **ENGINE).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy())
    return token_ids(outs)


@pytest.fixture(scope="module")
def batch_params(unpenalised) -> dict[str, list[SamplingParams]]:
    """Per penalty set, one SamplingParams per prompt: prompts 0, 1 and 3 penalised, 2 plain."""
    most_used = Counter(t for out in unpenalised for t in out).most_common(3)
    bias = {token: -100.0 for token, _ in most_used[:2]} | {most_used[2][0]: 4.0}
    batches = {}
    for name, extra in PENALTIES.items():
        extra = {"logit_bias": bias} if name == "logit_bias" else extra
        batches[name] = [greedy() if i == 2 else greedy(**extra) for i in range(len(PROMPTS))]
    return batches


@pytest.fixture(scope="module")
def expected(target, batch_params, unpenalised) -> dict[str, list[list[int]]]:
    plain = LLM(target, **ENGINE)
    want = {}
    for name, params in batch_params.items():
        want[name] = token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params))
        # the test can fail: each penalised request's output changed, the plain one did not
        for index, (got, base) in enumerate(zip(want[name], unpenalised)):
            assert (got != base) == (index != 2), (name, index)
    return want


def speculative_config(method: str, target: str, partial_draft: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 4}
    # the target as its own draft: q's transform matches p's exactly, so every draft is accepted
    return {"method": "draft_model", "num_speculative_tokens": 3,
            "model": target if method == "draft_model_self" else partial_draft}


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model_self", "draft_model"])
def test_greedy_with_penalties_is_token_identical(target, partial_draft, batch_params, expected,
                                                  method):
    llm = LLM(target, **ENGINE, speculative_config=speculative_config(method, target,
                                                                      partial_draft))
    num_accepted = 0
    for name, params in batch_params.items():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert token_ids(outs) == expected[name], name
        penalised = [o.spec_stats for i, o in enumerate(outs) if i != 2]
        num_accepted += sum(s.num_accepted_draft_tokens for s in penalised)
        if method == "draft_model_self":
            # NOTE: a draft that missed the drafts before it in its own counts would be rejected
            assert all(s.draft_acceptance_rate == 1.0 for s in penalised), name
    assert num_accepted > 0, "no penalised verification block was accepted"


def test_counts_updated_once_per_step_would_be_caught(target, batch_params, expected, monkeypatch):
    """The deliberately wrong sampler: rows of a verification block ignore the drafts before them
    (counts of the committed output only). With the target as its own draft, every block is a
    run of the target's own choices, and the wrong counts change the output."""
    original = penalties_module.row_token_counts

    def once_per_step(penalties, draft_token_ids, vocab_size, dtype):
        return original(dataclasses.replace(penalties, draft_pairs=None), draft_token_ids,
                        vocab_size, dtype)

    monkeypatch.setattr(penalties_module, "row_token_counts", once_per_step)
    llm = LLM(target, **ENGINE, speculative_config=speculative_config("draft_model_self", target,
                                                                      target))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], batch_params["strong"])
    assert token_ids(outs) != expected["strong"]


def test_logit_bias_outside_the_vocabulary_is_refused(target):
    llm = LLM(target, **ENGINE)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate({"prompt_token_ids": [1, 2]}, greedy(logit_bias={96: 1.0}))
