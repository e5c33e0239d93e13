"""Each API key is a cache tenant of its own (reproduction 5 of issue 28): with two keys, the same
prompt finds cached blocks within a key and none across keys, and client B cannot confirm a guess at
client A's generated answer through `cached_tokens`. Through the real openai SDK."""

from __future__ import annotations

import openai
import pytest
from live_server import LiveServer

# a live server of its own: the full suite's
pytestmark = pytest.mark.slow

KEY_A, KEY_B, KEY_FROM_FILE = "sk-tenant-a", "sk-tenant-b", "sk-tenant-c"
# long enough for several 16-token blocks
PROMPT = ("The quarterly report covers revenue, churn, hiring plans, the office move, the audit "
          "schedule, and the new pricing for enterprise customers in three regions. Summary:")


@pytest.fixture(scope="module")
def server(tiny_chat_llama, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# one key per line\n{KEY_FROM_FILE}\n\n")
    with LiveServer(["--model", tiny_chat_llama, "--dtype", "float32", "--max-model-len", "512",
                     "--speculative-config", "none", "--served-model-name", "tiny", "--api-key", KEY_A, "--api-key", KEY_B,
                     "--api-key-file", str(key_file)]) as server:
        yield server


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=key, max_retries=0, timeout=60)


def complete(server, key: str, prompt: str, max_tokens: int = 1, **extra) -> tuple[str, int]:
    """(text, usage.prompt_tokens_details.cached_tokens) of a greedy completion."""
    response = client(server, key).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
        extra_body={"ignore_eos": True, **extra})
    details = response.usage.prompt_tokens_details
    return response.choices[0].text, (details.cached_tokens if details else 0) or 0


def test_every_key_gets_in_and_a_wrong_one_does_not(server):
    for key in (KEY_A, KEY_B, KEY_FROM_FILE):
        assert client(server, key).models.list().data
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-nobody").models.list()


def test_the_prefix_cache_is_shared_within_a_key_and_never_across_keys(server):
    prompt = "Tenant check one. " + PROMPT
    assert complete(server, KEY_A, prompt)[1] == 0
    assert complete(server, KEY_B, prompt)[1] == 0  # same prompt, another key: nothing cached
    assert complete(server, KEY_A, prompt)[1] > 0  # same key: its own blocks
    assert complete(server, KEY_B, prompt)[1] > 0  # B's first request cached B's own blocks


def test_a_guess_at_another_keys_answer_reveals_nothing(server):
    """Client A gets an answer; client B sends A's prompt + A's answer as a guess. Once (one key
    for everybody) cached_tokens counted the guessed answer's blocks; now it is 0 across keys, while
    A itself finds its prompt's blocks (and its answer's, where the text re-tokenizes alike)."""
    prompt = "Tenant check two. " + PROMPT
    answer, _ = complete(server, KEY_A, prompt, max_tokens=40)
    _, cached_by_b = complete(server, KEY_B, prompt + answer)
    _, cached_by_a = complete(server, KEY_A, prompt + answer)
    assert cached_by_b == 0
    assert cached_by_a > 0


def test_cache_salt_splits_a_key_further(server):
    prompt = "Tenant check three. " + PROMPT
    assert complete(server, KEY_A, prompt, cache_salt="team-1")[1] == 0
    assert complete(server, KEY_A, prompt, cache_salt="team-2")[1] == 0
    assert complete(server, KEY_A, prompt)[1] == 0
    assert complete(server, KEY_A, prompt, cache_salt="team-1")[1] > 0


def test_the_keys_never_reach_the_log(server):
    log = server.output()
    assert "API keys: 3" in log
    for key in (KEY_A, KEY_B, KEY_FROM_FILE):
        assert key not in log
