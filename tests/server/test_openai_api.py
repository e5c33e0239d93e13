"""The real `openai` SDK against a live `specserve serve` on the embedded model: completions, chat,
streaming, n, stop, seeds, logprobs, the speculation extras, every error status, and a real
Prometheus scraping /metrics (client disconnects: test_disconnect.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from live_server import LiveServer
from prometheus_server import PrometheusServer, find_prometheus_binary
from tiers import tiered

from server.metrics import ACCEPTANCE_RATE_PROMQL, BLOCK_EFFICIENCY_PROMQL

MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key-123"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 4})
COPY_PROMPT = ("Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, "
               "fig, grape, apple, banana, cherry.")


@pytest.fixture(scope="module")
def plain():
    # NOTE: prefix caching off here (vLLM's flag); the other servers keep the default, on
    with LiveServer(["--max-model-len", "512", "--speculative-config", "none",
                     "--no-enable-prefix-caching"]) as server:
        yield server


@pytest.fixture(scope="module")
def default(embedded_server: LiveServer) -> LiveServer:
    """`specserve serve` as README starts it: adaptive suffix decoding (shared by the session).

    NOTE: the quick tier's API contract runs on this server alone; tests that need the plain or
    the n-gram server too are slow."""
    return embedded_server


@pytest.fixture(scope="module")
def spec():
    with LiveServer(["--max-model-len", "512", "--speculative-config", NGRAM,
                     "--api-key", KEY]) as server:
        yield server


def sdk(server: LiveServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=key, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          **kw)


@pytest.mark.promise("api-contract-sdk")
def test_completion_and_models(default):
    client = sdk(default)
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                    temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    assert out.choices[0].text.strip()
    assert set(out.model_extra["metrics"]["speculative_decoding"]) >= {
        "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens",
        "draft_acceptance_rate", "mean_acceptance_length", "acceptance_histogram"}


@pytest.mark.slow
def test_greedy_over_http_is_identical_with_and_without_speculation(plain, spec, default):
    prompts = [COPY_PROMPT, "Write a Python function that adds two numbers.", "Name three colors."]
    accepted = {"ngram": 0, "default": 0}
    for prompt in prompts:
        want = chat(sdk(plain), prompt, max_tokens=48, temperature=0)
        assert want.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] == 0
        for name, client in (("ngram", sdk(spec, KEY)), ("default", sdk(default))):
            got = chat(client, prompt, max_tokens=48, temperature=0)
            assert got.choices[0].message.content == want.choices[0].message.content
            # NOTE: all but cached_tokens: the speculating servers cache prefixes
            assert (got.usage.prompt_tokens, got.usage.completion_tokens) == \
                (want.usage.prompt_tokens, want.usage.completion_tokens)
            accepted[name] += \
                got.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"]
    assert accepted["ngram"] > 0 and accepted["default"] > 0


def client_of(request: pytest.FixtureRequest, name: str) -> openai.OpenAI:
    """The SDK on the server fixture `name` (the n-gram server asks for KEY)."""
    return sdk(request.getfixturevalue(name), KEY if name == "spec" else "unused")


# the quick tier's API contract runs on the default server; the full suite also on the n-gram one
SERVERS = tiered(["default", "spec"], {"default"}, promise="api-contract-sdk")


@pytest.mark.parametrize("server", SERVERS)
def test_stream_with_usage_matches_the_full_response(request, server):
    client = client_of(request, server)
    full = chat(client, COPY_PROMPT, max_tokens=40, temperature=0)
    chunks = list(chat(client, COPY_PROMPT, max_tokens=40, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        full.choices[0].finish_reason
    assert chunks[-1].choices == []
    # NOTE: all but cached_tokens: the second request may find the first one's prefix cached
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] > 0
    assert len({c.id for c in chunks}) == 1


@pytest.mark.promise("api-contract-sdk")
def test_completion_stream_and_echo(default):
    client = sdk(default)
    chunks = list(client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6,
                                            temperature=0, stream=True, echo=True))
    text = "".join(c.choices[0].text for c in chunks)
    full = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6,
                                     temperature=0)
    assert text == "One, two, three," + full.choices[0].text


@pytest.mark.parametrize("server", tiered(["default", "plain"], {"default"},
                                          promise="api-contract-sdk"))
def test_n_seed_and_stop(request, server):
    client = client_of(request, server)
    kw = {"max_tokens": 24, "temperature": 1.0, "seed": 7, "n": 3}
    first = chat(client, "Tell me a short story.", **kw)
    again = chat(client, "Tell me a short story.", **kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]  # seeded: reproducible
    assert len(set(texts)) > 1  # each choice draws on its own
    assert first.usage.completion_tokens <= 3 * 24
    full = chat(client, COPY_PROMPT, max_tokens=30, temperature=0).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    stopped = chat(client, COPY_PROMPT, max_tokens=30, temperature=0, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == full[:full.index(stop)]


@pytest.mark.promise("api-contract-sdk")
def test_chat_logprobs(default):
    out = chat(sdk(default), "Say hello.", max_tokens=5, temperature=0, logprobs=True,
               top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.logprob - 1e-6  # greedy picks the top token
    assert "".join(t.token for t in content) == out.choices[0].message.content


def streamed_logprobs(client: openai.OpenAI, **kw) -> list[tuple]:
    """Every streamed token's (text, logprob, top-2 alternatives), in order."""
    chunks = chat(client, COPY_PROMPT, max_tokens=40, temperature=0, logprobs=True,
                  top_logprobs=2, stream=True, **kw)
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for c in chunks if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content]


