"""Tree rows in paged attention (engine/models/attention.py's tree_mask): the C++ kernel, the torch
reference and the Triton kernel (under TRITON_INTERPRET=1) against a float64 reference written from
the parents alone, with sliding windows shorter than the tree, a 64-row tree, and trees beside
decode, verification and prefill rows; the C++ kernel keeps a tree's first branch bit for bit the
causal rows it equals."""

from __future__ import annotations

import importlib
import os
import random

import pytest
import torch

import engine.models.attention as attention
from engine.models.attention import build_attention_metadata, paged_attention, torch_paged_attention
from kernels.paged_attention_cpu import paged_attention_cpu_available

# NOTE: triton reads this when kernels are decorated, so it is set before the kernel module loads
os.environ["TRITON_INTERPRET"] = "1"
interpreter = pytest.importorskip("triton.runtime.interpreter")
from kernels import paged_attention_triton  # noqa: E402

if not isinstance(paged_attention_triton._paged_attention_kernel, interpreter.InterpretedFunction):
    paged_attention_triton = importlib.reload(paged_attention_triton)

needs_kernel = pytest.mark.skipif(not paged_attention_cpu_available(),
                                  reason="no C++ compiler, or SPECSERVE_CPU_KERNELS=0")
CPU = torch.device("cpu")
BLOCK_SIZE = 4

#   row 0 ─┬─ 1 ─┬─ 2 ── 3 ── 10
#          │     └─ 6 ── 7
#          ├─ 4 ── 5
#          └─ 8 ── 9
TREE = [-1, 0, 1, 2, 0, 4, 1, 6, 0, 8, 3]
# 64 rows: two short branches, then a long one whose last row's mask has bit 63 set (negative)
WIDE_TREE = [-1, 0, 0] + list(range(2, 63))
# a decode, the tree, a prefill chunk and a chain verification
STEP = ([1, len(TREE), 9, 4], [10, 21, 9, 30], [None, TREE, None, None])


def make_step(query_lens, seq_lens, *, heads=6, kv_heads=2, head_dim=16, seed=0):
    """Shuffled (non-consecutive) block tables, a random cache and queries."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    cache = torch.randn(2, kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=gen)
    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    return query, cache, tables


def visible_positions(query_len, seq_len, parents, row, sliding_window):
    """The key positions row `row` attends to, from the definition: a causal row sees positions
    up to its own; a tree row at depth d (position start + d) sees the context and its path."""
    start = seq_len - query_len
    if parents is None:
        position, keys = start + row, list(range(start + row + 1))
    else:
        path = []
        while row >= 0:
            path.append(row)
            row = parents[row]
        depth = len(path) - 1
        position = start + depth
        # path[i] sits i levels above the row, at position `position - i`
        keys = list(range(start)) + [start + node for node in path]
        key_positions = list(range(start)) + [position - i for i in range(len(path))]
        return [key for key, at in zip(keys, key_positions)
                if sliding_window is None or at > position - sliding_window]
    return [key for key in keys if sliding_window is None or key > position - sliding_window]


def expected(query, cache, query_lens, seq_lens, tables, tree_parents, sliding_window):
    """[num_tokens, heads * head_dim] float64, one row at a time."""
    num_heads, head_dim = query.shape[1:]
    group = num_heads // cache.shape[1]
    keys = cache[0].flatten(1, 2).double().repeat_interleave(group, 0)  # [H, slots, D]
    values = cache[1].flatten(1, 2).double().repeat_interleave(group, 0)
    rows, token = [], 0
    for query_len, seq_len, table, parents in zip(query_lens, seq_lens, tables, tree_parents):
        for row in range(query_len):
            slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in
                                  visible_positions(query_len, seq_len, parents, row,
                                                    sliding_window)])
            scores = torch.einsum("hd,hkd->hk", query[token].double(), keys[:, slots])
            probs = (scores * head_dim**-0.5).softmax(-1)
            rows.append(torch.einsum("hk,hkd->hd", probs, values[:, slots]).reshape(-1))
            token += 1
    return torch.stack(rows)


def metadata(query_lens, seq_lens, tables, tree_parents, sliding_window, *, kernel=True,
             monkeypatch=None, backend="auto"):
    if kernel:
        return build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, sliding_window,
                                        CPU, backend, tree_parents)
    with monkeypatch.context() as patch:  # a machine without the kernel: the mask up front
        patch.setattr(attention, "paged_attention_cpu_available", lambda: False)
        return build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, sliding_window,
                                        CPU, backend, tree_parents)


def run_triton(query, cache, meta, sliding_window, tree_mask):
    kernel = meta.kernel
    return paged_attention_triton.paged_attention_triton(
        query, cache, kernel.block_tables, kernel.seq_lens, kernel.cu_num_query_tokens,
        meta.max_query_len, query.shape[-1] ** -0.5, sliding_window, tree_mask=tree_mask)


def all_paths(query, cache, query_lens, seq_lens, tables, tree_parents, sliding_window,
              monkeypatch):
    """Each path's output, by name."""
    scale = query.shape[-1] ** -0.5
    meta = metadata(query_lens, seq_lens, tables, tree_parents, sliding_window)
    outs = {
        "torch": torch_paged_attention(query, cache, metadata(
            query_lens, seq_lens, tables, tree_parents, sliding_window, kernel=False,
            monkeypatch=monkeypatch), scale),
        "triton": run_triton(query, cache, metadata(
            query_lens, seq_lens, tables, tree_parents, sliding_window, backend="triton"),
            sliding_window, meta.tree_mask),
    }
    if paged_attention_cpu_available():
        assert meta.attn_mask is None  # the kernel needs no mask
        outs["kernel"] = paged_attention(query, cache, meta, scale)
    return outs


