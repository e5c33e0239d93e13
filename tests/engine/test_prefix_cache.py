"""engine/kv/prefix_cache.py + BlockManager with prefix caching: full blocks of committed tokens are shared
within a tenant, never written, evicted least recently used first, and never mistaken on a collision."""

from __future__ import annotations

import random

import pytest

from engine.kv import prefix_cache
from engine.kv.block_manager import BlockManager

BLOCK_SIZE = 4
SALT = "tenant-a"


def pool(num_blocks: int = 16, model_id: str = "tiny-llama") -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True, model_id=model_id)


def tokens(num: int, start: int = 100) -> list[int]:
    return list(range(start, start + num))


def run(bm: BlockManager, request_id: str, token_ids: list[int], salt: str | None = SALT) -> int:
    """Admit a request, 'compute' all of token_ids and register its full blocks; the cached count."""
    num_cached = bm.allocate_with_prefix(request_id, token_ids, salt, len(token_ids))
    bm.register_full_blocks(request_id, token_ids)
    return num_cached


def check_invariants(bm: BlockManager) -> None:
    free = list(bm._free_block_ids)
    evictable = [b for b in range(bm.num_blocks) if bm._cache.is_evictable(b)]
    referenced = [b for b in range(bm.num_blocks) if bm.ref_count(b) > 0]
    assert len(set(free)) == len(free), "a block twice in the free list"
    assert all(bm.ref_count(b) >= 0 for b in range(bm.num_blocks))
    assert not set(free) & set(referenced) and not set(free) & set(evictable)
    assert not set(evictable) & set(referenced)
    assert len(free) + len(evictable) + len(referenced) == bm.num_blocks
    assert bm.num_free_blocks == len(free) + len(evictable)
    holders: dict[int, int] = {}
    for table in bm._block_tables.values():
        assert len(set(table)) == len(table)
        for b in table:
            holders[b] = holders.get(b, 0) + 1
    assert all(bm.ref_count(b) == holders.get(b, 0) for b in range(bm.num_blocks))
    for entry in bm._cache.entries():
        assert bm._cache.entry(entry.block_id) is entry
        assert entry.block_id not in free
        parent_hash = (prefix_cache.root_hash(*entry.tenant) if entry.parent is None
                       else entry.parent.block_hash)
        assert prefix_cache.hash_block(parent_hash, entry.token_ids) == entry.block_hash
    assert all(bm._cache.entry(b) is not None for b in evictable)


# ---------------------------------------------------------------- hashing
def test_hash_is_wide_and_chained() -> None:
    root = prefix_cache.root_hash("m", SALT)
    h0 = prefix_cache.hash_block(root, [1, 2, 3, 4])
    assert len(h0) == 32
    assert h0 == prefix_cache.hash_block(root, (1, 2, 3, 4))
    assert h0 != prefix_cache.hash_block(root, [1, 2, 3, 5])
    assert prefix_cache.hash_block(h0, [5, 6, 7, 8]) != prefix_cache.hash_block(root, [5, 6, 7, 8])
    # tenant and model are length-prefixed: ("ab", "c") and ("a", "bc") differ
    assert prefix_cache.root_hash("ab", "c") != prefix_cache.root_hash("a", "bc")


# ---------------------------------------------------------------- sharing
def test_same_prefix_same_salt_shares_full_blocks() -> None:
    bm = pool()
    prompt_a = tokens(10)  # blocks [0..3] [4..7] and a partial one
    assert run(bm, "a", prompt_a) == 0
    prompt_b = tokens(8) + [7, 7, 7, 7, 7]
    assert bm.lookup_prefix(prompt_b, SALT) == bm.block_table("a")[:2]
    assert bm.allocate_with_prefix("b", prompt_b, SALT, len(prompt_b)) == 8
    table_a, table_b = bm.block_table("a"), bm.block_table("b")
    assert table_b[:2] == table_a[:2] and len(table_b) == 4
    assert [bm.ref_count(b) for b in table_b] == [2, 2, 1, 1]
    assert not set(table_b[2:]) & set(table_a)
    check_invariants(bm)


def test_lookup_changes_nothing() -> None:
    bm = pool()
    run(bm, "a", tokens(12))
    bm.free("a")
    before = (list(bm._free_block_ids), bm.num_free_blocks, bm.prefix_cache_queries)
    assert len(bm.lookup_prefix(tokens(13), SALT)) == 3
    assert (list(bm._free_block_ids), bm.num_free_blocks, bm.prefix_cache_queries) == before
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


