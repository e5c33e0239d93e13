"""End to end on the real embedded model in float32 (the CPU attention kernel's path): a request's
greedy tokens and logprobs are the same alone, in a batch, and with speculation, whose 1 + k
verification rows are attended exactly as the decode rows they replace."""

from __future__ import annotations

import pytest
from pinned_cost import PinnedCost

from engine import LLM, SamplingParams
from kernels.paged_attention_cpu import paged_attention_cpu_available

# the real model in float32, three engines: the full suite's
pytestmark = [pytest.mark.skipif(not paged_attention_cpu_available(),
                                 reason="no C++ compiler, or SPECSERVE_CPU_KERNELS=0"),
              pytest.mark.slow]
CONVERSATIONS = [
    "Count from 1 to 30, separated by commas.",
    "Copy this sentence word for word: the old lighthouse stood at the edge of the cliff, its "
    "white paint peeling in the salty wind.",
    "Name three colours.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, dtype="float32", num_threads=2, max_model_len=256)


@pytest.fixture(scope="module")
def prompts(llm) -> list[dict]:
    return [{"prompt_token_ids": llm.tokenizer.encode(
        llm.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)}
        for c in CONVERSATIONS]


def test_a_request_alone_equals_it_in_a_batch(llm, prompts):
    assert llm.engine.worker.device.type == "cpu"
    batched = [o.outputs[0] for o in llm.generate(prompts, GREEDY)]
    for prompt, in_batch in zip(prompts, batched):
        alone = llm.generate(prompt, GREEDY)[0].outputs[0]
        assert alone.token_ids == in_batch.token_ids
        assert alone.logprobs == in_batch.logprobs  # bit for bit, not merely the same argmax


@pytest.mark.parametrize("speculative_config", [
    {"method": "ngram", "num_speculative_tokens": 4},
    {"method": "suffix", "num_speculative_tokens": 8, "adaptive": True},  # the server's default
], ids=["ngram", "adaptive_suffix"])
def test_speculation_keeps_the_tokens_and_their_logprobs(llm, prompts, speculative_config):
    """A verified token's logprobs come from its own verification row, which the kernels compute
    as the decode row it replaces: equal bit for bit, top-N alternatives included."""
    speculative = LLM(None, dtype="float32", num_threads=2, max_model_len=256,
                      speculative_config=speculative_config)
    if speculative.engine.adaptive is not None:
        # NOTE: costs pinned, so the policy drafts whatever the machine's timings (a calibration
        # taken while the suite loads both cores can make drafting look too dear to try)
        speculative.engine.adaptive.cost = PinnedCost(per_token=0.001)
    plain = [o.outputs[0] for o in llm.generate(prompts, GREEDY)]
    outs = speculative.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [p.token_ids for p in plain]
    assert [o.outputs[0].logprobs for o in outs] == [p.logprobs for p in plain]
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0
