"""Prefix caching in the engine: a later request skips its cached prefix, greedy output is
token-identical with caching on and off for every batch mix, with preemption and with speculation,
tenants never share, and EAGLE (which needs the target's features at every position) reads a cached
prefix's features from beside its blocks."""

from __future__ import annotations

import pytest
import torch
from bigram_drafters import (
    assert_often_right,
    build_mostly_bigram_checkpoint,
    write_bigram_mlp_speculator,
)
from tiers import tiered

from engine import LLM, SamplingParams
from engine.models.arch import DecoderArch
from engine.models.loader import load_checkpoint
from engine.proposers.eagle_head import EagleConfig, EagleHead

SYSTEM = list(range(3, 60))  # a shared "system prompt" of 57 tokens: 3 full blocks of 16
PROMPTS = [[1] + SYSTEM + [70, 71, 72], [1] + SYSTEM + [80, 81], [1] + SYSTEM[:20] + [90],
           [1, 5, 9, 13, 2, 7, 5, 9, 13, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def engine(model: str, caching: bool, **kwargs) -> LLM:
    return LLM(model, dtype="float64", max_model_len=kwargs.pop("max_model_len", 256),
               num_kv_blocks=kwargs.pop("blocks", 64),
               enable_prefix_caching=caching, **kwargs)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[list[int]]:
    llm = engine(tiny_llama, caching=False)
    return [tokens(llm.generate([{"prompt_token_ids": p}], GREEDY))[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory) -> str:
    return build_mostly_bigram_checkpoint(tmp_path_factory.mktemp("mostly_bigram"))


@pytest.fixture(scope="module")
def mlp_speculator_folder(bigram_target, tmp_path_factory) -> str:
    """Built from the mostly-bigram target's own weights: right more often than not there."""
    return write_bigram_mlp_speculator(bigram_target,
                                       str(tmp_path_factory.mktemp("mlp_speculator")))


@pytest.mark.parametrize("method", tiered(["plain", "ngram", "suffix", "draft_model",
                                           "mlp_speculator"], {"plain", "suffix"}))
def test_cached_prefixes_are_skipped_and_the_tokens_stay(tiny_llama, expected, method, request):
    """The draft model keeps its own KV and recomputes the prefix itself: never stale. The MLP
    speculator reads only the newest position's feature, which a hit still computes (the block
    holding a prompt's last token is never shared); it runs on a mostly-bigram target, with a
    speculator built from that target's weights whose drafts are mostly accepted."""
    speculative_config = {
        "plain": None, "ngram": NGRAM,
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "draft_model": {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3},
        "mlp_speculator": {"method": "mlp_speculator", "num_speculative_tokens": 3,
                           "model": request.getfixturevalue("mlp_speculator_folder")
                           if method == "mlp_speculator" else None},
    }[method]
    if method == "mlp_speculator":
        tiny_llama = request.getfixturevalue("bigram_target")
        plain = engine(tiny_llama, caching=False)
        expected = [tokens(plain.generate([{"prompt_token_ids": p}], GREEDY))[0] for p in PROMPTS]
    llm = engine(tiny_llama, caching=True, speculative_config=speculative_config)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    assert tokens(first) == expected[:1]
    blocks = llm.engine.scheduler.block_manager
    assert blocks.prefix_cache_hits == 0
    # one by one, then all together: each later prompt finds the system prompt's full blocks
    cached = []
    for prompt, want in zip(PROMPTS[1:], expected[1:]):
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)
        assert tokens(out) == [want]
        cached.append(out[0].num_cached_tokens)
    assert cached == [48, 16, 0]
    snapshot = llm.engine.gauge_snapshot()  # what the server's Prometheus counters are fed
    assert (snapshot.prefix_cache_hits, snapshot.prefix_cache_queries) == \
        (blocks.prefix_cache_hits, blocks.prefix_cache_queries)
    assert snapshot.prefix_cache_hits == 64 and snapshot.prefix_cache_queries > 64
    assert blocks.prefix_cache_hits >= 48 + 16  # 3 blocks for prompt 1, 1 block for prompt 2
    batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert tokens(batched) == expected
    if method == "mlp_speculator":
        assert_often_right(batched)


def test_a_finished_conversation_is_found_by_its_next_turn(tiny_llama, expected):
    """The first turn's prompt + answer, extended: the second turn reuses every full block."""
    llm = engine(tiny_llama, caching=True)
    turn = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)[0].outputs[0].token_ids
    follow_up = PROMPTS[0] + turn + [33, 34]
    before = llm.engine.scheduler.block_manager.prefix_cache_hits
    got = tokens(llm.generate([{"prompt_token_ids": follow_up}], GREEDY))
    hits = llm.engine.scheduler.block_manager.prefix_cache_hits - before
    assert hits == (len(follow_up) - 1) // 16 * 16
    assert got == tokens(engine(tiny_llama, caching=False).generate(
        [{"prompt_token_ids": follow_up}], GREEDY))


def test_preemption_under_memory_pressure_keeps_the_tokens(tiny_llama, expected):
    """12 blocks for 4 requests of up to 6 blocks each: requests are preempted and re-admitted,
    finding their own cached blocks (or recomputing evicted ones)."""
    llm = engine(tiny_llama, caching=True, blocks=12, max_model_len=192, speculative_config=NGRAM)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert tokens(outs) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    blocks = llm.engine.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks  # nothing leaked: cached blocks are evictable


def test_tenants_do_not_share(tiny_llama):
    llm = engine(tiny_llama, caching=True)
    engine_core = llm.engine
    engine_core.add_request("a", PROMPTS[0], GREEDY, cache_salt="alice")
    while engine_core.has_unfinished:
        engine_core.step()
    blocks = engine_core.scheduler.block_manager
    engine_core.add_request("b", PROMPTS[1], GREEDY, cache_salt="bob")
    engine_core.add_request("c", PROMPTS[1], GREEDY, cache_salt=None)
    while engine_core.has_unfinished:
        engine_core.step()
    assert blocks.prefix_cache_hits == 0
    engine_core.add_request("d", PROMPTS[1], GREEDY, cache_salt="alice")
    while engine_core.has_unfinished:
        engine_core.step()
    assert blocks.prefix_cache_hits == 48
    # requests without a salt share the anonymous tenant, as in vLLM: "c" filled it
    engine_core.add_request("e", PROMPTS[0], GREEDY, cache_salt=None)
    while engine_core.has_unfinished:
        engine_core.step()
    assert blocks.prefix_cache_hits == 48 + 48


@pytest.fixture(scope="module")
def eagle_head_folder(tiny_llama, tmp_path_factory) -> str:
    arch = DecoderArch.from_hf_config(load_checkpoint(tiny_llama, torch.float32).hf_config)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(arch, arch.vocab_size), arch)
    head.draft_token_ids.copy_(torch.arange(arch.vocab_size))
    folder = tmp_path_factory.mktemp("eagle_head")
    head.save(str(folder))
    return str(folder)


