"""Streamed logprobs equal the non-streamed ones on the real engine, through HTTP, with speculation on:
each SSE chunk carries the logprobs of the tokens of one accepted block (drafts plus the bonus or
recovered token), and their concatenation must be the full response's, token for token (ids as
text, logprobs, top alternatives, text offsets). tests/server/test_generation_stream.py checks the
same against a scripted engine; here the engine, its sampler and its detokenizer are the real ones.

The target is mostly bigram and an EAGLE-3 head built from its weights drafts for it: right often,
not always, so chunks hold whole accepted blocks, partial ones and single recovered tokens.
"""

from __future__ import annotations

import json

import httpx
import pytest
from bigram_drafters import write_bigram_eagle3_head
from live_server import LiveServer
from tiny_chat_model import build_tiny_chat_checkpoint

# a live server of its own: the full suite's
pytestmark = pytest.mark.slow

PROMPT = "Count the apples, the pears and the plums."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """Mostly bigram (layer_scale 0.01, 4 layers) with the embedded tokenizer: the EAGLE-3 head
    built from its weights is right often, not always."""
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"), seed=41,
                                      num_hidden_layers=4, layer_scale=0.01)


def sse_events(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line.removeprefix("data: ")))
    return events


def both(client: httpx.Client, path: str, body: dict) -> tuple[dict, list[dict]]:
    """(the non-streamed response, the streamed chunks) for the same greedy body."""
    full = client.post(path, json=body)
    assert full.status_code == 200, full.text
    with client.stream("POST", path, json={**body, "stream": True,
                                           "stream_options": {"include_usage": True}}) as stream:
        assert stream.status_code == 200
        chunks = sse_events(stream)
    return full.json(), chunks


def accepted_drafts(response: dict) -> int:
    return response["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"]


def test_streamed_logprobs_equal_the_full_response_on_the_real_engine(checkpoint, tmp_path):
    spec = {"method": "eagle3", "num_speculative_tokens": 3,
            "model": write_bigram_eagle3_head(checkpoint, str(tmp_path / "head"))}
    with LiveServer(["--model", checkpoint, "--dtype", "float32", "--max-model-len", "256",
                     "--speculative-config", json.dumps(spec)]) as server, \
            httpx.Client(base_url=server.api, timeout=120) as client:
        model = client.get("/models").json()["data"][0]["id"]
        greedy = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

        full, chunks = both(client, "/completions", {**greedy, "prompt": PROMPT, "logprobs": 3})
        want = full["choices"][0]["logprobs"]
        got = {key: [] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        multi_token_chunks = 0
        for chunk in chunks:
            for choice in chunk["choices"]:
                logprobs = choice.get("logprobs") or {}
                multi_token_chunks += len(logprobs.get("tokens", [])) > 1
                for key in got:
                    got[key] += logprobs.get(key, [])
        assert len(want["tokens"]) == MAX_TOKENS
        assert got == want
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) \
            == full["choices"][0]["text"]
        assert accepted_drafts(full) > 0 and multi_token_chunks > 0, "no block spanned tokens"

        full, chunks = both(client, "/chat/completions", {
            **greedy, "messages": [{"role": "user", "content": PROMPT}], "logprobs": True,
            "top_logprobs": 2})
        want_content = full["choices"][0]["logprobs"]["content"]
        got_content = [entry for chunk in chunks for choice in chunk["choices"]
                       for entry in (choice.get("logprobs") or {}).get("content") or []]
        assert len(want_content) == MAX_TOKENS
        assert got_content == want_content
        stats = full["metrics"]["speculative_decoding"]
        assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"], stats
