"""Greedy output of engine.LLM is token-identical to transformers' greedy generate on the same weights."""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_checkpoint, hf_greedy

from engine import LLM, SamplingParams

PROMPTS = [
    [1, 5, 9, 13, 2, 7],
    [1] + list(range(30, 70)),  # 41 tokens: several blocks, and several prefill chunks below
    [1, 60],
    [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# engine settings that change how the same work is cut up: each must leave the tokens unchanged
ENGINE_SETUPS = {
    "roomy": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "two_seats": {"max_num_seqs": 2},
    "tiny_blocks": {"block_size": 4},
}


# NOTE: the quick tier checks Llama and the two families whose bodies differ most from it (q/k
# norms; Gemma 3's sandwich norms, GeGLU and sliding layers); the full suite every one
@pytest.fixture(scope="module", params=["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                        pytest.param("mistral", marks=pytest.mark.slow),
                                        "qwen3", "gemma3"])
def checkpoint(request, tmp_path_factory) -> tuple[str, list[list[int]]]:
    overrides = {"sliding_window": 16} if request.param == "mistral" else {}
    path = build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **overrides)
    return path, [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("setup", ENGINE_SETUPS)
def test_batch_matches_transformers(checkpoint, setup):
    path, expected = checkpoint
    llm = LLM(path, dtype="float64", max_model_len=128, num_kv_blocks=64, **ENGINE_SETUPS[setup])
    assert generate(llm, PROMPTS) == expected


def test_each_prompt_alone_matches_transformers(checkpoint):
    path, expected = checkpoint
    llm = LLM(path, dtype="float64", max_model_len=128, num_kv_blocks=64)
    for prompt, tokens in zip(PROMPTS, expected):
        assert generate(llm, [prompt]) == [tokens]


def test_preemption_by_recompute_keeps_tokens(checkpoint):
    path, expected = checkpoint
    # 20 blocks of 4 tokens = 80 slots: the four requests (up to 65 tokens each) cannot all fit
    llm = LLM(path, dtype="float64", max_model_len=80, num_kv_blocks=20, block_size=4)
    assert generate(llm, PROMPTS) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == 20


def test_float32_tiny_model_matches(tmp_path):
    path = build_tiny_checkpoint(tmp_path, "llama", seed=3)
    import torch

    expected = [hf_greedy(path, p, MAX_TOKENS, dtype=torch.float32) for p in PROMPTS]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64)
    assert generate(llm, PROMPTS) == expected
