"""Paged attention on the CPU in C++ (`kernels/csrc/paged_attention.cpp`): each query row reads its
sequence's K/V blocks in place, so a batch never builds a padded copy of every context in every
layer.

The torch path in `engine/models/attention.py` is the reference; the kernel agrees with it within float32
rounding and, unlike it, gives each row the same bits whatever else is in the batch (see the C++
file).
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import load_cpu_library


def paged_attention_cpu_available() -> bool:
    """True once the library is built and loaded (False without a compiler or with
    SPECSERVE_CPU_KERNELS=0)."""
    return load_cpu_library("paged_attention")


def paged_attention_cpu_supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """float32 CPU tensors, a contiguous cache, head_dim a multiple of 8; anything else (bf16, fp16,
    float64) stays on the torch path."""
    return (query.dtype == kv_cache.dtype == torch.float32 and query.device.type == "cpu"
            and kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
            and query.shape[-1] % 8 == 0)


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: context after this step
    cu_num_query_tokens: torch.Tensor,  # [num_seqs + 1] int32: each sequence's rows in `query`
    scale: float,
    sliding_window: int | None,
    tree_mask: torch.Tensor | None = None,  # [num_tokens] int64: ancestor bits, -1 = causal row
) -> torch.Tensor:
    """Every query row over its sequence's context: [num_tokens, num_heads * head_dim]. A tree
    row (tree_mask, engine/models/attention.py) sees the context and the rows of its own path only."""
    assert query.ndim == 3 and kv_cache.ndim == 5 and kv_cache.shape[0] == 2
    assert query.is_contiguous() and kv_cache.is_contiguous()
    assert block_tables.dtype == seq_lens.dtype == cu_num_query_tokens.dtype == torch.int32
    assert tree_mask is None or (tree_mask.dtype == torch.int64 and tree_mask.is_contiguous())
    return torch.ops.specserve.paged_attention(query, kv_cache[0], kv_cache[1], block_tables,
                                               seq_lens, cu_num_query_tokens, scale,
                                               sliding_window or 0, tree_mask)
