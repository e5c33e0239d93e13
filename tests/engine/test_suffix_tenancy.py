"""Suffix decoding's cache of finished outputs is shared only within a tenant (a `cache_salt`; None
is no tenant and shares nothing) unless "suffix_cache_scope" is "global": a client cannot learn from its
acceptance counts what another client's outputs said. The cache stays bounded over all tenants, and
greedy output is the same whoever drafted it."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import pytest

from engine import LLM, SamplingParams
from engine.engine_args import EngineArgs
from engine.proposers.suffix import SuffixProposer
from engine.request import Request
from engine.spec_config import SpeculativeConfig
from server.engine_client import EngineClient

_request_ids = itertools.count()
OUTPUT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
# the later request has seen the first 6 tokens of OUTPUT: only a cached OUTPUT can draft the rest
LATER_PROMPT = [7, 8] + OUTPUT[:6]


def make_request(prompt: Sequence[int], output: Sequence[int] = (), cache_salt: str | None = None,
                 request_id: str | None = None) -> Request:
    request = Request(request_id or f"r{next(_request_ids)}", list(prompt),
                      SamplingParams(temperature=0.0), frozenset(), cache_salt=cache_salt)
    request.output_token_ids.extend(output)
    return request


def finish(suffix: SuffixProposer, output: Sequence[int], cache_salt: str | None) -> None:
    """A request of that tenant ran to the end with this output."""
    request = make_request([1, 2, 3], output, cache_salt)
    suffix.propose([request], [0], None)
    suffix.free(request.request_id)


def draft(suffix: SuffixProposer, prompt: Sequence[int], cache_salt: str | None) -> list[int]:
    return suffix.propose([make_request(prompt, cache_salt=cache_salt)], [4], None)[0].token_ids


# ---------------------------------------------------------------------- the proposer
@pytest.mark.parametrize("owner", ["alice", ""])
def test_a_tenant_drafts_only_from_its_own_outputs(owner):
    suffix = SuffixProposer(24, 1000, 0.1, 1.0)
    finish(suffix, OUTPUT, owner)
    assert draft(suffix, LATER_PROMPT, owner) == OUTPUT[6:10]
    for other in ("bob", "", None, "alice"):
        if other != owner:
            assert draft(suffix, LATER_PROMPT, other) == [], other


def test_a_request_without_a_salt_shares_with_nobody():
    """No salt, no tenant: it neither feeds the cache nor drafts from anyone's outputs."""
    suffix = SuffixProposer(24, 1000, 0.1, 1.0)
    finish(suffix, OUTPUT, None)
    assert suffix.cache.num_cached_tokens == 0
    for tenant in (None, "alice", ""):
        assert draft(suffix, LATER_PROMPT, tenant) == []
    finish(suffix, OUTPUT, "alice")
    assert draft(suffix, LATER_PROMPT, None) == []


def test_global_scope_shares_outputs_across_tenants():
    suffix = SuffixProposer(24, 1000, 0.1, 1.0, is_cache_shared_across_tenants=True)
    finish(suffix, OUTPUT, "alice")
    for tenant in ("alice", "bob", None):
        assert draft(suffix, LATER_PROMPT, tenant) == OUTPUT[6:10]
    assert suffix.cache.num_tenants == 1


def test_a_new_salt_per_request_cannot_grow_the_cache():
    """Every tenant's outputs count against one bound; the least recently used tenants go first,
    and drafting counts as use."""
    suffix = SuffixProposer(8, 100, 0.1, 1.0)
    finish(suffix, OUTPUT, "regular")
    for i in range(2000):
        finish(suffix, [1000 + i, 2000 + i, 3000 + i, 4000 + i, 5000 + i], f"salt-{i}")
        assert suffix.cache.num_cached_tokens <= 100
        assert suffix.cache.num_tenants <= 100 // 5 + 1
        if i % 5 == 0:  # the regular tenant keeps drafting, so it stays
            assert draft(suffix, LATER_PROMPT[-6:], "regular") == OUTPUT[6:10]
    assert suffix.cache.num_cached_tokens >= 50
    assert draft(suffix, [1999, 2999], "salt-1999") == [3999]
    assert draft(suffix, [1000, 2000], "salt-0") == []  # evicted long ago


