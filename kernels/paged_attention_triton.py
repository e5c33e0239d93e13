"""Paged attention in Triton: every row of a step (prefill chunks, decode tokens, 1 + k verification rows)
attends to its sequence's K/V read from the cache blocks in place.

The torch path in `engine/models/attention.py` (`torch_paged_attention`) is the reference: it gathers every
sequence's blocks into a padded copy, in every layer, which on a GPU costs a copy of the whole context
and a launch per op. This kernel reads each key and value once, where it lives, with an online softmax.

One program owns one sequence, one KV head and a tile of BLOCK_M (query row, head of the group) pairs:
the query heads that share a KV head (GQA) are packed into the tile's rows, so a decode row of a
model with 3 query heads per KV head fills 3 of the tile's rows and reads its keys once for all three.

    tile row m -> query row m // QUERIES_PER_KV, head kv_head * QUERIES_PER_KV + m % QUERIES_PER_KV

A tree verification (engine/models/attention.py) passes `tree_mask`, one int64 per row: -1 for a causal
row, else the row's ancestor bits; a tree row sees the context before its sequence's row 0 and
the rows whose bits it holds.

Its launch shape depends only on (number of sequences, largest query rows), both given by the caller,
and padding sequences (no query rows) return at once: a caller that pads a step to a fixed bucket (a
CUDA graph) launches the same grid every time, and no host value is read from the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# keys per iteration of the online softmax
BLOCK_N = 32


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], query's dtype
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache_ptr,  # same layout and strides as key_cache
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32: tokens of context after this step
    cu_num_query_tokens_ptr,  # [num_seqs + 1] int32
    tree_mask_ptr,  # [num_tokens] int64: ancestor bits, -1 = causal row (only read when HAS_TREE)
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    block_size,
    sliding_window,  # keys a row sees, itself included (only read when HAS_SLIDING_WINDOW)
    stride_query_token, stride_query_head,
    stride_out_token, stride_out_head,
    stride_cache_head, stride_cache_block, stride_cache_slot,
    stride_block_table,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SLIDING_WINDOW: tl.constexpr,
    HAS_TREE: tl.constexpr,
    # float32 products in full precision (a GPU's dot otherwise rounds float32 inputs to tf32)
    IEEE_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    query_start = tl.load(cu_num_query_tokens_ptr + seq)
    query_len = tl.load(cu_num_query_tokens_ptr + seq + 1) - query_start
    first_packed = tile * BLOCK_M
    if first_packed >= query_len * QUERIES_PER_KV:  # a padding sequence, or past its rows
        return
    packed = first_packed + tl.arange(0, BLOCK_M)
    row = packed // QUERIES_PER_KV  # [BLOCK_M]
    head = kv_head * QUERIES_PER_KV + packed % QUERIES_PER_KV
    row_valid = row < query_len
    dim = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dim < HEAD_DIM
    query_offsets = ((query_start + row).to(tl.int64) * stride_query_token
                     + head * stride_query_head)  # [BLOCK_M]
    row_mask = row_valid[:, None] & dim_valid[None, :]
    query = tl.load(query_ptr + query_offsets[:, None] + dim[None, :], mask=row_mask, other=0.0)

    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - query_len  # the position of query row 0
    query_pos = context_start + row  # [BLOCK_M]
    # the keys this tile's rows see: up to its last row's position, from its first row's window
    last_row = tl.minimum(query_len - 1, (first_packed + BLOCK_M - 1) // QUERIES_PER_KV)
    key_end = context_start + last_row + 1
    first_pos = context_start + first_packed // QUERIES_PER_KV
    if HAS_TREE:
        tree = tl.load(tree_mask_ptr + query_start + row, mask=row_valid, other=-1)  # [BLOCK_M]
        is_tree_row = tree != -1
        # a tree row's window ends at start + its depth, at most its row
        first_pos = tl.where(tl.load(tree_mask_ptr + query_start) != -1, context_start, first_pos)
        # NOTE: the context a tree row sees starts at start + popcount - window: its mask holds
        # min(depth + 1, window) bits (engine/models/attention.py, tree_ancestor_masks)
        context_begin = tl.zeros([BLOCK_M], dtype=tl.int32)
        if HAS_SLIDING_WINDOW:
            bits = (tree[:, None] >> tl.arange(0, 64)[None, :].to(tl.int64)) & 1  # [BLOCK_M, 64]
            context_begin = context_start + tl.sum(bits, 1).to(tl.int32) - sliding_window
    key_start = 0
    if HAS_SLIDING_WINDOW:
        # NOTE: from a multiple of BLOCK_N: every tile then groups a row's keys into the same
        # chunks, so a row's sums do not depend on which tile (decode or verification) holds it
        key_start = tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    cache_head = key_cache_ptr + kv_head.to(tl.int64) * stride_cache_head
    value_head = value_cache_ptr + kv_head.to(tl.int64) * stride_cache_head
    table = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for first_key in range(key_start, key_end, BLOCK_N):
        key_pos = first_key + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_valid = key_pos < key_end
        block = tl.load(table + key_pos // block_size, mask=key_valid, other=0)
        slot_offsets = (block.to(tl.int64) * stride_cache_block
                        + (key_pos % block_size) * stride_cache_slot)  # [BLOCK_N]
        key_mask = key_valid[None, :] & dim_valid[:, None]
        keys_t = tl.load(cache_head + slot_offsets[None, :] + dim[:, None], mask=key_mask,
                         other=0.0)  # [HEAD_DIM_PADDED, BLOCK_N]
        if IEEE_DOT:
            scores = tl.dot(query, keys_t, input_precision="ieee")
        else:
            scores = tl.dot(query, keys_t)
        scores = scores * scale_log2  # [BLOCK_M, BLOCK_N], base 2
        visible = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
        if HAS_SLIDING_WINDOW:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        if HAS_TREE:
            tree_row = tl.minimum(tl.maximum(key_pos - context_start, 0), 63)  # [BLOCK_N]
            on_path = ((tree[:, None] >> tree_row[None, :].to(tl.int64)) & 1) != 0
            tree_visible = tl.where(key_pos[None, :] < context_start,
                                    key_pos[None, :] >= context_begin[:, None], on_path)
            visible = tl.where(is_tree_row[:, None], tree_visible & key_valid[None, :], visible)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # NOTE: a row that has seen no visible key yet keeps max -inf; shift by 0 there, not by -inf
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.exp2(scores - shift[:, None])  # [BLOCK_M, BLOCK_N]
        correction = tl.exp2(running_max - shift)
        running_sum = running_sum * correction + tl.sum(weights, 1)
        values = tl.load(value_head + slot_offsets[:, None] + dim[None, :],
                         mask=key_valid[:, None] & dim_valid[None, :],
                         other=0.0)  # [BLOCK_N, HEAD_DIM_PADDED]
        if IEEE_DOT:
            update = tl.dot(weights.to(values.dtype), values, input_precision="ieee")
        else:
            update = tl.dot(weights.to(values.dtype), values)
        acc = acc * correction[:, None] + update
        running_max = new_max
    # every valid row sees at least its own key, so its sum is > 0; rows past the sequence are not stored
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    out_offsets = (query_start + row).to(tl.int64) * stride_out_token + head * stride_out_head
    tl.store(out_ptr + out_offsets[:, None] + dim[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask)


# BLOCK_M at most, and always with batch_invariant
MAX_TILE_ROWS = 64


def tile_rows(max_query_len: int, queries_per_kv: int, batch_invariant: bool = False) -> int:
    """BLOCK_M: the fewest (row, head) pairs per program that hold a decode row's group, up to 64
    for prefill chunks (tl.dot needs at least 16). Batch-invariant: 64 for every step, since the
    tile's shape decides how the GPU lays out and reduces each row's scores."""
    if batch_invariant:
        return MAX_TILE_ROWS
    return min(MAX_TILE_ROWS, max(16, triton.next_power_of_2(max_query_len * queries_per_kv)))


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    cu_num_query_tokens: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,  # at least the largest query rows of any sequence (a bucket's bound is fine)
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads * head_dim]; rows of no sequence untouched
    tree_mask: torch.Tensor | None = None,  # [num_tokens] int64: ancestor bits, -1 = causal row
    batch_invariant: bool = False,  # one tile shape for every step: a row's bits never depend on
                                    # the step's other rows (decode and verification agree)
) -> torch.Tensor:
    """The attention of each query row over its sequence's context; returns [num_tokens, H * D]."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query and kv_cache need a contiguous last (head) dimension")
    if tree_mask is not None and (tree_mask.dtype != torch.int64 or tree_mask.shape != (num_tokens,)
                                  or not tree_mask.is_contiguous()):
        raise ValueError("tree_mask must be a contiguous [num_tokens] int64 tensor")
    queries_per_kv = num_heads // num_kv_heads
    if out is None:
        out = query.new_empty(num_tokens, num_heads * head_dim)
    out_3d = out.view(num_tokens, num_heads, head_dim)
    keys, values = kv_cache[0], kv_cache[1]
    block_m = tile_rows(max_query_len, queries_per_kv, batch_invariant)
    num_seqs = len(seq_lens)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len * queries_per_kv, block_m))
    if num_seqs and max_query_len:
        _paged_attention_kernel[grid](
            out_3d, query, keys, values, block_tables, seq_lens, cu_num_query_tokens,
            cu_num_query_tokens if tree_mask is None else tree_mask,  # never read without a tree
            scale * 1.4426950408889634,  # log2(e)
            keys.shape[2], sliding_window or 0,
            query.stride(0), query.stride(1),
            out_3d.stride(0), out_3d.stride(1),
            keys.stride(0), keys.stride(1), keys.stride(2),
            block_tables.stride(0),
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)),
            QUERIES_PER_KV=queries_per_kv,
            BLOCK_M=block_m,
            BLOCK_N=BLOCK_N,
            HAS_SLIDING_WINDOW=sliding_window is not None,
            HAS_TREE=tree_mask is not None,
            IEEE_DOT=query.dtype == torch.float32,
        )
    return out
