"""The real embedded SmolLM2-135M-Instruct as served by default, its Q4_1/Q8_0 weights kept packed:
greedy tokens equal transformers' (float32 on the dequantized weights), alone and batched, and
equal the float32-expanded engine's. Speculation on the real model: test_real_model_lossless.py."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Summarize in one sentence: The mitochondrion is the powerhouse "
                                 "of the cell; it makes ATP through oxidative phosphorylation."}],
]
MAX_TOKENS = 32
# two float32 models of the real one, transformers' generate: the full suite's
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(embedded_llm) -> LLM:
    return embedded_llm


@pytest.fixture(scope="module")
def reference(embedded_reference) -> transformers.PreTrainedModel:
    return embedded_reference


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    return [llm.tokenizer.encode(llm.apply_chat_template(c), add_special_tokens=False)
            for c in CONVERSATIONS]


def reference_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def top2_gap_at_mismatch(model, prompt: list[int], got: list[int], want: list[int]) -> str:
    """Numerics policy: a mismatch report names the reference's top-2 logit gap where it happened."""
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:i]])).logits[0, -1]
    top2 = torch.topk(logits, 2).values
    return f"first mismatch at token {i}: top-2 logit gap {float(top2[0] - top2[1]):.3e}"


def test_greedy_matches_transformers_alone_and_batched(llm, reference, prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [reference_greedy(reference, p) for p in prompts]
    batched = [o.outputs[0].token_ids for o in
               llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    alone = [llm.generate({"prompt_token_ids": p}, greedy)[0].outputs[0].token_ids
             for p in prompts]
    for prompt, want, got_batched, got_alone in zip(prompts, expected, batched, alone):
        for got in (got_batched, got_alone):
            assert got == want, top2_gap_at_mismatch(reference, prompt, got, want)


def test_logprobs_come_from_the_target_distribution(llm, reference, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    out = llm.generate({"prompt_token_ids": prompts[0]}, params)[0].outputs[0]
    with torch.no_grad():
        logits = reference(torch.tensor([prompts[0] + out.token_ids])).logits[0]
    expected = torch.log_softmax(logits[len(prompts[0]) - 1:-1], dim=-1)  # [4, vocab]
    for row, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(float(expected[row, lp.token_id]), abs=1e-4)
        assert lp.rank == 1 and lp.top[0][0] == lp.token_id and len(lp.top) == 3


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    conversation = CONVERSATIONS[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    alone = llm.chat(conversation, seeded)[0].outputs[0].token_ids
    again = llm.chat(conversation, seeded)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=24)
    batched = llm.chat([CONVERSATIONS[1], conversation, CONVERSATIONS[2]],
                       [noisy, seeded, noisy])[1].outputs[0].token_ids
    assert alone == again == batched
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24)
    assert llm.chat(conversation, other_seed)[0].outputs[0].token_ids != alone


def test_chat_n_and_stop_strings(llm):
    out = llm.chat(CONVERSATIONS[0], SamplingParams(temperature=0.0, max_tokens=32))[0]
    text = out.outputs[0].text
    assert "Paris" in text and out.outputs[0].finish_reason in ("stop", "length")
    stopped = llm.chat(CONVERSATIONS[0], SamplingParams(temperature=0.0, max_tokens=32,
                                                        stop=["Paris"]))[0].outputs[0]
    assert stopped.text == text[:text.index("Paris")]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", "Paris")
    many = llm.chat(CONVERSATIONS[0], SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=8))
    assert [c.index for c in many[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many[0].outputs}) > 1


def test_prompt_longer_than_max_model_len_is_rejected(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 1024}, SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished


def test_packed_logprobs_equal_the_float32_expansion(llm, prompts):
    """Packing changes where the weights' bits live, not the floats: the default engine's logprobs
    equal `--dtype float32`'s (the GGUF expanded as transformers expands it) bit for bit."""
    expanded = LLM(None, dtype="float32", num_threads=2, max_model_len=1024)
    assert expanded.engine.worker.memory.packed_weight_bytes == 0
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    requests = [{"prompt_token_ids": p} for p in prompts]
    got, want = llm.generate(requests, params), expanded.generate(requests, params)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [(lp.logprob, lp.top) for lp in a.outputs[0].logprobs] == \
            [(lp.logprob, lp.top) for lp in b.outputs[0].logprobs]