@pytest.mark.slow
def test_logprobs_are_identical_with_and_without_speculation(plain, spec, default):
    """Greedy, streamed: each token's logprob and top alternatives over HTTP are the same numbers
    with n-gram and with the default speculation as without (a verified token's logprobs come
    from its own verification row); completions without a stream too."""
    want = streamed_logprobs(sdk(plain))
    assert len(want) >= 20  # EOS may come first
    assert streamed_logprobs(sdk(spec, KEY)) == want
    assert streamed_logprobs(sdk(default)) == want
    kw = {"model": MODEL, "prompt": "apple, banana, cherry, date, apple, banana, cherry, date, apple,",
          "max_tokens": 24, "temperature": 0, "logprobs": 3}
    plain_out = sdk(plain).completions.create(**kw).choices[0].logprobs
    spec_out = sdk(spec, KEY).completions.create(**kw)
    assert spec_out.choices[0].logprobs == plain_out
    assert spec_out.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] > 0


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.slow
def test_response_format_json_with_the_default_speculation(plain, default):
    """JSON schema and JSON object output over HTTP: it parses and matches the schema, greedy text
    is the same with the default speculation as without, and an unenforceable schema is a 400."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    ask = "Ann is 31. Give her name and age as JSON."
    want = chat(sdk(plain), ask, max_tokens=60, temperature=0, response_format=fmt)
    got = chat(sdk(default), ask, max_tokens=60, temperature=0, response_format=fmt)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert json.loads(got.choices[0].message.content).keys() == {"name", "age"}
    text = sdk(default).completions.create(model=MODEL, prompt="A JSON object about a cat:",
                                           max_tokens=120, temperature=0.7, seed=3,
                                           stream=True,  # vLLM's extension on completions
                                           extra_body={"response_format": {"type": "json_object"}})
    completion = "".join(chunk.choices[0].text for chunk in text if chunk.choices)
    assert isinstance(json.loads(completion), dict)
    with pytest.raises(openai.BadRequestError) as caught:
        chat(sdk(default), ask, max_tokens=8, response_format={
            "type": "json_schema",
            "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}}})
    assert caught.value.body["param"] == "response_format"
    assert "uniqueItems" in caught.value.body["message"]


@pytest.mark.slow
def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(spec, plain):
    """A repeated long prompt under one API key finds its full blocks cached (caching is on by
    default); the output is the same as without caching, and a server started with
    --no-enable-prefix-caching reports 0 for the same prompt sent twice."""
    client = sdk(spec, KEY)
    prompt = COPY_PROMPT * 3
    first = chat(client, prompt, max_tokens=16, temperature=0)
    second = chat(client, prompt, max_tokens=16, temperature=0)
    assert second.choices[0].message.content == first.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (second.usage.prompt_tokens - 1) // 16 * 16 - 16 and cached % 16 == 0
    for _ in range(2):
        assert chat(sdk(plain), prompt, max_tokens=4).usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("server", SERVERS)
def test_per_request_speculation_control(request, server):
    client = client_of(request, server)
    off = chat(client, COPY_PROMPT, max_tokens=24, temperature=0,
               extra_body={"speculative_decoding": {"enabled": False}})
    capped = chat(client, COPY_PROMPT, max_tokens=24, temperature=0,
                  extra_body={"speculative_decoding": {"num_speculative_tokens": 1}})
    on = chat(client, COPY_PROMPT, max_tokens=24, temperature=0)
    stats = [r.model_extra["metrics"]["speculative_decoding"] for r in (off, capped, on)]
    assert stats[0]["num_draft_tokens"] == 0
    assert len(stats[1]["accepted_per_position"]) <= 1 and stats[1]["num_draft_tokens"] > 0
    assert off.choices[0].message.content == capped.choices[0].message.content == \
        on.choices[0].message.content


@pytest.mark.promise("api-contract-sdk")
def test_error_statuses(default):
    client = sdk(default)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="exceeds the context") as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2000)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=5)
    with pytest.raises(openai.BadRequestError, match="above this server's 8"):
        chat(client, "hi", max_tokens=2,
             extra_body={"speculative_decoding": {"num_speculative_tokens": 9}})
    for body in (b"{not json", b'{"prompt": 5}', b'{"prompt": "x", "n": 1000}',
                 b'{"prompt": "x", "max_tokens": "ten"}', b'{"prompt": "\xff\xfe"}',
                 b'{"prompt": "\\udcff"}', b'{"prompt": "x", "unknown": 1, "stream": "yes"}'):
        response = httpx.post(f"{default.api}/completions", content=body,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, (body, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.slow
def test_api_key_errors(spec):
    with pytest.raises(openai.AuthenticationError):
        chat(sdk(spec, "wrong-key"), "hi", max_tokens=2)
    assert httpx.get(f"{spec.api}/models").status_code == 401  # no Authorization header at all
    with pytest.raises(openai.BadRequestError, match="above this server's 4"):
        chat(sdk(spec, KEY), "hi", max_tokens=2,
             extra_body={"speculative_decoding": {"num_speculative_tokens": 9}})


@pytest.mark.skipif(find_prometheus_binary() is None
                    and not os.environ.get("SPECSERVE_REQUIRE_PROMETHEUS"),
                    reason="needs the prometheus binary (.ci/run installs it)")
@pytest.mark.slow
def test_prometheus_scrapes_acceptance_and_block_efficiency(spec):
    client = sdk(spec, KEY)
    with PrometheusServer(f"127.0.0.1:{spec.port}", ready_timeout_s=15) as prometheus:
        assert prometheus.wait_for_number("up", timeout_s=15) == 1.0  # scraped once before
        start = time.monotonic()
        while time.monotonic() - start < 4:  # counters move across several 1 s scrapes
            chat(client, COPY_PROMPT, max_tokens=24, temperature=0)
        alpha = prometheus.wait_for_number(ACCEPTANCE_RATE_PROMQL, timeout_s=30)
        tau = prometheus.wait_for_number(BLOCK_EFFICIENCY_PROMQL, timeout_s=30)
    assert 0.0 < alpha <= 1.0
    assert 1.0 < tau <= 5.0


@pytest.mark.promise("api-contract-sdk")
def test_readme_examples_work_as_written(default):
    """The curl and SDK examples of README.md, run against this server (only the port differs)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    curl = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if b.startswith("curl"))
    sdk_example = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
                       if "from openai import OpenAI" in b)
    at_port = {"127.0.0.1:8000": f"127.0.0.1:{default.port}"}
    result = subprocess.run(["bash", "-c", replace_all(curl, at_port)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["choices"][0]["message"]["content"]
    result = subprocess.run([sys.executable, "-c", replace_all(sdk_example, at_port)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "speculative_decoding" in result.stdout and "completion_tokens" in result.stdout


def replace_all(text: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        text = text.replace(old, new)
    return text
