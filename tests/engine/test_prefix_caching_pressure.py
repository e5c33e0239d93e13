"""Prefix caching under pressure, through the real engine (scheduler + worker + pool), not the pool alone.

test_prefix_cache.py checks the pool's bookkeeping on made-up calls and test_prefix_caching_engine.py
checks hits and losslessness with room to spare. What breaks in production is the crowded case: a
pool too small to keep every prefix, requests preempted and re-admitted, verification rows writing
draft K/V next to shared blocks, aborts mid-flight. Here:

  1. eviction is least recently used first, and an evicted prefix is really gone (recomputed, still
     token-identical to an engine without caching) while the freshest one still hits;
  2. while a block is cached its K/V (every layer) is never written: after EVERY step each cached
     block is compared bit for bit with its contents when it became cached, and the pool's
     invariants are checked (each block free, referenced or evictable, exactly once; ref counts
     equal to the tables listing the block);
  3. a seeded overload soak (tenants, aborts, speculation, preemption) ends with every block back:
     no tables, ref counts 0, the whole pool free, and reset_prefix_cache() empties the cache into
     the free list; the surviving requests' greedy tokens equal a plain engine's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from engine import LLM, SamplingParams
from engine.core import EngineCore
from engine.kv.prefix_cache import CachedBlock

BLOCK = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def engine(model: str, caching: bool, blocks: int, max_model_len: int = 128,
           speculative_config: dict | None = None) -> LLM:
    return LLM(model, dtype="float64", max_model_len=max_model_len, num_kv_blocks=blocks,
               enable_prefix_caching=caching, speculative_config=speculative_config)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def reference_tokens(model: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """What an engine without prefix caching, speculation or pool pressure emits, prompt by prompt."""
    llm = engine(model, caching=False, blocks=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in max_tokens])
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------- watching the pool every step
def check_pool(core: EngineCore) -> None:
    """Every block is in exactly one of {free list, some block table, evictable cache}; ref counts
    equal the number of tables listing the block; only running requests hold tables."""
    pool = core.scheduler.block_manager
    cache = pool._cache
    free = list(pool._free_block_ids)
    assert len(set(free)) == len(free), f"a block twice in the free list: {free}"
    holders = [0] * pool.num_blocks
    for request_id, table in pool._block_tables.items():
        assert len(set(table)) == len(table), f"{request_id} lists a block twice: {table}"
        for block_id in table:
            holders[block_id] += 1
    for block_id in range(pool.num_blocks):
        assert pool.ref_count(block_id) == holders[block_id], \
            f"block {block_id}: ref count {pool.ref_count(block_id)}, {holders[block_id]} tables"
        places = [block_id in free, holders[block_id] > 0, cache.is_evictable(block_id)]
        assert sum(places) == 1, f"block {block_id} free/referenced/evictable = {places}"
        if cache.is_evictable(block_id):
            assert cache.entry(block_id) is not None, f"evictable block {block_id} is not cached"
        if block_id in free:
            assert cache.entry(block_id) is None, f"free block {block_id} is still cached"
    assert pool.num_free_blocks == len(free) + cache.num_evictable
    running = {r.request_id for r in core.scheduler.running}
    assert set(pool._block_tables) <= running, \
        f"requests not running hold blocks: {set(pool._block_tables) - running}"


@dataclass
class CachedKVWatch:
    """After each step: the pool's invariants, and every cached block's K/V (all layers, K and V)
    bit-identical to what it held when the block became cached. A block evicted and cached again is
    a new entry and gets a new snapshot."""

    core: EngineCore
    # block id -> (its cache entry, its K/V per layer then)
    snapshots: dict[int, tuple[CachedBlock, list[torch.Tensor]]] = field(default_factory=dict)
    num_compared: int = 0  # (block, step) pairs compared
    num_shared_compared: int = 0  # of those, blocks referenced by more than one request
    num_draft_tokens: int = 0  # verified in the steps watched

    def block_kv(self, block_id: int) -> list[torch.Tensor]:
        # per layer [2, num_kv_heads, num_blocks, block_size, head_dim] (allocate_kv_cache)
        return [layer[:, :, block_id].clone() for layer in self.core.worker.kv_caches]

    def step(self) -> list:
        result = self.core.step()
        updates = result.updates
        if result.stats is not None:
            self.num_draft_tokens += result.stats.num_draft_tokens
        self.check()
        return updates

    def check(self) -> None:
        check_pool(self.core)
        pool = self.core.scheduler.block_manager
        live = {}
        for block_id in range(pool.num_blocks):
            entry = pool._cache.entry(block_id)
            if entry is None:
                continue
            before = self.snapshots.get(block_id)
            if before is None or before[0] is not entry:
                live[block_id] = (entry, self.block_kv(block_id))
                continue
            for layer, (then, now) in enumerate(zip(before[1], self.block_kv(block_id))):
                assert torch.equal(then.view(torch.uint8), now.view(torch.uint8)), (
                    f"cached block {block_id} (ref count {pool.ref_count(block_id)}) was written "
                    f"in layer {layer}")
            self.num_compared += 1
            self.num_shared_compared += pool.ref_count(block_id) > 1
            live[block_id] = before
        self.snapshots = live


@dataclass
class Finished:
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None


def collect(results: dict[str, Finished], updates) -> None:
    for update in updates:
        result = results.setdefault(update.request_id, Finished())
        result.token_ids += update.new_token_ids
        if update.finish_reason is not None:
            result.finish_reason = update.finish_reason.value
            result.num_cached_tokens = update.num_cached_tokens


def assert_pool_drained(core: EngineCore) -> None:
    """Nothing leaked: no tables, no references, the whole pool free; resetting the cache returns
    every cached block to the free list."""
    pool = core.scheduler.block_manager
    assert not core.has_unfinished
    assert pool._block_tables == {}
    assert [pool.ref_count(b) for b in range(pool.num_blocks)] == [0] * pool.num_blocks
    assert pool.num_free_blocks == pool.num_blocks
    num_cached = pool._cache.num_evictable
    assert num_cached == len(pool._cache) > 0  # something was cached, and all of it is evictable
    assert pool.reset_prefix_cache() == num_cached
    assert sorted(pool._free_block_ids) == list(range(pool.num_blocks))
    assert len(pool._cache) == 0 and pool._cache.num_evictable == 0


# ---------------------------------------------------------------- 1. eviction, LRU first
def test_eviction_under_pressure_is_lru_and_evicted_prefixes_recompute_identically(tiny_llama):
    """16 blocks; each prompt is 33 tokens (2 full cacheable blocks + 1) with 8 output tokens, so a
    request holds 3 blocks and leaves 2 cached. Run one at a time, the pool keeps 15 cached blocks
    at most (one block stays free after each request): 7.5 prompts' worth.

    P0..P11 in order, then P5 again (refreshing it), then Q0..Q2. Least recently used first, and a
    freed table parked tail first (so a prefix's first block outlives its second), leaves:
    P0-P4 gone, P5 whole (refreshed), P6, P7 gone, P8 its first block only, P9..P11 and Q0..Q2 whole.
    Evicting by insertion order would have lost P5; evicting the newest would have lost Q2; an
    eviction that kept the hash would still find P0."""
    salt = "tenant"
    rng = random.Random(7)
    prompts = [[2 + i] + [rng.randrange(2, 96) for _ in range(32)] for i in range(15)]
    p, q = prompts[:12], prompts[12:]
    max_tokens = 8
    want = reference_tokens(tiny_llama, prompts, [max_tokens] * len(prompts))
    want_of = {tuple(prompt): tokens for prompt, tokens in zip(prompts, want)}

    core = engine(tiny_llama, caching=True, blocks=16).engine
    pool = core.scheduler.block_manager
    watch = CachedKVWatch(core)
    counter = iter(range(1000))

    def run(prompt: list[int]) -> Finished:
        request_id = f"r{next(counter)}"
        core.add_request(request_id, prompt, greedy(max_tokens), cache_salt=salt)
        results: dict[str, Finished] = {}
        while core.has_unfinished:
            collect(results, watch.step())
        result = results[request_id]
        assert result.token_ids == want_of[tuple(prompt)], "tokens differ from caching off"
        return result

    for prompt in p:
        assert run(prompt).num_cached_tokens == 0  # all distinct from the first block on
    assert run(p[5]).num_cached_tokens == 32
    for prompt in q:
        assert run(prompt).num_cached_tokens == 0

    def cached_tokens(prompt: list[int]) -> int:  # lookup_prefix changes nothing
        return len(pool.lookup_prefix(prompt, salt)) * BLOCK

    assert [cached_tokens(prompt) for prompt in p] == [0] * 5 + [32, 0, 0, 16, 32, 32, 32]
    assert [cached_tokens(prompt) for prompt in q] == [32, 32, 32]
    assert pool._cache.num_evictable == 15

    # the engine agrees: the freshest prompt and the refreshed one hit, an evicted one recomputes
    assert run(q[2]).num_cached_tokens == 32
    assert run(p[5]).num_cached_tokens == 32
    assert run(p[6]).num_cached_tokens == 0
    assert run(p[0]).num_cached_tokens == 0
    assert watch.num_compared > 0
    assert_pool_drained(core)


# ---------------------------------------------------------------- 2. cached blocks are never written
def test_cached_blocks_are_never_written_while_shared_with_speculation_and_preemption(tiny_llama):
    """Six requests on one 48-token system prompt (3 full blocks) with n-gram drafts, in a 14-block
    pool that cannot hold them all: they share the prefix blocks (ref count > 1), verification rows
    write draft K/V into the blocks after it, requests are preempted and re-admitted onto their own
    cached blocks. After every step every cached block must hold exactly the K/V it was cached with:
    registering a block before its tokens are committed, handing a cached block to a request as
    writable, or reusing a referenced block would change some block's bytes."""
    rng = random.Random(11)
    system = [1] + [rng.randrange(2, 96) for _ in range(47)]
    # repeated patterns in the suffixes give the n-gram proposer something to match
    suffixes = [[10 + i, 20, 30, 10 + i, 20, 30, 10 + i][: 3 + i] for i in range(6)]
    prompts = [system + s for s in suffixes]
    salts = ["acme"] * 5 + [None]  # None: the anonymous tenant, its own copy of the prefix
    max_tokens = [40, 36, 32, 40, 28, 24]
    want = reference_tokens(tiny_llama, prompts, max_tokens)

    core = engine(tiny_llama, caching=True, blocks=14, speculative_config=NGRAM).engine
    watch = CachedKVWatch(core)
    results: dict[str, Finished] = {}
    core.add_request("r0", prompts[0], greedy(max_tokens[0]), cache_salt=salts[0])
    collect(results, watch.step())  # r0's prefill caches the system prompt's blocks
    for i in range(1, 6):
        core.add_request(f"r{i}", prompts[i], greedy(max_tokens[i]), cache_salt=salts[i])
        collect(results, watch.step())
    while core.has_unfinished:
        collect(results, watch.step())

    assert [results[f"r{i}"].token_ids for i in range(6)] == want
    assert [results[f"r{i}"].num_cached_tokens for i in range(1, 6)] == [48] * 4 + [0]
    # the run did what it is meant to test
    assert core.scheduler.num_preemptions > 0
    assert watch.num_draft_tokens > 0
    assert watch.num_shared_compared > 0 and watch.num_compared > watch.num_shared_compared
    assert_pool_drained(core)


# ---------------------------------------------------------------- 3. the soak
def test_overload_soak_with_aborts_leaks_no_block_and_keeps_the_tokens(tiny_llama):
    """80 seeded requests: 60% on one of three system prompts, the rest distinct (and a few exact
    repeats); tenants None / alice / bob; 1-12 output tokens; arriving a few per step into a 16-block
    pool (preemption), about one in ten aborted waiting or mid-flight; n-gram speculation. Each step
    is watched as in test 2. At the end every block is back, and the requests that were not aborted
    emitted what a plain engine emits."""
    rng = random.Random(2024)
    systems = [[1] + [rng.randrange(2, 96) for _ in range(n - 1)] for n in (40, 24, 50)]
    prompts: list[list[int]] = []
    for _ in range(80):
        roll = rng.random()
        if roll < 0.6:
            prompt = rng.choice(systems) + [rng.randrange(2, 96) for _ in range(rng.randint(1, 12))]
        elif roll < 0.7 and prompts:
            prompt = list(rng.choice(prompts))
        else:
            prompt = [rng.randrange(2, 96) for _ in range(rng.randint(5, 50))]
        prompts.append(prompt)
    salts = [rng.choice([None, "alice", "bob"]) for _ in prompts]
    max_tokens = [rng.randint(1, 12) for _ in prompts]

    core = engine(tiny_llama, caching=True, blocks=16, speculative_config=NGRAM).engine
    watch = CachedKVWatch(core)
    results: dict[str, Finished] = {}
    aborted_running: list[str] = []
    aborted_waiting: list[str] = []
    pending = list(range(len(prompts)))
    while pending or core.has_unfinished:
        for _ in range(min(rng.randint(0, 4), len(pending))):
            i = pending.pop(0)
            core.add_request(f"r{i}", prompts[i], greedy(max_tokens[i]), cache_salt=salts[i])
        if core.has_unfinished and rng.random() < 0.15:
            victim = rng.choice(list(core.scheduler.requests.values()))
            is_running = victim in core.scheduler.running
            updates = core.abort([victim.request_id])
            assert [u.request_id for u in updates] == [victim.request_id]
            (aborted_running if is_running else aborted_waiting).append(victim.request_id)
            watch.check()
        collect(results, watch.step())

    aborted = set(aborted_running) | set(aborted_waiting)
    survivors = [i for i in range(len(prompts)) if f"r{i}" not in aborted]
    assert all(results[f"r{i}"].finish_reason == "length" for i in survivors)
    # the soak did what it is meant to test
    assert aborted_running and len(survivors) >= 60
    assert core.scheduler.num_preemptions > 0
    assert core.scheduler.block_manager.prefix_cache_hits > 0
    assert watch.num_draft_tokens > 0 and watch.num_shared_compared > 0
    assert_pool_drained(core)

    want = reference_tokens(tiny_llama, [prompts[i] for i in survivors],
                            [max_tokens[i] for i in survivors])
    got = [results[f"r{i}"].token_ids for i in survivors]
    assert got == want
