"""Paged attention: K/V live in fixed-size blocks; a step attends over a flattened batch.

Every sequence in a step contributes `query_len` rows (a prefill chunk, one decode token, or 1 + k
verification rows) that attend causally to all of its cached context. The metadata below is built once per
step and shared by every layer, so a layer costs the same few calls whatever the batch holds.

A tree verification (engine/draft_tree.py) is a sequence whose rows are a tree, not a chain: row r
sees all the context before the sequence's first row plus exactly the rows on its own root-to-r
path. The step then carries `tree_mask`, one int64 per row (bit j set = the row sees row j of its
sequence; -1 = an ordinary causal row), and every path below honours it.

KV cache layout, one tensor per layer (a token's slot = block_id * block_size + offset):

    kv_cache[0] = keys   [num_kv_heads, num_blocks, block_size, head_dim]
    kv_cache[1] = values [num_kv_heads, num_blocks, block_size, head_dim]

Three paths read it:
- with `backend="triton"` (CUDA, or the CPU under TRITON_INTERPRET=1 in tests), the Triton kernel
  (`kernels/paged_attention_triton.py`) reads every sequence's blocks in place, prefill chunks,
  decode and verification rows alike, and launches a grid fixed by (sequences, longest query rows);
- on the CPU, the C++ kernel (`kernels/paged_attention_cpu.py`) reads every sequence's blocks in
  place, with no copy and no mask, and gives each row the same bits whatever else is in the batch.
  It takes every row, prefill chunks included: on a prompt it runs within ~0.9-1.3x of SDPA's flash
  causal path, and one path keeps a row's bits independent of how the prompt was chunked;
- the torch path (the reference; CUDA, a dtype the kernel does not take, or no C++ compiler) gathers
  whole blocks into a padded [B, kvH, L, D] copy (head-major, which SDPA reads ~4x faster than a
  token-major gather) and masks it. A lone sequence whose blocks are consecutive (the usual single
  stream) is read in place there too, as a view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.draft_tree import MAX_TREE_ROWS
from kernels.paged_attention_cpu import (
    paged_attention_cpu,
    paged_attention_cpu_available,
    paged_attention_cpu_supports,
)

# what reads the cache: "auto" = the C++ kernel on the CPU when it builds, else the torch path;
# "triton" = the Triton kernel
ATTENTION_BACKENDS = ("auto", "triton")


@dataclass
class KernelInputs:
    """The step as the in-place kernels read it (int32, on the step's device)."""

    # [num_seqs, max_num_blocks] int32: each sequence's block table, padded with block 0
    block_tables: torch.Tensor
    # [num_seqs] int32: tokens of context after this step
    seq_lens: torch.Tensor
    # [num_seqs + 1] int32: sequence i's query rows are [cu[i], cu[i + 1]) of the flattened batch
    cu_num_query_tokens: torch.Tensor
    sliding_window: int | None
    # True = the Triton kernel reads them, False = the CPU kernel
    triton: bool = False


@dataclass
class AttentionMetadata:
    """One step's layout, built once and shared by every layer: `kernel` for the CPU kernel, the
    padded-gather fields for the torch path."""

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
    # [num_seqs, 1, max_query_len, kv_len] bool, True = may attend; None = see is_causal and
    # mask_pending
    attn_mask: torch.Tensor | None
    # a lone sequence whose block table is first_block, first_block + 1, ...: its first block, so
    # attention reads its context in place instead of gathering it; None otherwise
    first_block: int | None = None
    # with no mask: True = plain causal attention (a lone sequence prefilled from position 0, where
    # SDPA's built-in causal path is several times faster than an explicit mask), False = attend to all
    is_causal: bool = False
    # the CPU kernel's inputs; None = the torch path only
    kernel: KernelInputs | None = None
    # True = the torch path needs attn_mask but it was not built, because the kernel was expected to
    # run (it needs none); the torch path builds it on first use, once per step
    mask_pending: bool = False
    # [num_tokens] int64 on the step's device: each tree row's ancestor bits (tree_ancestor_masks),
    # -1 for the rows of ordinary sequences; None = the step holds no tree (nothing changes then)
    tree_mask: torch.Tensor | None = None
    # the same step under the local window, for the sliding layers of a model that mixes sliding
    # and full layers (Gemma 3); None where every layer reads this one
    windowed: AttentionMetadata | None = None


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    backend: str = "auto",
    tree_parents: Sequence[Sequence[int] | None] | None = None,
    local_window: int | None = None,
) -> AttentionMetadata:
    """Lay out one step's sequences for `paged_attention` (backend: one of ATTENTION_BACKENDS).
    `local_window`: also lay it out under that window, as `windowed`, for a model's sliding
    layers (the window in a tree's masks and the CPU kernel's skipped blocks differ by layer).

    Sequence i has `seq_lens[i]` tokens of context after this step, the last `query_lens[i]` of which are
    this step's query rows, in the slots of positions seq_lens[i] - query_lens[i] ...
    seq_lens[i] - 1.
    `tree_parents[i]`, when given and not None, makes sequence i a tree: its rows' parent rows
    (-1 for row 0), at most MAX_TREE_ROWS of them; None (or no list) keeps it causal.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    tree_mask = None
    if tree_parents is not None and any(parents is not None for parents in tree_parents):
        tree_mask = step_tree_mask(query_lens, tree_parents, sliding_window)
    num_seqs = len(query_lens)
    max_query_len = max(query_lens)
    max_seq_len = max(seq_lens)
    max_num_blocks = -(-max_seq_len // block_size)
    # a lone sequence slices its gathered blocks to its exact length; a batch pads to whole blocks
    kv_len = max_seq_len if num_seqs == 1 else max_num_blocks * block_size
    # ---- block tables, padded; each new token's slot; the query rows' offsets ----
    tables, slots, cu_num_query_tokens = [], [], [0]
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        num_blocks = -(-seq_len // block_size)
        tables.append(table[:num_blocks] + [0] * (max_num_blocks - num_blocks))
        slots += [table[pos // block_size] * block_size + pos % block_size
                  for pos in range(seq_len - query_len, seq_len)]
        cu_num_query_tokens.append(cu_num_query_tokens[-1] + query_len)
    gather = torch.tensor(tables, dtype=torch.int64)  # [B, max_num_blocks]
    query_pad_index = None
    if any(q != max_query_len for q in query_lens):
        query_pad_index = torch.tensor([i * max_query_len + row for i, q in enumerate(query_lens)
                                        for row in range(q)], dtype=torch.int64)
    first_block = None
    if num_seqs == 1 and tables[0] == list(range(tables[0][0], tables[0][0] + max_num_blocks)):
        first_block = tables[0][0]
    # ---- the CPU kernel's view, or the causal mask over each padded context ----
    kernel = None
    if backend == "triton" or (device.type == "cpu" and paged_attention_cpu_available()):
        kernel = KernelInputs(
            block_tables=gather.to(device=device, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            cu_num_query_tokens=torch.tensor(cu_num_query_tokens, dtype=torch.int32, device=device),
            sliding_window=sliding_window,
            triton=backend == "triton")
    # NOTE: SDPA's causal path (and leaving the mask out) would ignore a tree's rows
    is_causal = tree_mask is None and num_seqs == 1 and max_query_len == max_seq_len > 1 and (
        sliding_window is None or max_seq_len <= sliding_window)
    needs_mask = tree_mask is not None or (
        (max_query_len > 1 or num_seqs > 1) and not is_causal) or (
        sliding_window is not None and max_seq_len > sliding_window)
    attn_mask = None
    if needs_mask and kernel is None:
        attn_mask = padded_causal_mask(torch.tensor(seq_lens), torch.tensor(query_lens),
                                       max_query_len, kv_len, sliding_window)
        if tree_mask is not None:
            apply_tree_mask(attn_mask, tree_mask, torch.tensor(seq_lens), torch.tensor(query_lens),
                            query_pad_index, sliding_window)
    windowed = None
    if local_window is not None:
        windowed = build_attention_metadata(query_lens, seq_lens, block_tables, block_size,
                                            local_window, device, backend, tree_parents)
    return AttentionMetadata(
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        kv_len=kv_len,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_gather_index=gather.to(device),
        query_pad_index=None if query_pad_index is None else query_pad_index.to(device),
        attn_mask=None if attn_mask is None else attn_mask.to(device),
        first_block=first_block,
        is_causal=is_causal,
        kernel=kernel,
        mask_pending=needs_mask and kernel is not None,
        tree_mask=None if tree_mask is None else tree_mask.to(device),
        windowed=windowed,
    )


def tree_ancestor_masks(parents: Sequence[int], sliding_window: int | None) -> list[int]:
    """Each row's ancestor bits as a signed int64: bit j set = the row sees row j of its sequence,
    i.e. row j is on its root-to-row path (itself included).

    NOTE: with a sliding window W a row at depth d sits at position start + d and sees only the
    ancestors fewer than W levels up, so its mask holds min(d + 1, W) bits, and the first context
    position its window admits is start + popcount(mask) - W (start itself, i.e. none, once the
    window ends inside the tree): the kernels read that from the mask, with no depths passed.
    A real tree's mask is never -1 (that would be row 63 seeing all 64 rows: a chain).
    """
    masks = []
    for row in range(len(parents)):
        mask, node, levels = 0, row, 0
        while node >= 0 and (sliding_window is None or levels < sliding_window):
            mask |= 1 << node
            node, levels = parents[node], levels + 1
        masks.append(mask - (1 << 64) if mask >> 63 else mask)
    return masks


def step_tree_mask(query_lens: Sequence[int], tree_parents: Sequence[Sequence[int] | None],
                   sliding_window: int | None) -> torch.Tensor:
    """[num_tokens] int64 (CPU): every row's ancestor bits, -1 for the rows of causal sequences."""
    masks: list[int] = []
    for query_len, parents in zip(query_lens, tree_parents, strict=True):
        if parents is None:
            masks += [-1] * query_len
            continue
        check_tree_rows(parents, query_len)
        masks += tree_ancestor_masks(parents, sliding_window)
    return torch.tensor(masks, dtype=torch.int64)


