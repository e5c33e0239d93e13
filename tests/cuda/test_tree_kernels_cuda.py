"""The tree kernels compiled for the GPU, not interpreted: the Triton tree rejection sampler agrees
token for token and path for path with its torch reference on the same uniforms, and the Triton
paged attention's tree rows agree with a float64 reference written from the parents alone."""

from __future__ import annotations

import random

import pytest
import torch

from engine.models.attention import build_attention_metadata
from kernels.tree_rejection import random_tree_inputs
from kernels.tree_rejection import tree_rejection_sample_reference as reference

CUDA = torch.device("cuda")
BLOCK_SIZE = 16
#   row 0 ─┬─ 1 ─┬─ 2 ── 3 ── 10
#          │     └─ 6 ── 7
#          ├─ 4 ── 5
#          └─ 8 ── 9
TREE = [-1, 0, 1, 2, 0, 4, 1, 6, 0, 8, 3]
WIDE_TREE = [-1, 0, 0] + list(range(2, 63))  # 64 rows: bit 63 of the last row's mask is set


@pytest.fixture(scope="module")
def compiled(gpu_kernels):
    return gpu_kernels.tree_rejection_triton, gpu_kernels.paged_attention_triton


@pytest.mark.parametrize("vocab_size", [16, 300, 49152])
@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
@pytest.mark.parametrize("is_chain", [False, True], ids=["tree", "chain"])
def test_tree_sampler_matches_the_reference_on_cuda(compiled, vocab_size, has_draft_probs,
                                                    is_chain):
    sampler, _ = compiled
    num_emitted = []
    for seed in range(4):
        args = random_tree_inputs([3, 0, 7, 1, 5, 10, 0, 4], vocab_size,
                                  has_draft_probs=has_draft_probs, greedy_fraction=0.4,
                                  seed=seed, is_chain=is_chain, device=CUDA)
        want = reference(**args)
        got = sampler.tree_rejection_sample(**args)
        assert got[0].is_cuda
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        num_emitted += (want[0] >= 0).sum(1).tolist()
    assert 1 in num_emitted and max(num_emitted) > 2


def visible_keys(query_len, seq_len, parents, row, sliding_window):
    """The key positions (slots in order) a row attends to, from the definition."""
    start = seq_len - query_len
    if parents is None:
        position = start + row
        return [k for k in range(position + 1)
                if sliding_window is None or k > position - sliding_window]
    path = []
    while row >= 0:
        path.append(row)
        row = parents[row]
    position = start + len(path) - 1
    keys = list(range(start)) + [start + node for node in path]
    at = list(range(start)) + [position - i for i in range(len(path))]
    return [k for k, p in zip(keys, at) if sliding_window is None or p > position - sliding_window]


def float64_reference(query, cache, query_lens, seq_lens, tables, tree_parents, sliding_window):
    query, cache = query.double().cpu(), cache.double().cpu()
    heads, head_dim = query.shape[1:]
    group = heads // cache.shape[1]
    keys = cache[0].flatten(1, 2).repeat_interleave(group, 0)
    values = cache[1].flatten(1, 2).repeat_interleave(group, 0)
    rows, token = [], 0
    for query_len, seq_len, table, parents in zip(query_lens, seq_lens, tables, tree_parents):
        for row in range(query_len):
            slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in
                                  visible_keys(query_len, seq_len, parents, row, sliding_window)])
            probs = (torch.einsum("hd,hkd->hk", query[token], keys[:, slots])
                     * head_dim**-0.5).softmax(-1)
            rows.append(torch.einsum("hk,hkd->hd", probs, values[:, slots]).reshape(-1))
            token += 1
    return torch.stack(rows)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("sliding_window", [None, 5, 100])
def test_tree_attention_matches_the_definition_on_cuda(compiled, dtype, atol, sliding_window):
    _, attention = compiled
    # a decode, a 64-row tree, an 11-row tree, a prefill chunk and a chain verification
    query_lens = [1, len(WIDE_TREE), len(TREE), 40, 5]
    seq_lens = [300, 170, len(TREE) + 29, 90, 1000]
    tree_parents = [None, WIDE_TREE, TREE, None, None]
    rng = random.Random(0)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    gen = torch.Generator(CUDA).manual_seed(0)
    cache = torch.randn(2, 2, num_blocks, BLOCK_SIZE, 64, generator=gen, device=CUDA).to(dtype)
    query = torch.randn(sum(query_lens), 6, 64, generator=gen, device=CUDA).to(dtype)
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, sliding_window, CUDA,
                                    "triton", tree_parents)
    assert meta.tree_mask is not None
    kernel = meta.kernel
    out = attention.paged_attention_triton(query, cache, kernel.block_tables, kernel.seq_lens,
                                           kernel.cu_num_query_tokens, meta.max_query_len,
                                           64**-0.5, sliding_window, tree_mask=meta.tree_mask)
    want = float64_reference(query, cache, query_lens, seq_lens, tables, tree_parents,
                             sliding_window)
    torch.testing.assert_close(out.double().cpu(), want, rtol=0, atol=atol)
