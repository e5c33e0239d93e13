"""Schemathesis against a live server's /openapi.json: for every operation, requests generated from
the schema (valid ones and deliberately invalid ones) never get a 5xx, and every 4xx comes in
OpenAI's error shape. Bounded and reproducible: a fixed number of derandomized examples each."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from live_server import LiveServer
from openai_errors import assert_openai_error
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from tiny_chat_model import VOCAB_SIZE

# a live server of its own: the full suite's
pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
# the server answers fast only if generated requests ask for little: larger values are kept to
# these (huge ones are tested on their own in test_malformed_input.py)
MAX_GENERATED_TOKENS = 8
MAX_GENERATED_N = 2
# per operation and generation mode (valid requests, deliberately invalid ones)
EXAMPLES = 20


@pytest.fixture(scope="module")
def server(tiny_chat_llama):
    with LiveServer(["--model", tiny_chat_llama, "--dtype", "float32", "--max-model-len",
                     str(MAX_MODEL_LEN)]) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def keep_small(body: dict) -> None:
    """Cap the fields that set how much work a request is; no max (or null) would mean the
    whole context."""
    if all(body.get(name) is None
           for name in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
        body["max_tokens" if "input" not in body else "max_output_tokens"] = MAX_GENERATED_TOKENS
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens"):
        if is_int(body.get(name)) and body[name] > MAX_GENERATED_TOKENS:
            body[name] = MAX_GENERATED_TOKENS
    if is_int(body.get("n")) and body["n"] > MAX_GENERATED_N:
        body["n"] = MAX_GENERATED_N


def meet_rules_beyond_the_schema(body: dict) -> None:
    """Rules the validators add to the schema (logit_bias keys are token ids of the vocabulary,
    prompts and user messages not empty, top_logprobs needs logprobs, stream_options needs stream,
    tool messages answer earlier calls)
    reject most schema-valid requests; fixing only values of the types the schema asks for lets
    valid requests reach the engine, while invalid parts stay invalid."""
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {key: value for key, value in body["logit_bias"].items()
                              if key.isascii() and key.isdigit() and len(key) <= 10
                              and int(key) < VOCAB_SIZE}
    prompt = body.get("prompt")
    if prompt in ("", []):
        body["prompt"] = "Hello"
    elif isinstance(prompt, list) and any(p in ("", []) for p in prompt):
        body["prompt"] = [p for p in prompt if p not in ("", [])] or "Hello"
    if is_int(body.get("top_logprobs")) and isinstance(body.get("logprobs"), bool):
        body["logprobs"] = True
    if isinstance(body.get("stream_options"), dict) and isinstance(body.get("stream"), bool):
        body["stream"] = True
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        # a tool message answers a call of the assistant message before it, which generated
        # histories never hold; only assistant messages carry calls, only tool messages answer
        if message.get("role") == "tool":
            message["role"] = "user"
        if message.get("role") != "assistant":
            message.pop("tool_calls", None)
        message.pop("tool_call_id", None)
        if message.get("content") is None and message.get("role") != "assistant":
            message["content"] = "Hello"


STATUSES: dict[str, Counter] = defaultdict(Counter)


# NOTE: hypothesis drives schemathesis' strategies directly, not through schemathesis' pytest
# plugin, which breaks with some pytest releases
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_requests_get_no_5xx_and_openai_shaped_4xx(api_schema, mode):
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if mode == GenerationMode.NEGATIVE and not operation.body:
            continue  # a GET without parameters has nothing to get wrong

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def generated(case) -> None:
            check_case(case)
        generated()


def check_case(case) -> None:
    if isinstance(case.body, dict):
        keep_small(case.body)
        meet_rules_beyond_the_schema(case.body)
    response = case.call(timeout=60)
    STATUSES[f"{case.method} {case.path}"][response.status_code] += 1
    case.validate_response(response, checks=[not_a_server_error])
    assert response.status_code < 500, response.text[:1000]
    if 400 <= response.status_code < 500:
        assert_openai_error(response.content)


def test_every_operation_was_exercised(server):
    # runs after the generated tests: they reached every operation, and the generation endpoints
    # both served valid requests and refused invalid ones
    documented = {f"{method.upper()} {path}"
                  for path, methods in httpx.get(f"{server.url}/openapi.json").json()["paths"].items()
                  for method in methods}
    assert documented <= set(STATUSES), documented - set(STATUSES)
    for operation in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert STATUSES[operation][200] >= 5 and STATUSES[operation][400] >= 5, STATUSES[operation]
    log = server.output()
    assert "Traceback" not in log, log[log.find("Traceback") - 300:][:4000]
