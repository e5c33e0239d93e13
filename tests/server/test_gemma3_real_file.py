"""The real Gemma 3 270M Q4_K_M GGUF (Q5_0, Q4_K, Q6_K and Q8_0 blocks, a 262k vocabulary,
sliding layers) served packed: greedy text equal to transformers' on the dequantized weights,
offline and through the openai SDK on a live server, with and without speculation."""

from __future__ import annotations

import pytest
import torch
import transformers
from live_server import LiveServer
from real_gemma import real_gemma_path

from engine import LLM, SamplingParams
from engine.models.loader import load_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_file() -> str:
    return str(real_gemma_path())


@pytest.fixture(scope="module")
def reference(gemma_file) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """(prompt ids, transformers' greedy ids, their text): transformers' Gemma3ForCausalLM on the
    file's dequantized weights (read as transformers' GGUF load gives them, which
    tests/engine/test_gguf_checkpoint.py checks bit for bit), float32."""
    checkpoint = load_checkpoint(gemma_file, torch.float32)
    config = transformers.Gemma3TextConfig(**{
        key: value for key, value in checkpoint.hf_config.to_dict().items()
        if key not in ("transformers_version", "architectures", "model_type")})
    model = transformers.Gemma3ForCausalLM(config).eval()
    model.load_state_dict(checkpoint.weights, strict=False)
    model.tie_weights()
    tokenizer = checkpoint.tokenizer
    prompt_ids = [tokenizer(text).input_ids for text in PROMPTS]
    outputs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return prompt_ids, outputs, [tokenizer.decode(ids) for ids in outputs]


def test_served_packed_offline_it_gives_transformers_tokens(gemma_file, reference):
    prompt_ids, want, _ = reference
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(gemma_file, max_model_len=512)
    assert llm.engine.worker.weights_packed
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], greedy)
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_on_the_real_file_keeps_its_tokens(gemma_file, reference, method):
    prompt_ids, want, _ = reference
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(gemma_file, max_model_len=512,
              speculative_config={"method": method, "num_speculative_tokens": 4})
    # each prompt twice: the second copy's suffix tree and n-grams hold the first's output
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids * 2], greedy)
    assert [o.outputs[0].token_ids for o in outs] == want * 2
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0


def test_the_sdk_gets_transformers_text_from_a_live_server(gemma_file, reference):
    """`specserve serve --model <the file>` as it is (speculating by default; the 32k context
    cut to what the default KV cache holds), answered through the openai SDK."""
    import openai

    _, _, want = reference
    with LiveServer(["--model", gemma_file]) as server:
        client = openai.OpenAI(base_url=server.api, api_key="unused")
        model = client.models.list().data[0].id
        for prompt, text in zip(PROMPTS, want):
            completion = client.completions.create(model=model, prompt=prompt, temperature=0,
                                                   max_tokens=MAX_TOKENS,
                                                   extra_body={"ignore_eos": True})
            assert completion.choices[0].text == text
            assert completion.usage.completion_tokens == MAX_TOKENS