def drafts_proposed(llm: LLM) -> dict[str, list[list[int]]]:
    """Every draft the engine's proposer returns from now on, per request id."""
    proposer, seen = llm.engine.proposer, {}
    propose = proposer.propose

    def recording(requests, caps, target_hidden):
        proposals = propose(requests, caps, target_hidden)
        for request, proposal in zip(requests, proposals):
            seen.setdefault(request.request_id, []).append(list(proposal.token_ids))
        return proposals

    proposer.propose = recording
    return seen


def test_eagle_reads_a_cached_prefix_features_from_its_blocks(tiny_llama, expected,
                                                              eagle_head_folder):
    """EAGLE conditions each position on the target's feature there; after a cached prefix those
    come from the feature store beside the blocks. The drafts (not only the tokens) must be those
    of an engine that computed the whole prompt: a zero or stale feature changes them."""
    config = {"method": "eagle", "model": eagle_head_folder, "num_speculative_tokens": 3}
    runs = {}
    for caching in (False, True):
        llm = engine(tiny_llama, caching=caching, speculative_config=config)
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
        seen = drafts_proposed(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:3]], GREEDY)
        assert tokens(outs) == expected[1:3]
        runs[caching] = (seen, [o.num_cached_tokens for o in outs])
    assert runs[True][1] == [48, 16] and runs[False][1] == [0, 0]
    drafts_off, drafts_on = (sorted(runs[c][0].values()) for c in (False, True))
    assert drafts_on == drafts_off and any(any(d) for d in drafts_on)
