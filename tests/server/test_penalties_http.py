"""Penalties, logit_bias and min_p over HTTP with the real `openai` SDK, against live servers with and
without speculation (n-gram) on a tiny chat model: each changes the output as it should, greedy
output is the same with and without speculation, and bad values get a 400 naming the field."""

from __future__ import annotations

import json
from collections import Counter

import openai
import pytest
from live_server import LiveServer
from tiny_chat_model import build_tiny_chat_checkpoint

# a live server of its own: the full suite's
pytestmark = pytest.mark.slow

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3})
# repeats itself, so prompt lookup drafts from the first step
PROMPT = "one two three one two three one two three one two"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def plain(model):
    with LiveServer(["--model", model, "--dtype", "float32", "--max-model-len", "256",
                     "--speculative-config", "none"]) as server:
        yield server


@pytest.fixture(scope="module")
def spec(model):
    with LiveServer(["--model", model, "--dtype", "float32", "--max-model-len", "256",
                     "--speculative-config", NGRAM]) as server:
        yield server


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


def complete(server: LiveServer, **kw):
    """One completion of PROMPT; its tokens (each decoded alone) come back as logprobs.tokens."""
    kw = {"temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": 0, **kw}
    return sdk(server).completions.create(model=None, prompt=PROMPT, **kw).choices[0]


@pytest.fixture(scope="module")
def token_ids(model) -> dict[str, int]:
    """Decoded text -> token id, for the tokens that are the only one decoding to their text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    texts = Counter(tokenizer.decode([i]) for i in range(len(tokenizer)))
    return {text: i for i in range(len(tokenizer))
            if texts[text := tokenizer.decode([i])] == 1}


def test_greedy_with_penalties_is_the_same_with_and_without_speculation(plain, spec, token_ids):
    base = complete(plain)
    # two boosted tokens that the frequency penalty takes turns between: a repetitive output
    # whose drafts get accepted, and in which every row's own counts decide the next token
    pair = {str(token_ids[t]): 10 for t in (" apple", " banana")}
    num_accepted = 0
    for kw in ({"frequency_penalty": 1.0}, {"presence_penalty": 1.5},
               {"extra_body": {"repetition_penalty": 2.0}},
               {"frequency_penalty": 0.3, "presence_penalty": -0.5,
                "extra_body": {"repetition_penalty": 1.2, "min_p": 0.2}},
               {"logit_bias": pair, "frequency_penalty": 0.7}):
        want = complete(plain, **kw)
        got = sdk(spec).completions.create(model=None, prompt=PROMPT, temperature=0,
                                           max_tokens=MAX_TOKENS, logprobs=0, **kw)
        assert got.choices[0].text == want.text, kw
        assert want.text != base.text, f"{kw} changed nothing"
        num_accepted += got.model_extra["metrics"]["speculative_decoding"][
            "num_accepted_draft_tokens"]
    assert num_accepted > 0


def test_logit_bias_brings_a_token_in_or_bans_it(spec, token_ids):
    base = complete(spec).logprobs.tokens
    favourite = next(t for t, _ in Counter(base).most_common() if t in token_ids)
    banned = complete(spec, logit_bias={str(token_ids[favourite]): -100}).logprobs.tokens
    assert favourite not in banned and banned != base
    chosen = next(t for t in (" cherry", " banana", "x") if t in token_ids and t not in base)
    for kw in ({}, {"temperature": 1.0, "seed": 7}):
        boosted = complete(spec, logit_bias={str(token_ids[chosen]): 100}, **kw).logprobs.tokens
        assert boosted == [chosen] * MAX_TOKENS, kw


def test_min_p_of_one_keeps_only_the_top_token(spec):
    """Sampling with min_p = 1 draws from the top token alone: the greedy output, whatever the seed."""
    greedy = complete(spec, frequency_penalty=0.5).text
    for seed in (1, 2):
        sampled = complete(spec, temperature=1.0, seed=seed, frequency_penalty=0.5,
                           extra_body={"min_p": 1.0}).text
        assert sampled == greedy


@pytest.mark.parametrize("kw, param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"logit_bias": {"49152": 5}}, "logit_bias"),  # the vocabulary is 49152 tokens
    ({"logit_bias": {"x": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
])
def test_bad_values_get_a_400_naming_the_field(spec, kw, param):
    for create in (lambda: complete(spec, **kw),
                   lambda: sdk(spec).chat.completions.create(
                       model=None, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                       **kw)):
        with pytest.raises(openai.BadRequestError) as info:
            create()
        assert info.value.status_code == 400
        assert info.value.body["param"] == param, info.value.body
