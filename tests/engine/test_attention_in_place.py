"""On the torch path, a lone sequence with consecutive blocks is attended in place (a view of
the cache), and gives bit for bit what the gathered copy gives, for decode, verification rows and
prefill chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.models.attention import build_attention_metadata, torch_paged_attention

KV_HEADS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 16, 4, 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("table, query_len, seq_len", [
    ([5, 6, 7, 8], 1, 13),          # decode
    ([0, 1, 2, 3, 4], 5, 17),       # 1 + 4 verification rows
    ([10, 11, 12], 6, 11),          # a prefill chunk after cached tokens
    ([3, 4, 5, 6, 7, 8], 3, 16),    # more blocks allocated than the context needs yet
    ([9], 4, 4),                    # a prefill from position 0 (causal path)
])
def test_in_place_equals_the_gather(dtype, table, query_len, seq_len):
    torch.manual_seed(0)
    cache = torch.randn(2, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, dtype=dtype)
    query = torch.randn(query_len, HEADS, HEAD_DIM, dtype=dtype)
    meta = build_attention_metadata([query_len], [seq_len], [table], BLOCK_SIZE, None,
                                    torch.device("cpu"))
    assert meta.first_block == table[0]
    gathered = dataclasses.replace(meta, first_block=None)
    in_place = torch_paged_attention(query, cache, meta, HEAD_DIM**-0.5)
    assert torch.equal(in_place, torch_paged_attention(query, cache, gathered, HEAD_DIM**-0.5))


@pytest.mark.parametrize("tables", [[[4, 9, 5]], [[2, 1]], [[0, 1], [2, 3]]])
def test_scattered_blocks_or_a_batch_are_gathered(tables):
    meta = build_attention_metadata([1] * len(tables), [len(t) * BLOCK_SIZE for t in tables], tables,
                                    BLOCK_SIZE, None, torch.device("cpu"))
    assert meta.first_block is None
