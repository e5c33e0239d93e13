"""Malformed input against a live server, sent as raw bytes: every case gets a 4xx in OpenAI's
error shape whose message (and `param`, where one field is at fault) names the problem; none gets
a 500 or hangs, and the server keeps serving afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from live_server import LiveServer
from openai_errors import assert_openai_error

pytestmark = [pytest.mark.promise("bad-input-400")]

MAX_MODEL_LEN = 512
MAX_WAITING = 16
# generous: proves the answer comes, not how fast
DEADLINE_S = 60
JSON = {"content-type": "application/json"}


def completion(**fields) -> bytes:
    return json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                       **fields}).encode()


def chunked(total_bytes: int, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """A body with no Content-Length (chunked transfer): the limit must count what arrives."""
    yield b'{"prompt": "'
    for _ in range(total_bytes // chunk_bytes):
        yield b"a" * chunk_bytes
    yield b'"}'


# (id, path, body, headers, status, param, words the message must contain)
CASES = [
    ("truncated-json", "completions", b'{"prompt": [1,2', JSON, 400, None, "not valid JSON"),
    ("array-body", "completions", b"[1, 2, 3]", JSON, 400, None, "must be a JSON object"),
    ("string-body", "completions", b'"hello"', JSON, 400, None, "must be a JSON object"),
    ("null-body", "chat/completions", b"null", JSON, 400, None, "must be a JSON object"),
    ("empty-body", "completions", b"", JSON, 400, None, "body is missing"),
    ("max-tokens-string", "completions", completion(max_tokens="ten"), JSON, 400, "max_tokens",
     "integer"),
    ("temperature-list", "completions", completion(temperature=[1]), JSON, 400, "temperature",
     "number"),
    ("prompt-object", "completions", completion(prompt={"a": 1}), JSON, 400, "prompt",
     "must be a string"),
    ("prompt-empty", "completions", completion(prompt=[]), JSON, 400, "prompt", "empty"),
    ("messages-string", "chat/completions", chat(messages="hi"), JSON, 400, "messages", "list"),
    ("messages-empty", "chat/completions", chat(messages=[]), JSON, 400, "messages", "at least"),
    ("messages-bad-role", "chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]),
     JSON, 400, "messages.0.role", "system"),
    ("prompt-tokens-beyond-context", "completions", completion(prompt=[5] * (MAX_MODEL_LEN + 1)),
     JSON, 400, "prompt", "context"),
    ("prompt-text-megabytes", "completions", completion(prompt="hello world " * 250_000), JSON,
     400, "prompt", "context"),
    ("messages-megabytes", "chat/completions",
     chat(messages=[{"role": "user", "content": "hello world " * 250_000}]), JSON, 400,
     "messages", "context"),
    ("body-20-mb", "completions", completion(prompt="a" * 20_000_000), JSON, 413, None,
     "larger than"),
    ("body-20-mb-chunked", "completions", chunked(20_000_000), JSON, 413, None, "larger than"),
    ("n-million", "completions", completion(n=10**6), JSON, 400, "n", "128"),
    ("n-huge", "completions", completion(n=10**30), JSON, 400, "n", "128"),
    ("n-times-prompts-beyond-queue", "completions", completion(prompt=[[1, 2]] * 4, n=8), JSON,
     400, "n", "queues at most"),
    ("max-tokens-huge", "completions", completion(max_tokens=10**30), JSON, 400, "max_tokens",
     "context"),
    ("max-completion-tokens-huge", "chat/completions", chat(max_completion_tokens=10**30), JSON,
     400, "max_tokens", "context"),
    ("min-tokens-huge", "completions", completion(min_tokens=10**20), JSON, 400, "min_tokens",
     "less than"),
    ("top-k-huge", "completions", completion(top_k=10**20), JSON, 400, "top_k", "less than"),
    ("seed-huge", "completions", completion(seed=10**30), JSON, 400, "seed", "less than"),
    ("prompt-token-id-huge", "completions", completion(prompt=[10**20]), JSON, 400, "prompt",
     "vocabulary"),
    ("stop-token-id-huge", "completions", completion(stop_token_ids=[10**20]), JSON, 400,
     "stop_token_ids", "vocabulary"),
    ("frequency-penalty-huge", "completions", completion(frequency_penalty=1e30), JSON, 400,
     "frequency_penalty", "less than"),
    ("presence-penalty-nan", "chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": NaN}', JSON, 400,
     "presence_penalty", "finite"),
    ("repetition-penalty-zero", "completions", completion(repetition_penalty=0), JSON, 400,
     "repetition_penalty", "greater than"),
    ("min-p-string", "completions", completion(min_p="0.1"), JSON, 400, "min_p", "number"),
    ("logit-bias-list", "completions", completion(logit_bias=[1, 2]), JSON, 400, "logit_bias",
     "dictionary"),
    ("logit-bias-key-not-an-id", "completions", completion(logit_bias={"hello": 1}), JSON, 400,
     "logit_bias", "decimal integers"),
    ("logit-bias-key-huge", "completions", completion(logit_bias={"9" * 5000: 1}), JSON, 400,
     "logit_bias", "decimal integers"),
    ("logit-bias-id-beyond-vocab", "chat/completions", chat(logit_bias={"49152": 1}), JSON, 400,
     "logit_bias", "vocabulary"),
    ("logit-bias-value-huge", "completions", completion(logit_bias={"5": 1e300}), JSON, 400,
     "logit_bias.5", "less than"),
    ("logit-bias-too-many", "completions",
     completion(logit_bias={str(i): 1 for i in range(1000)}), JSON, 400, "logit_bias", "at most"),
    ("spec-k-huge", "completions", completion(speculative_decoding={"num_speculative_tokens":
                                                                   10**30}),
     JSON, 400, "speculative_decoding.num_speculative_tokens", "above"),
    ("invalid-utf8", "completions", b'{"prompt": "\xff\xfe", "max_tokens": 4}', JSON, 400, None,
     "UTF-8"),
    ("lone-surrogate", "completions", b'{"prompt": "\\ud800", "max_tokens": 4}', JSON, 400,
     "prompt", "Unicode"),
    ("text-plain", "completions", completion(), {"content-type": "text/plain"}, 400, None,
     "Content-Type"),
    ("form-encoded", "completions", b"prompt=hi",
     {"content-type": "application/x-www-form-urlencoded"}, 400, None, "Content-Type"),
    ("temperature-nan", "completions", b'{"prompt": [1], "temperature": NaN}', JSON, 400,
     "temperature", "finite"),
    ("temperature-overflow", "completions", b'{"prompt": [1], "temperature": 1e999}', JSON, 400,
     "temperature", "finite"),
    ("temperature-negative", "completions", completion(temperature=-1), JSON, 400, "temperature",
     "greater than"),
    ("top-p-zero", "completions", completion(top_p=0), JSON, 400, "top_p", "greater than"),
    # NOTE: 5,000 deep, beyond the JSON parser's recursion limit; 100,000 brackets are refused
    # before parsing (413, server/body_limit.py), tested in test_bounded_requests.py
    ("nested-objects", "completions", b'{"a":' * 5_000 + b"1" + b"}" * 5_000, JSON, 400,
     None, "nested too deeply"),
    ("nested-arrays", "chat/completions", b"[" * 5_000 + b"]" * 5_000, JSON, 400, None,
     "nested too deeply"),
    ("nested-in-a-field", "completions",
     b'{"prompt": [1], "extra": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", JSON, 400, None,
     "nested too deeply"),
    ("unknown-model", "completions", completion(model="no-such-model"), JSON, 404, "model",
     "does not exist"),
]


@pytest.fixture(scope="module")
def server(tiny_chat_llama):
    with LiveServer(["--model", tiny_chat_llama, "--dtype", "float32", "--max-model-len",
                     str(MAX_MODEL_LEN), "--max-waiting-requests", str(MAX_WAITING)]) as server:
        yield server


@pytest.mark.parametrize("path, body, headers, status, param, words",
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_malformed_request_gets_a_clear_4xx(server, path, body, headers, status, param, words):
    response = httpx.post(f"{server.api}/{path}", content=body, headers=headers,
                          timeout=DEADLINE_S)
    assert response.status_code == status, response.text[:500]
    error = assert_openai_error(response.content)
    assert error["param"] == param, error
    assert words in error["message"], error


def test_unknown_fields_are_ignored_live(server):
    response = httpx.post(f"{server.api}/completions", headers=JSON, timeout=DEADLINE_S,
                          content=completion(frobnicate={"x": [1, 2]}, another_unknown=None))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_penalties_logit_bias_and_min_p_are_served_live(server):
    response = httpx.post(f"{server.api}/completions", headers=JSON, timeout=DEADLINE_S,
                          content=completion(frequency_penalty=2, presence_penalty=-2,
                                             repetition_penalty=1.5, min_p=0.5, temperature=1,
                                             logit_bias={"5": -100, "7": 100}))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/completions", 405),
    ("DELETE", "/v1/models", 405),
    ("POST", "/v1/no/such/route", 404),
])
def test_wrong_route_or_method_gets_an_openai_error(server, method, path, status):
    response = httpx.request(method, f"{server.url}{path}", timeout=DEADLINE_S)
    assert response.status_code == status
    assert_openai_error(response.content)


def test_server_is_healthy_after_the_malformed_traffic(server):
    # runs last in this module: nothing above broke the server or logged a traceback
    response = httpx.post(f"{server.api}/chat/completions", content=chat(), headers=JSON,
                          timeout=DEADLINE_S)
    assert response.status_code == 200, response.text
    log = server.output()
    assert "Traceback" not in log, log[log.find("Traceback") - 300:][:4000]
