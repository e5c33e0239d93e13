"""Flatten one scheduled step into the tensors a forward pass takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, build_attention_metadata
from engine.block_manager import BlockManager
from engine.scheduler import SchedulerOutput


@dataclass
class ModelInputs:
    # [num_tokens] int64: every scheduled token, request after request
    input_ids: torch.Tensor
    # [num_tokens] int64: each token's absolute position in its sequence
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # [num_sampling_rows] int64: rows of the flattened batch whose logits are needed: per sampling
    # request, its last known token's row then one row per draft token (the step layout's)
    logits_indices: torch.Tensor


def build_model_inputs(output: SchedulerOutput, block_manager: BlockManager,
                       sliding_window: int | None, device: torch.device,
                       attention_backend: str = "auto") -> ModelInputs:
    token_ids: list[int] = []
    positions: list[int] = []
    query_lens, seq_lens, block_tables = [], [], []
    for item in output.scheduled:
        request = item.request
        start = request.num_computed_tokens
        end = start + item.num_new_tokens
        token_ids += request.token_ids_between(start, end - item.num_draft_tokens)
        token_ids += item.draft_token_ids
        positions += range(start, end)
        query_lens.append(item.num_new_tokens)
        seq_lens.append(end)
        block_tables.append(block_manager.block_table(request.request_id))
    meta = build_attention_metadata(query_lens, seq_lens, block_tables, block_manager.block_size,
                                    sliding_window, device, attention_backend)
    return ModelInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attn_metadata=meta,
        logits_indices=output.layout.logits_indices.to(device),
    )