def test_cache_scope_config():
    base = {"method": "suffix", "num_speculative_tokens": 4}
    assert SpeculativeConfig.from_json(base).suffix_cache_scope == "tenant"
    shared = SpeculativeConfig.from_json({**base, "suffix_cache_scope": "global"})
    assert shared.suffix_cache_scope == "global"
    with pytest.raises(ValueError, match="suffix_cache_scope must be one of tenant, global"):
        SpeculativeConfig.from_json({**base, "suffix_cache_scope": "user"})
    with pytest.raises(ValueError, match="'suffix_cache_scope' must be str"):
        SpeculativeConfig.from_json({**base, "suffix_cache_scope": None})


# ---------------------------------------------------------------------- end to end
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CANDIDATE_PROMPTS = [[1, 42, 67, 64, 15, 40, 72, 39], [1, 40, 63, 47, 76, 29, 66, 19],
                     [1, 80, 83, 28, 72, 63, 58, 68], [1, 35, 9, 72, 3, 13, 94, 53],
                     [1, 79, 20, 41, 14, 95, 11, 89], [1, 33, 95, 43, 92, 10, 26, 74]]


@pytest.fixture(scope="module")
def unrepeating(tiny_llama) -> tuple[list[int], list[int]]:
    """A prompt whose prompt + greedy output repeats no token: its own suffix tree never matches,
    so every draft it gets comes from the cache of other requests' outputs."""
    plain = LLM(tiny_llama, dtype="float64", max_model_len=128, num_kv_blocks=64)
    outs = plain.generate([{"prompt_token_ids": p} for p in CANDIDATE_PROMPTS], GREEDY)
    for prompt, out in zip(CANDIDATE_PROMPTS, outs):
        tokens = prompt + out.outputs[0].token_ids
        if len(set(tokens)) == len(tokens):
            return prompt, out.outputs[0].token_ids
    pytest.fail("no candidate prompt has an unrepeating greedy output on this tiny model")


@pytest.mark.parametrize("scope", ["tenant", "global"])
def test_llm_shares_drafts_within_a_tenant_only(tiny_llama, unrepeating, scope):
    prompt, expected = unrepeating
    llm = LLM(tiny_llama, dtype="float64", max_model_len=128, num_kv_blocks=64,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4,
                                  "suffix_cache_scope": scope})

    def run(**salt):
        out = llm.generate([{"prompt_token_ids": prompt, **salt}], GREEDY)[0]
        assert out.outputs[0].token_ids == expected
        return out.spec_stats

    assert run(cache_salt="alice").num_draft_tokens == 0  # nothing cached yet, nothing repeats
    others = [run(cache_salt="bob"), run(), run(cache_salt="")]  # "" is a tenant too, not None
    alice_again = run(cache_salt="alice")
    assert alice_again.num_accepted_draft_tokens > 0
    if scope == "tenant":
        assert [s.num_draft_tokens for s in others] == [0, 0, 0]
    else:
        assert all(s.num_accepted_draft_tokens > 0 for s in others)


@pytest.mark.slow
def test_engine_process_forwards_the_salt(tiny_llama, unrepeating):
    """The salt crosses the queue to the engine process (server/engine_client.py)."""
    prompt, expected = unrepeating

    async def run(client: EngineClient, request_id: str, salt: str | None) -> dict:
        queue = await client.add_request(request_id, prompt, GREEDY, cache_salt=salt)
        tokens = []
        while True:
            delta = await asyncio.wait_for(queue.get(), 60)
            assert not isinstance(delta, Exception), delta
            tokens += delta.new_token_ids
            if delta.finish_reason is not None:
                assert tokens == expected
                return delta.spec_stats

    async def main() -> None:
        client = EngineClient(EngineArgs(
            model=tiny_llama, dtype="float64", max_model_len=128, num_kv_blocks=64,
            speculative_config={"method": "suffix", "num_speculative_tokens": 4}))
        await client.start(timeout=120)
        try:
            assert (await run(client, "a1", "alice")).num_draft_tokens == 0
            assert (await run(client, "b1", "bob")).num_draft_tokens == 0
            assert (await run(client, "n1", None)).num_draft_tokens == 0
            assert (await run(client, "a2", "alice")).num_accepted_draft_tokens > 0
        finally:
            await client.shutdown()

    asyncio.run(main())
