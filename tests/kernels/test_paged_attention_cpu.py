"""The C++ CPU paged-attention kernel against the torch reference (engine/models/attention.py), and its
batch invariance: a sequence's rows come out bit for bit the same whatever else the batch holds,
however many rows its sequence brings, and with any number of threads."""

from __future__ import annotations

import random

import pytest
import torch

from engine.models.attention import build_attention_metadata, paged_attention, torch_paged_attention
from kernels.paged_attention_cpu import paged_attention_cpu_available

pytestmark = pytest.mark.skipif(not paged_attention_cpu_available(),
                                reason="no C++ compiler, or SPECSERVE_CPU_KERNELS=0")
CPU = torch.device("cpu")


def make_step(query_lens, seq_lens, *, heads=6, kv_heads=2, head_dim=64, block_size=4,
              sliding_window=None, seed=0):
    """A cache with every sequence on shuffled, non-consecutive blocks, and this step's queries."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(blocks_needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    # some tables hold more blocks than the context needs yet, as the block manager allows
    tables = [[free.pop() for _ in range(n + rng.randint(0, 1))] for n in blocks_needed]
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim)
    query = torch.randn(sum(query_lens), heads, head_dim)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, sliding_window, CPU)
    return query, cache, meta, tables


def run_both(query_lens, seq_lens, **kwargs):
    query, cache, meta, _ = make_step(query_lens, seq_lens, **kwargs)
    assert meta.kernel is not None and meta.attn_mask is None  # the kernel path builds no mask
    scale = query.shape[-1] ** -0.5
    kernel = paged_attention(query, cache, meta, scale)
    return kernel, torch_paged_attention(query, cache, meta, scale)


@pytest.mark.parametrize("query_lens, seq_lens", [
    ([1], [1]),                               # a 1-token context
    ([1], [37]),                              # one decode row
    ([5], [23]),                              # 1 + 4 verification rows
    ([19], [19]),                             # a prefill from position 0
    ([1, 1, 1, 1], [9, 1, 33, 16]),           # a decode batch, block_size not dividing seq_len
    ([1, 4, 1, 30, 2], [50, 12, 3, 41, 7]),   # decode, verification and a prefill chunk together
    ([40, 3], [40, 70]),                      # a tile boundary inside a long chunk
])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_matches_the_torch_reference(query_lens, seq_lens, heads, kv_heads):
    kernel, reference = run_both(query_lens, seq_lens, heads=heads, kv_heads=kv_heads)
    torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 16, 80, 128])
@pytest.mark.parametrize("block_size", [1, 12, 16, 32])
def test_head_dims_and_block_sizes(head_dim, block_size):
    kernel, reference = run_both([1, 6, 1], [70, 45, 3], head_dim=head_dim, block_size=block_size)
    torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-5)


def test_a_wide_decode_batch_over_long_contexts():
    seq_lens = [random.Random(i).randint(1, 400) for i in range(24)]
    kernel, reference = run_both([1] * 24, seq_lens, heads=9, kv_heads=3, block_size=16)
    torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 100])
def test_sliding_window(sliding_window):
    kernel, reference = run_both([1, 7, 1, 20], [40, 30, 2, 20], sliding_window=sliding_window)
    torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-5)


def test_large_scores_do_not_overflow():
    query, cache, meta, _ = make_step([3, 1], [60, 90])
    query *= 30.0  # scores in the hundreds: the online softmax must rescale, not overflow
    kernel = paged_attention(query, cache, meta, 1.0)
    reference = torch_paged_attention(query, cache, meta, 1.0)
    assert torch.isfinite(kernel).all()
    torch.testing.assert_close(kernel, reference, rtol=1e-4, atol=1e-4)


# ---- batch invariance: exact equality ----

def rows_of(out, query_lens, index):
    start = sum(query_lens[:index])
    return out[start:start + query_lens[index]]


def attend(query, cache, query_lens, seq_lens, tables, block_size=4, sliding_window=None):
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, sliding_window, CPU)
    return paged_attention(query, cache, meta, query.shape[-1] ** -0.5)


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_a_sequence_alone_equals_it_in_any_batch(sliding_window):
    query_lens, seq_lens = [1, 4, 1, 25, 1, 1], [30, 17, 1, 60, 45, 8]
    query, cache, _, tables = make_step(query_lens, seq_lens, sliding_window=sliding_window)
    batched = attend(query, cache, query_lens, seq_lens, tables, sliding_window=sliding_window)
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    for i in range(len(query_lens)):
        alone = attend(query[starts[i]:starts[i] + query_lens[i]], cache, [query_lens[i]],
                       [seq_lens[i]], [tables[i]], sliding_window=sliding_window)
        assert torch.equal(alone, rows_of(batched, query_lens, i))
    # the same sequences in another order, in a smaller batch
    order = [3, 0, 5]
    sub_query = torch.cat([rows_of(query, query_lens, i) for i in order])
    sub = attend(sub_query, cache, [query_lens[i] for i in order], [seq_lens[i] for i in order],
                 [tables[i] for i in order], sliding_window=sliding_window)
    for position, i in enumerate(order):
        assert torch.equal(rows_of(sub, [query_lens[i] for i in order], position),
                           rows_of(batched, query_lens, i))


def test_a_row_is_the_same_in_a_decode_a_verification_and_a_prefill_chunk():
    seq_len = 53
    query, cache, _, tables = make_step([seq_len], [seq_len])
    table = tables[0]
    prefill = attend(query, cache, [seq_len], [seq_len], [table])  # every row at once
    for query_len in (1, 2, 5, 17):
        for end in (query_len, 20, 37, seq_len):
            rows = attend(query[end - query_len:end], cache, [query_len], [end], [table])
            assert torch.equal(rows, prefill[end - query_len:end])


def test_thread_count_does_not_change_a_bit():
    query_lens, seq_lens = [1, 9, 1, 33], [80, 40, 5, 33]
    query, cache, _, tables = make_step(query_lens, seq_lens)
    threads = torch.get_num_threads()
    try:
        outs = []
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            outs.append(attend(query, cache, query_lens, seq_lens, tables))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