@pytest.mark.parametrize("heads, kv_heads, sliding_window", [
    (6, 2, None), (6, 2, 2), (6, 2, 3), (4, 4, 6), (8, 1, 100)])
def test_every_path_matches_the_definition(heads, kv_heads, sliding_window, monkeypatch):
    query_lens, seq_lens, tree_parents = STEP
    query, cache, tables = make_step(query_lens, seq_lens, heads=heads, kv_heads=kv_heads)
    reference = expected(query, cache, query_lens, seq_lens, tables, tree_parents, sliding_window)
    outs = all_paths(query, cache, query_lens, seq_lens, tables, tree_parents, sliding_window,
                     monkeypatch)
    for name, out in outs.items():
        torch.testing.assert_close(out.double(), reference, rtol=0, atol=2e-6, msg=name)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_a_64_row_tree_and_two_trees_in_one_step(sliding_window, monkeypatch):
    query_lens, seq_lens = [len(WIDE_TREE), 1, len(TREE)], [70, 3, len(TREE)]
    tree_parents = [WIDE_TREE, None, TREE]  # the last tree starts at position 0
    query, cache, tables = make_step(query_lens, seq_lens)
    reference = expected(query, cache, query_lens, seq_lens, tables, tree_parents, sliding_window)
    meta = metadata(query_lens, seq_lens, tables, tree_parents, sliding_window)
    assert meta.tree_mask[len(WIDE_TREE) - 1] < -1  # bit 63: a negative mask, not "causal"
    outs = all_paths(query, cache, query_lens, seq_lens, tables, tree_parents, sliding_window,
                     monkeypatch)
    for name, out in outs.items():
        torch.testing.assert_close(out.double(), reference, rtol=0, atol=2e-6, msg=name)


@pytest.mark.parametrize("table, start", [([7, 8, 9, 10, 11], 6), ([3, 4, 5], 0)])
def test_the_torch_paths_fast_paths_keep_the_tree(table, start):
    """A lone tree sequence on consecutive blocks (read in place), and one from position 0 (which
    would otherwise take SDPA's causal path): the mask still applies."""
    seq_len = start + len(TREE)
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(len(TREE), 6, 16, generator=gen, dtype=torch.float64)
    cache = torch.randn(2, 2, 12, BLOCK_SIZE, 16, generator=gen, dtype=torch.float64)
    reference = expected(query, cache, [len(TREE)], [seq_len], [table], [TREE], None)
    meta = build_attention_metadata([len(TREE)], [seq_len], [table], BLOCK_SIZE, None, CPU,
                                    tree_parents=[TREE])
    assert meta.first_block == table[0] and not meta.is_causal
    out = paged_attention(query, cache, meta, 16**-0.5)  # float64: the torch path
    assert meta.attn_mask is not None
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)


@needs_kernel
@pytest.mark.parametrize("sliding_window", [None, 3, 100])
def test_the_kernel_keeps_a_first_branch_bit_for_bit(sliding_window):
    """A chain given as a tree, and a tree's first branch (rows 0 1 2 3 of TREE), come out of the
    C++ kernel with exactly the bits of the causal rows they equal."""
    query_lens, seq_lens, tree_parents = STEP
    query, cache, tables = make_step(query_lens, seq_lens)
    scale = query.shape[-1] ** -0.5
    causal = paged_attention(query, cache, metadata(query_lens, seq_lens, tables, [None] * 4,
                                                    sliding_window), scale)
    chain = [None, list(range(-1, len(TREE) - 1)), None, None]
    as_tree = paged_attention(query, cache, metadata(query_lens, seq_lens, tables, chain,
                                                     sliding_window), scale)
    assert torch.equal(as_tree, causal)
    tree = paged_attention(query, cache, metadata(query_lens, seq_lens, tables, tree_parents,
                                                  sliding_window), scale)
    first_branch = [1 + row for row in (0, 1, 2, 3)]
    others = [0] + list(range(1 + len(TREE), sum(query_lens)))
    assert torch.equal(tree[first_branch], causal[first_branch])
    assert torch.equal(tree[others], causal[others])


def test_triton_keeps_a_chain_given_as_a_tree_bit_for_bit():
    query_lens, seq_lens, _ = STEP
    query, cache, tables = make_step(query_lens, seq_lens)
    chain = [None, list(range(-1, len(TREE) - 1)), None, None]
    meta = metadata(query_lens, seq_lens, tables, chain, None, backend="triton")
    causal = run_triton(query, cache, meta, None, None)
    assert torch.equal(run_triton(query, cache, meta, None, meta.tree_mask), causal)


def test_ordinary_steps_carry_no_tree():
    query_lens, seq_lens, _ = STEP
    _, _, tables = make_step(query_lens, seq_lens)
    assert metadata(query_lens, seq_lens, tables, None, None).tree_mask is None
    assert metadata(query_lens, seq_lens, tables, [None] * 4, None).tree_mask is None


@pytest.mark.parametrize("parents, match", [
    (list(range(-1, 64)), "at most 64 rows"),    # 65 rows
    ([-1, 0, 2, 1], "earlier row"),              # a parent after its child
    ([-1, -1, 0], "earlier row"),                # a second root
    ([0, 0, 1], "earlier row"),                  # row 0 with a parent
    ([-1, 0], "one parent per row"),             # fewer parents than rows
])
def test_malformed_trees_are_refused(parents, match):
    num_rows = len(parents) if match != "one parent per row" else 3
    with pytest.raises(ValueError, match=match):
        build_attention_metadata([num_rows], [num_rows + 4], [list(range(20))], BLOCK_SIZE, None,
                                 CPU, tree_parents=[parents])
