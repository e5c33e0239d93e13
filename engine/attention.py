"""Paged attention on the torch path: K/V live in fixed-size blocks; a step attends over a flattened batch.

Every sequence in a step contributes `num_query_tokens` rows (a prefill chunk, one decode token, or 1 + k
verification rows) that attend causally to all of its cached context. The metadata below is built once per
step and shared by every layer, so a layer costs the same few torch calls whatever the batch holds.

KV cache layout, one tensor per layer (a token's slot = block_id * block_size + offset):

    kv_cache[0] = keys   [num_kv_heads, num_blocks, block_size, head_dim]
    kv_cache[1] = values [num_kv_heads, num_blocks, block_size, head_dim]

Reading a context gathers whole blocks (one index per block_size tokens, several times faster on the
CPU than token by token), and head-major storage leaves each (sequence, head) context contiguous, which
SDPA reads about 4x faster than a token-major gather. A lone sequence whose blocks are consecutive (the
usual case for a single stream: the pool hands out blocks in order) is read in place, as a view,
without the gather's copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    num_seqs: int
    # the longest number of query rows of any sequence in the step
    max_query_len: int
    # keys each query row sees after the gather: the longest context, rounded up to whole blocks when
    # several sequences share the padded layout
    kv_len: int
    # [num_tokens] int64: where each new token's K/V is written in the flat slot space
    slot_mapping: torch.Tensor
    # [num_seqs, max_num_blocks] int64: each sequence's block table, padded with block 0
    block_gather_index: torch.Tensor
    # [num_tokens] int64: row of each flattened query in the padded [num_seqs * max_query_len] layout;
    # None when the flattened batch is already that layout (all sequences have max_query_len rows)
    query_pad_index: torch.Tensor | None
    # [num_seqs, 1, max_query_len, kv_len] bool, True = may attend; None = see is_causal
    attn_mask: torch.Tensor | None
    # a lone sequence whose block table is first_block, first_block + 1, ...: its first block, so
    # attention reads its context in place instead of gathering it; None otherwise
    first_block: int | None = None
    # with no mask: True = plain causal attention (a lone sequence prefilled from position 0, where
    # SDPA's built-in causal path is several times faster than an explicit mask), False = attend to all
    is_causal: bool = False


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> AttentionMetadata:
    """Lay out one step's sequences for `paged_attention`.

    Sequence i has `seq_lens[i]` tokens of context after this step, the last `query_lens[i]` of which are
    this step's query rows, at positions seq_lens[i] - query_lens[i] ... seq_lens[i] - 1.
    """
    num_seqs = len(query_lens)
    max_query_len = max(query_lens)
    max_seq_len = max(seq_lens)
    max_num_blocks = -(-max_seq_len // block_size)
    # a lone sequence slices its gathered blocks to its exact length; a batch pads to whole blocks
    kv_len = max_seq_len if num_seqs == 1 else max_num_blocks * block_size
    # ---- block tables, padded; the slot of every new token ----
    gather = torch.zeros(num_seqs, max_num_blocks, dtype=torch.int64)
    slot_chunks = []
    for i, (seq_len, query_len, table) in enumerate(zip(seq_lens, query_lens, block_tables)):
        num_blocks = -(-seq_len // block_size)
        gather[i, :num_blocks] = torch.tensor(table[:num_blocks], dtype=torch.int64)
        positions = torch.arange(seq_len - query_len, seq_len, dtype=torch.int64)
        slot_chunks.append(gather[i, positions // block_size] * block_size + positions % block_size)
    slot_mapping = torch.cat(slot_chunks)
    # ---- where the flattened query rows sit in the padded layout ----
    query_pad_index = None
    if any(q != max_query_len for q in query_lens):
        query_pad_index = torch.cat([
            torch.arange(q, dtype=torch.int64) + i * max_query_len for i, q in enumerate(query_lens)
        ])
    # ---- causal mask over each sequence's context ----
    attn_mask = None
    is_causal = num_seqs == 1 and max_query_len == max_seq_len > 1 and (
        sliding_window is None or max_seq_len <= sliding_window)
    needs_mask = (max_query_len > 1 or num_seqs > 1) and not is_causal
    if needs_mask or (sliding_window is not None and max_seq_len > sliding_window):
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)[:, None, None]  # [B, 1, 1]
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)[:, None, None]
        row = torch.arange(max_query_len, dtype=torch.int64)[None, :, None]  # [1, Q, 1]
        key_pos = torch.arange(kv_len, dtype=torch.int64)[None, None, :]  # [1, 1, L]
        query_pos = seq_lens_t - query_lens_t + row  # [B, Q, 1]
        attn_mask = key_pos <= query_pos
        if sliding_window is not None:
            attn_mask &= key_pos > query_pos - sliding_window
        # NOTE: padded query rows (row >= query_len) attend to key 0 only, so softmax never sees an empty
        # row (NaN); their outputs are dropped by the un-padding.
        attn_mask |= (row >= query_lens_t) & (key_pos == 0)
        attn_mask = attn_mask[:, None]  # [B, 1, Q, L]
    first_block = None
    if num_seqs == 1:
        table = block_tables[0][:max_num_blocks]
        if table == list(range(table[0], table[0] + len(table))):
            first_block = table[0]
    return AttentionMetadata(
        first_block=first_block,
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        kv_len=kv_len,
        slot_mapping=slot_mapping.to(device),
        block_gather_index=gather.to(device),
        query_pad_index=None if query_pad_index is None else query_pad_index.to(device),
        attn_mask=None if attn_mask is None else attn_mask.to(device),
        is_causal=is_causal,
    )


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store this step's keys and values; rejected draft slots are simply overwritten by a later step."""
    num_kv_heads, head_dim = key.shape[1:]  # key, value: [num_tokens, num_kv_heads, head_dim]
    kv_cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, key.transpose(0, 1))
    kv_cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping,
                                                             value.transpose(0, 1))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention of each query row over its sequence's cached context.

    query: [num_tokens, num_heads, head_dim]
    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]
    returns [num_tokens, num_heads * head_dim]
    """
    num_tokens, num_heads, head_dim = query.shape
    batch, max_q = meta.num_seqs, meta.max_query_len
    num_kv_heads = kv_cache.shape[1]
    if meta.first_block is not None:  # consecutive blocks: a view of the cache, no copy
        num_blocks = meta.block_gather_index.shape[1]
        blocks = slice(meta.first_block, meta.first_block + num_blocks)
        keys = kv_cache[0][:, blocks].view(num_kv_heads, 1, -1, head_dim)
        values = kv_cache[1][:, blocks].view(num_kv_heads, 1, -1, head_dim)
    else:
        blocks = meta.block_gather_index.view(-1)  # [B * max_num_blocks]
        keys = kv_cache[0].index_select(1, blocks).view(num_kv_heads, batch, -1, head_dim)
        values = kv_cache[1].index_select(1, blocks).view(num_kv_heads, batch, -1, head_dim)
    keys = keys[:, :, :meta.kv_len].transpose(0, 1)  # [B, kvH, L, D]
    values = values[:, :, :meta.kv_len].transpose(0, 1)  # [B, kvH, L, D]
    if meta.query_pad_index is None:
        padded = query.view(batch, max_q, num_heads, head_dim)
    else:
        padded = query.new_zeros(batch * max_q, num_heads, head_dim)
        padded.index_copy_(0, meta.query_pad_index, query)
        padded = padded.view(batch, max_q, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),  # [B, H, Q, D]
        keys,
        values,
        attn_mask=meta.attn_mask,
        is_causal=meta.is_causal,
        scale=scale,
        enable_gqa=True,
    )  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(batch * max_q, num_heads * head_dim)
    if meta.query_pad_index is not None:
        out = out.index_select(0, meta.query_pad_index)
    return out  # [num_tokens, H * D]