def check_tree_rows(parents: Sequence[int], num_rows: int) -> None:
    """Raises ValueError unless `parents` are a tree over `num_rows` rows that the mask can hold."""
    if len(parents) != num_rows or num_rows > MAX_TREE_ROWS:
        raise ValueError(f"a tree sequence has at most {MAX_TREE_ROWS} rows and one parent per "
                         f"row: got {num_rows} rows, {len(parents)} parents")
    if parents[0] != -1 or not all(0 <= parent < row for row, parent in enumerate(parents) if row):
        raise ValueError(f"tree rows' parents must be -1 for row 0 and an earlier row after it, "
                         f"got {list(parents)}")


def padded_causal_mask(seq_lens: torch.Tensor, query_lens: torch.Tensor, max_query_len: int,
                       kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """[B, 1, max_query_len, kv_len] bool: which padded keys each padded query row may attend to.

    seq_lens, query_lens: [B] int64.
    """
    seq_lens, query_lens = seq_lens[:, None, None], query_lens[:, None, None]  # [B, 1, 1]
    row = torch.arange(max_query_len, dtype=torch.int64)[None, :, None]  # [1, Q, 1]
    key_pos = torch.arange(kv_len, dtype=torch.int64)[None, None, :]  # [1, 1, L]
    query_pos = seq_lens - query_lens + row  # [B, Q, 1]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    # NOTE: padded query rows (row >= query_len) attend to key 0 only, so softmax never sees an empty
    # row (NaN); their outputs are dropped by the un-padding.
    mask |= (row >= query_lens) & (key_pos == 0)
    return mask[:, None]  # [B, 1, Q, L]


def apply_tree_mask(mask: torch.Tensor, tree_mask: torch.Tensor, seq_lens: torch.Tensor,
                    query_lens: torch.Tensor, query_pad_index: torch.Tensor | None,
                    sliding_window: int | None) -> None:
    """Overwrite the tree rows of a padded causal mask [B, 1, Q, L] in place: a tree row sees the
    context before its sequence's first row (from start + popcount - W with a window: see
    tree_ancestor_masks) and the rows whose bits it holds.

    tree_mask: [num_tokens] int64; seq_lens, query_lens: [B] int64; query_pad_index: [num_tokens]
    int64 or None (as in AttentionMetadata).
    """
    batch, _, max_q, kv_len = mask.shape
    tree_mask = tree_mask.to(mask.device)
    is_tree = tree_mask != -1  # [T]
    tokens = is_tree.nonzero()[:, 0]  # [N] the tree rows
    if query_pad_index is None:
        padded = tokens
    else:
        padded = query_pad_index.to(mask.device)[tokens]  # [N] rows of the padded layout
    seq = padded // max_q  # [N]
    start = (seq_lens.to(mask.device) - query_lens.to(mask.device))[seq][:, None]  # [N, 1]
    masks = tree_mask[tokens][:, None]  # [N, 1]
    bits = (masks >> torch.arange(MAX_TREE_ROWS, device=mask.device)) & 1  # [N, 64]
    key_pos = torch.arange(kv_len, device=mask.device)[None, :]  # [1, L]
    rel = key_pos - start  # [N, L]: the key's row in the sequence, < 0 in the context
    in_tree = (rel >= 0) & (rel < MAX_TREE_ROWS) & (
        bits.gather(1, rel.clamp(0, MAX_TREE_ROWS - 1)) != 0)  # [N, L]
    in_context = rel < 0
    if sliding_window is not None:
        in_context &= key_pos >= start + bits.sum(1, keepdim=True) - sliding_window
    mask.view(batch * max_q, kv_len)[padded] = in_tree | in_context


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store this step's keys and values; rejected draft slots are simply overwritten by a later step."""
    num_kv_heads, head_dim = key.shape[1:]  # key, value: [num_tokens, num_kv_heads, head_dim]
    kv_cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, key.transpose(0, 1))
    kv_cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping,
                                                             value.transpose(0, 1))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, batch_invariant: bool = False) -> torch.Tensor:
    """Attention of each query row over its sequence's cached context. batch_invariant (the Triton
    kernel only): each row's bits independent of the step's other rows.

    query: [num_tokens, num_heads, head_dim]
    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]
    returns [num_tokens, num_heads * head_dim]
    """
    kernel = meta.kernel
    if kernel is not None and kernel.triton:
        from kernels.paged_attention_triton import paged_attention_triton
        return paged_attention_triton(query, kv_cache, kernel.block_tables, kernel.seq_lens,
                                      kernel.cu_num_query_tokens, meta.max_query_len, scale,
                                      kernel.sliding_window, tree_mask=meta.tree_mask,
                                      batch_invariant=batch_invariant)
    if kernel is not None and paged_attention_cpu_supports(query, kv_cache):
        return paged_attention_cpu(query.contiguous(), kv_cache, kernel.block_tables,
                                   kernel.seq_lens, kernel.cu_num_query_tokens, scale,
                                   kernel.sliding_window, meta.tree_mask)
    return torch_paged_attention(query, kv_cache, meta, scale)


def torch_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float) -> torch.Tensor:
    """The reference: gather each sequence's blocks into a padded copy, mask, and run SDPA."""
    num_tokens, num_heads, head_dim = query.shape
    batch, max_q = meta.num_seqs, meta.max_query_len
    num_kv_heads = kv_cache.shape[1]
    if meta.mask_pending:  # the kernel was expected but cannot take these tensors: build it once
        kernel = meta.kernel
        seq_lens, query_lens = kernel.seq_lens.long(), kernel.cu_num_query_tokens.diff().long()
        meta.attn_mask = padded_causal_mask(seq_lens, query_lens, max_q, meta.kv_len,
                                            kernel.sliding_window).to(query.device)
        if meta.tree_mask is not None:
            apply_tree_mask(meta.attn_mask, meta.tree_mask, seq_lens, query_lens,
                            meta.query_pad_index, kernel.sliding_window)
        meta.mask_pending = False
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