@pytest.mark.parametrize("salt_a, salt_b", [("a", "b"), (None, None), ("a", None), (None, "a")])
def test_no_sharing_across_salts_or_without_one(salt_a: str | None, salt_b: str | None) -> None:
    bm = pool()
    run(bm, "a", tokens(12), salt_a)
    assert bm.lookup_prefix(tokens(13), salt_b) == []
    assert run(bm, "b", tokens(13), salt_b) == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))


def test_salt_none_caches_nothing_and_counts_nothing() -> None:
    bm = pool()
    run(bm, "a", tokens(12), None)
    bm.free("a")
    assert len(bm._cache) == 0 and bm.num_free_blocks == bm.num_blocks
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0


def test_no_sharing_across_model_identities() -> None:
    """Same tokens and salt under two model ids: the digests (and so the entries) differ."""
    a, b = pool(model_id="model-a"), pool(model_id="model-b")
    run(a, "r", tokens(8))
    run(b, "r", tokens(8))
    assert len(a._cache) == len(b._cache) == 2
    assert {e.block_hash for e in a._cache.entries()}.isdisjoint(
        e.block_hash for e in b._cache.entries())


@pytest.mark.parametrize("num_prompt, num_cached", [
    (4, 0),    # one full block, but it holds the last prompt token
    (5, 4),
    (8, 4),    # the last token sits in block 1: only block 0 is shared
    (9, 8),
    (12, 8),
    (13, 12),
])
def test_last_prompt_token_block_is_never_cached(num_prompt: int, num_cached: int) -> None:
    bm = pool()
    run(bm, "a", tokens(16))
    prompt = tokens(num_prompt)
    assert len(bm.lookup_prefix(prompt, SALT)) * BLOCK_SIZE == num_cached
    assert bm.allocate_with_prefix("b", prompt, SALT, num_prompt) == num_cached
    # the block the caller will write (from num_cached on) belongs to b alone
    assert all(bm.ref_count(b) == 1 for b in bm.block_table("b")[num_cached // BLOCK_SIZE:])


def test_only_committed_full_blocks_are_cached() -> None:
    bm = pool()
    bm.allocate_with_prefix("a", tokens(6), SALT, 6 + 3)  # 6 committed + 3 draft rows: 3 blocks
    bm.register_full_blocks("a", tokens(6))  # the caller passes committed tokens only
    assert len(bm._cache) == 1
    bm.register_full_blocks("a", tokens(7))
    assert len(bm._cache) == 1
    bm.register_full_blocks("a", tokens(8))
    assert len(bm._cache) == 2
    bm.register_full_blocks("a", tokens(8))  # repeats are no-ops
    assert len(bm._cache) == 2
    check_invariants(bm)


def test_identical_block_is_not_deduplicated() -> None:
    """Two requests computing the same prompt at once: the first registered copy is the cached one,
    the other keeps its own copy, and its later blocks still chain on the cached prefix."""
    bm = pool()
    bm.allocate_with_prefix("a", tokens(9), SALT, 9)
    bm.allocate_with_prefix("b", tokens(9), SALT, 9)
    bm.register_full_blocks("a", tokens(8))
    bm.register_full_blocks("b", tokens(8) + [1, 2, 3, 4])  # b's own third block differs
    bm.allocate("b", 12)
    bm.register_full_blocks("b", tokens(8) + [1, 2, 3, 4])
    assert len(bm._cache) == 3
    assert bm.lookup_prefix(tokens(8) + [1, 2, 3, 4, 5], SALT) == \
        bm.block_table("a")[:2] + bm.block_table("b")[2:3]
    check_invariants(bm)


# ---------------------------------------------------------------- eviction
def test_free_keeps_blocks_cached_and_available() -> None:
    bm = pool(4)
    run(bm, "a", tokens(12))
    assert bm.num_free_blocks == 1 and bm.usage == pytest.approx(0.75)
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    assert bm.can_allocate("b", 16)
    assert len(bm.lookup_prefix(tokens(13), SALT)) == 3


def test_lru_eviction_order_never_touches_referenced_blocks() -> None:
    bm = pool(6)
    run(bm, "old", tokens(8, start=0))  # 2 blocks
    bm.free("old")
    run(bm, "new", tokens(8, start=50))  # 2 blocks
    bm.free("new")
    run(bm, "held", tokens(8, start=90))  # 2 blocks, still referenced
    old, new = bm.lookup_prefix(tokens(9, start=0), SALT), bm.lookup_prefix(tokens(9, start=50), SALT)
    assert len(old) == len(new) == 2 and bm.num_free_blocks == 4
    held = list(bm.block_table("held"))
    # a request of one block evicts the least recently used: old's tail block (freed tail first)
    bm.allocate("x", 1)
    assert bm.block_table("x") == [old[1]]
    assert bm.lookup_prefix(tokens(9, start=0), SALT) == old[:1]
    bm.allocate("y", 4 * 3)
    assert sorted(bm.block_table("y")) == sorted([old[0], *new])
    assert not set(bm.block_table("x") + bm.block_table("y")) & set(held)
    assert bm.lookup_prefix(tokens(9, start=0), SALT) == []
    assert bm.lookup_prefix(tokens(9, start=50), SALT) == []
    assert bm.lookup_prefix(tokens(9, start=90), SALT) == held
    assert not bm.can_allocate("z", 1)
    check_invariants(bm)


def test_reuse_refreshes_lru_position() -> None:
    bm = pool(4)
    run(bm, "p", tokens(5, start=0))  # block 0 cached, block 1 partial
    run(bm, "q", tokens(5, start=50))
    bm.free("p")
    bm.free("q")
    p_block = bm.lookup_prefix(tokens(5, start=0), SALT)
    run(bm, "p2", tokens(5, start=0))  # references p's block again: now the most recent
    bm.free("p2")
    bm.allocate("x", 4 * 3)  # 2 free + 1 eviction: q's block goes, p's stays
    assert bm.lookup_prefix(tokens(5, start=0), SALT) == p_block
    assert bm.lookup_prefix(tokens(5, start=50), SALT) == []
    check_invariants(bm)


def test_taking_cached_blocks_counts_against_capacity() -> None:
    """An evictable cached block counts as free; taking it for a hit leaves one less for the rest."""
    bm = pool(3)
    run(bm, "a", tokens(9))
    bm.free("a")  # 2 cached evictable + 1 free
    prompt = tokens(8) + [1, 2, 3, 4, 5]  # hits 2 blocks, needs 2 fresh: 4 > 3
    assert bm.can_allocate("b", 8)
    assert not bm.can_allocate_with_prefix(prompt, SALT, len(prompt))
    with pytest.raises(RuntimeError, match="short"):
        bm.allocate_with_prefix("b", prompt, SALT, len(prompt))
    assert bm.block_table("b") == [] and bm.num_free_blocks == 3
    assert bm.can_allocate_with_prefix(prompt, SALT, 12)
    assert bm.allocate_with_prefix("b", prompt, SALT, 12) == 8
    check_invariants(bm)


def test_reset_prefix_cache_drops_only_unreferenced() -> None:
    bm = pool()
    run(bm, "a", tokens(9, start=0))
    run(bm, "b", tokens(9, start=50))
    bm.free("a")
    assert bm.reset_prefix_cache() == 2
    assert bm.lookup_prefix(tokens(9, start=0), SALT) == []
    assert len(bm.lookup_prefix(tokens(9, start=50), SALT)) == 2
    assert bm.num_free_blocks == bm.num_blocks - 3
    check_invariants(bm)


# ---------------------------------------------------------------- collisions
def test_forced_collision_is_detected_and_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block hashes alike: lookups compare tokens, tenant and parent, so nothing wrong is
    returned, and a referenced colliding entry is kept."""
    monkeypatch.setattr(prefix_cache, "hash_block", lambda parent_hash, token_ids: b"x" * 32)
    bm = pool()
    run(bm, "a", tokens(9, start=0))
    assert len(bm._cache) == 1  # block 1 collides with a's own block 0: a's chain stops there
    assert bm.lookup_prefix(tokens(9, start=0), SALT) == bm.block_table("a")[:1]
    assert bm.lookup_prefix(tokens(9, start=50), SALT) == []
    assert bm.lookup_prefix(tokens(9, start=0), "other") == []
    assert run(bm, "b", tokens(9, start=50)) == 0
    assert bm.lookup_prefix(tokens(9, start=50), SALT) == []  # a's referenced entry keeps the name
    check_invariants(bm)


def test_collision_in_an_earlier_block_never_returns_a_child(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefixes P and P' collide on block 0 and share block 1's tokens: P' must not find P's
    block 1, whose K/V was computed over P."""
    real = prefix_cache.hash_block

    def colliding(parent_hash: bytes, token_ids: tuple[int, ...]) -> bytes:
        return real(parent_hash, [0] * len(token_ids)) if token_ids[0] in (0, 50) else \
            real(parent_hash, token_ids)
    monkeypatch.setattr(prefix_cache, "hash_block", colliding)
    bm = pool()
    shared_tail = [7, 7, 7, 7]
    run(bm, "p", tokens(4, start=0) + shared_tail + [1])
    bm.free("p")  # evictable: a new prefix may take the name of block 0
    assert bm.lookup_prefix(tokens(4, start=50) + shared_tail + [1], SALT) == []
    run(bm, "q", tokens(4, start=50) + shared_tail + [1])
    q_table = bm.block_table("q")
    assert bm.lookup_prefix(tokens(4, start=50) + shared_tail + [1], SALT) == q_table[:2]
    assert bm.lookup_prefix(tokens(4, start=0) + shared_tail + [1], SALT) == []
    check_invariants(bm)


# ---------------------------------------------------------------- preemption, counters
def test_preempted_request_finds_its_blocks_again() -> None:
    bm = pool()
    prompt = tokens(6)
    assert bm.allocate_with_prefix("a", prompt, SALT, 6) == 0
    bm.register_full_blocks("a", prompt)
    output = [1, 2, 3, 4, 5]  # committed output tokens; drafts are never registered
    bm.allocate("a", 11)
    bm.register_full_blocks("a", prompt + output)
    table = list(bm.block_table("a"))
    bm.free("a")  # recompute-style preemption
    assert bm.allocate_with_prefix("a", prompt + output, SALT, 11) == 8
    assert bm.block_table("a")[:2] == table[:2]
    assert bm.prefix_cache_queries == 6 + 11 and bm.prefix_cache_hits == 8
    check_invariants(bm)


def test_hits_and_queries_count_tokens() -> None:
    bm = pool()
    run(bm, "a", tokens(10))  # 10 queried, 0 hits
    run(bm, "b", tokens(10))  # 10 queried, 8 hits
    run(bm, "c", tokens(3))   # 3 queried, 0 hits
    bm.lookup_prefix(tokens(10), SALT)  # a lookup alone counts nothing
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (23, 8)


def test_disabled_caching_is_plain_allocation() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    plain = BlockManager(8, BLOCK_SIZE)
    for manager in (bm, plain):
        manager.allocate("a", 9)
    assert bm.allocate_with_prefix("b", tokens(9), SALT, 9) == 0
    plain.allocate("b", 9)
    bm.register_full_blocks("b", tokens(9))
    assert bm.lookup_prefix(tokens(9), SALT) == []
    for manager in (bm, plain):
        manager.free("b")
    assert list(bm._free_block_ids) == list(plain._free_block_ids)
    assert bm.block_table("a") == plain.block_table("a")
    assert len(bm._cache) == 0 and bm.prefix_cache_queries == 0


# ---------------------------------------------------------------- stress
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    bm = pool(24)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 14))] for _ in range(6)]
    salts = ["a", "b", None]
    live: dict[str, tuple[list[int], str | None, int]] = {}  # id -> tokens, salt, committed
    for step in range(600):
        request_id = f"r{rng.randrange(10)}"
        op = rng.random()
        if request_id not in live:
            token_ids = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(8))]
            if not token_ids:
                continue
            salt = rng.choice(salts)
            expected = len(bm.lookup_prefix(token_ids, salt)) * BLOCK_SIZE
            num_tokens = min(len(token_ids), expected + rng.randrange(1, 9))
            if bm.can_allocate_with_prefix(token_ids, salt, num_tokens):
                assert bm.allocate_with_prefix(request_id, token_ids, salt, num_tokens) == expected
                assert expected < len(token_ids) and expected % BLOCK_SIZE == 0
                assert all(bm.ref_count(b) == 1
                           for b in bm.block_table(request_id)[expected // BLOCK_SIZE:])
                live[request_id] = (token_ids, salt, expected)
            else:
                with pytest.raises(RuntimeError):
                    bm.allocate_with_prefix(request_id, token_ids, salt, num_tokens)
        elif op < 0.25:
            bm.free(request_id)
            del live[request_id]
        else:
            token_ids, salt, committed = live[request_id]
            # commit a few tokens (sometimes generated ones), with room for drafts past them
            committed = min(len(token_ids), committed + rng.randrange(0, 6))
            if committed == len(token_ids):
                token_ids = token_ids + [rng.randrange(5) for _ in range(rng.randrange(4))]
            num_tokens = committed + rng.randrange(0, 4)
            if bm.can_allocate(request_id, num_tokens):
                bm.allocate(request_id, num_tokens)
                committed = min(committed, len(bm.block_table(request_id)) * BLOCK_SIZE)
                bm.register_full_blocks(request_id, token_ids[:committed])
                live[request_id] = (token_ids, salt, committed)
        check_invariants(bm)
        # every hit really is the tokens asked for, chained from the right tenant
        for token_ids, salt, _ in live.values():
            parent = None
            for index, block_id in enumerate(bm.lookup_prefix(token_ids, salt)):
                entry = bm._cache.entry(block_id)
                assert entry.parent is parent and entry.tenant[1] == salt
                assert list(entry.token_ids) == token_ids[index * BLOCK_SIZE:][:BLOCK_SIZE]
                parent = entry
    for request_id in list(live):
        bm.free(request_id)
    check_invariants(bm)
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.prefix_cache_hits <= bm.prefix_cache_queries
