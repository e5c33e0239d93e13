"""engine/kv/block_manager.py: block tables grow by ceil(tokens / block_size), the pool never leaks."""

from __future__ import annotations

import random

import pytest

from engine.kv.block_manager import BlockManager

BLOCK_SIZE = 4


def pool(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE)


@pytest.mark.parametrize("steps, expected_num_blocks", [
    # each step grows the same request to hold that many tokens
    ([1], [1]),
    ([4], [1]),
    ([5], [2]),
    ([1, 4, 5, 8, 9], [1, 1, 2, 2, 3]),
    ([12, 3], [3, 3]),  # asking for fewer tokens never shrinks the table
    ([0], [0]),
])
def test_table_grows_by_ceil(steps: list[int], expected_num_blocks: list[int]) -> None:
    bm = pool()
    for num_tokens, expected in zip(steps, expected_num_blocks):
        bm.allocate("a", num_tokens)
        assert len(bm.block_table("a")) == expected
        assert bm.num_free_blocks == bm.num_blocks - expected


def test_blocks_are_distinct_and_owned_once() -> None:
    bm = pool()
    bm.allocate("a", 9)
    bm.allocate("b", 5)
    table_a, table_b = bm.block_table("a"), bm.block_table("b")
    assert len(set(table_a + table_b)) == len(table_a) + len(table_b) == 5
    assert all(bm.ref_count(b) == 1 for b in table_a + table_b)


def test_slot_arithmetic() -> None:
    """Token i lives in slot table[i // block_size] * block_size + i % block_size: all distinct."""
    bm = pool()
    bm.allocate("a", 10)
    table = bm.block_table("a")
    slots = [table[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(10)]
    assert len(set(slots)) == 10
    assert all(0 <= s < bm.num_blocks * BLOCK_SIZE for s in slots)
    assert slots[:BLOCK_SIZE] == [table[0] * BLOCK_SIZE + j for j in range(BLOCK_SIZE)]


@pytest.mark.parametrize("held, request_tokens, can", [
    (0, 32, True),   # exactly the whole pool
    (0, 33, False),
    (6, 8, True),    # 2 blocks free, 2 needed
    (6, 9, False),
    (8, 1, False),
])
def test_can_allocate(held: int, request_tokens: int, can: bool) -> None:
    bm = pool(8)
    bm.allocate("other", held * BLOCK_SIZE)
    assert bm.num_blocks_to_add("new", request_tokens) == -(-request_tokens // BLOCK_SIZE)
    assert bm.can_allocate("new", request_tokens) is can


def test_can_allocate_counts_only_the_growth() -> None:
    bm = pool(2)
    bm.allocate("a", 5)  # both blocks
    assert bm.can_allocate("a", 8)
    assert not bm.can_allocate("a", 9)


def test_allocate_over_asked_raises_and_changes_nothing() -> None:
    bm = pool(2)
    bm.allocate("a", 4)
    with pytest.raises(RuntimeError, match="needs 2 KV blocks, 1 are free"):
        bm.allocate("b", 8)
    assert bm.num_free_blocks == 1
    assert bm.block_table("b") == []


def test_free_returns_every_block() -> None:
    bm = pool(4)
    bm.allocate("a", 10)
    table = bm.block_table("a")
    bm.free("a")
    assert bm.num_free_blocks == 4
    assert bm.block_table("a") == []
    assert all(bm.ref_count(b) == 0 for b in table)
    bm.free("a")  # freeing twice (or an unknown id) is a no-op
    assert bm.num_free_blocks == 4


def test_random_alloc_free_never_leaks() -> None:
    rng = random.Random(1234)
    bm = pool(16)
    sizes: dict[str, int] = {}
    for _ in range(2000):
        request_id = f"r{rng.randrange(8)}"
        if request_id in sizes and rng.random() < 0.3:
            bm.free(request_id)
            del sizes[request_id]
            continue
        num_tokens = sizes.get(request_id, 0) + rng.randrange(1, 9)
        if bm.can_allocate(request_id, num_tokens):
            bm.allocate(request_id, num_tokens)
            sizes[request_id] = num_tokens
        else:
            with pytest.raises(RuntimeError):
                bm.allocate(request_id, num_tokens)
        held = sum(-(-n // BLOCK_SIZE) for n in sizes.values())
        assert bm.num_free_blocks == bm.num_blocks - held
    for request_id in list(sizes):
        bm.free(request_id)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


@pytest.mark.parametrize("num_tokens, usage", [(0, 0.0), (1, 0.125), (16, 0.5), (32, 1.0)])
def test_usage_fraction(num_tokens: int, usage: float) -> None:
    bm = pool(8)
    bm.allocate("a", num_tokens)
    assert bm.usage == pytest.approx(usage)
