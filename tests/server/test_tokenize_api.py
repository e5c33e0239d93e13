"""/tokenize and /detokenize on the embedded model as README serves it: counts agree with what a
chat or completion request is charged, a round trip gives the text back, and bad input is a 4xx
naming its field."""

from __future__ import annotations

import httpx
import pytest
from live_server import LiveServer

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def http(embedded_server: LiveServer):
    with httpx.Client(base_url=embedded_server.url, timeout=120) as client:
        yield client


def post(http: httpx.Client, path: str, **body) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.promise("api-contract-sdk")
def test_counts_match_what_generation_requests_are_charged(http) -> None:
    chat = post(http, "/v1/chat/completions", model=MODEL, messages=MESSAGES, max_tokens=1)
    tokenized = post(http, "/tokenize", model=MODEL, messages=MESSAGES)
    assert tokenized["count"] == len(tokenized["tokens"]) == chat["usage"]["prompt_tokens"]
    assert tokenized["max_model_len"] == 1024 and tokenized["token_strs"] is None

    completion = post(http, "/v1/completions", model=MODEL, prompt="The sky is", max_tokens=1)
    text = post(http, "/tokenize", prompt="The sky is", return_token_strs=True)
    assert text["count"] == completion["usage"]["prompt_tokens"]
    assert "".join(text["token_strs"]).replace("Ġ", " ") == "The sky is"


def test_detokenize_gives_the_text_back(http) -> None:
    tokens = post(http, "/tokenize", prompt="Hello, world! Ünïcode too.",
                  add_special_tokens=False)["tokens"]
    assert post(http, "/detokenize", model=MODEL, tokens=tokens) == {
        "prompt": "Hello, world! Ünïcode too."}


def test_the_generation_prompt_and_tools_are_rendered(http) -> None:
    plain = post(http, "/tokenize", messages=MESSAGES)["count"]
    open_turn = post(http, "/tokenize", messages=MESSAGES, add_generation_prompt=False)["count"]
    tool = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    with_tools = post(http, "/tokenize", messages=MESSAGES, tools=[tool])["count"]
    assert open_turn < plain < with_tools


@pytest.mark.promise("bad-input-400")
@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, None),
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_input_is_a_4xx_naming_the_field(http, path, body, status, param) -> None:
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
