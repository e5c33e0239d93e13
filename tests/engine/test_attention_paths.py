"""Which path `paged_attention` takes, and that the paths agree: the CPU kernel for float32 (no
padded mask built), the torch reference for what the kernel does not take (float64, head_dim not a
multiple of 8, no kernel at all), with the mask then built on first use."""

from __future__ import annotations

import random

import pytest
import torch

import engine.models.attention as attention
from engine.models.attention import build_attention_metadata, paged_attention, torch_paged_attention
from kernels.paged_attention_cpu import paged_attention_cpu_available

needs_kernel = pytest.mark.skipif(not paged_attention_cpu_available(),
                                  reason="no C++ compiler, or SPECSERVE_CPU_KERNELS=0")
CPU = torch.device("cpu")
BLOCK_SIZE = 4
# decode, verification rows and a prefill chunk in one step
QUERY_LENS, SEQ_LENS = [1, 5, 1, 12], [9, 14, 1, 30]


def step(dtype, head_dim=16, sliding_window=None):
    """Shuffled block tables, a cache and queries for QUERY_LENS / SEQ_LENS."""
    rng = random.Random(0)
    torch.manual_seed(0)
    blocks = list(range(40))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in SEQ_LENS]
    cache = torch.randn(2, 2, 40, BLOCK_SIZE, head_dim, dtype=dtype)
    query = torch.randn(sum(QUERY_LENS), 4, head_dim, dtype=dtype)
    meta = build_attention_metadata(QUERY_LENS, SEQ_LENS, tables, BLOCK_SIZE, sliding_window, CPU)
    return query, cache, meta, tables


def without_kernel(monkeypatch, tables, sliding_window=None):
    """The metadata a machine without the kernel builds: the padded mask, eagerly."""
    with monkeypatch.context() as patch:
        patch.setattr(attention, "paged_attention_cpu_available", lambda: False)
        meta = build_attention_metadata(QUERY_LENS, SEQ_LENS, tables, BLOCK_SIZE, sliding_window,
                                        CPU)
    assert meta.kernel is None and meta.attn_mask is not None and not meta.mask_pending
    return meta


@needs_kernel
def test_float32_takes_the_kernel_and_builds_no_mask(monkeypatch):
    query, cache, meta, tables = step(torch.float32)
    assert meta.kernel is not None and meta.attn_mask is None and meta.mask_pending
    out = paged_attention(query, cache, meta, 0.25)
    assert meta.attn_mask is None  # the kernel ran: the mask was never needed
    reference = torch_paged_attention(query, cache, without_kernel(monkeypatch, tables), 0.25)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype, head_dim", [(torch.float64, 16), (torch.float32, 12)])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_what_the_kernel_cannot_take_goes_to_torch_with_the_same_mask(monkeypatch, dtype, head_dim,
                                                                       sliding_window):
    query, cache, meta, tables = step(dtype, head_dim, sliding_window)
    out = paged_attention(query, cache, meta, 0.25)  # builds the mask on first use
    assert meta.attn_mask is not None and not meta.mask_pending
    eager = without_kernel(monkeypatch, tables, sliding_window)
    assert torch.equal(meta.attn_mask, eager.attn_mask)
    assert torch.equal(out, paged_attention(query, cache, eager, 0.25))


def test_without_the_kernel_everything_is_built_up_front(monkeypatch):
    query, cache, _, tables = step(torch.float32)
    meta = without_kernel(monkeypatch, tables)
    out = paged_attention(query, cache, meta, 0.25)
    assert out.shape == (sum(QUERY_LENS), 4 * 16)


def test_slot_mapping_and_padding_follow_the_block_tables():
    _, _, meta, tables = step(torch.float32)
    slots = []
    for query_len, seq_len, table in zip(QUERY_LENS, SEQ_LENS, tables):
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                  for p in range(seq_len - query_len, seq_len)]
    assert meta.slot_mapping.tolist() == slots
    max_q = max(QUERY_LENS)
    assert meta.query_pad_index.tolist() == [i * max_q + r for i, q in enumerate(QUERY_LENS)
                                             for r in range(q)]
