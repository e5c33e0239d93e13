"""One model with its paged KV cache and its block pool: prepare -> run -> logits.

The target and every model drafter (the draft model, EAGLE's head) run through this one class. A pass
is a list of sequences, each contributing the rows at positions start .. start + len - 1:

    prefill chunk     SequenceRows("a", start=0,  token_ids=[t0 .. t47])
    decode            SequenceRows("b", start=90, token_ids=[t90])
    verification      SequenceRows("c", start=31, token_ids=[t31, d1, d2, d3])

`prepare` turns them into token ids, positions and the attention metadata over the sequences' block
tables; `run` calls the model on them with the KV cache; each row's K/V lands in its slot. Rows past a
sequence's committed length (drafts) are written and later simply overwritten: rollback stays
bookkeeping in whoever owns the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionMetadata, build_attention_metadata
from engine.block_manager import BlockManager
from engine.models.arch import LlamaArch
from engine.models.build import allocate_kv_cache


@dataclass
class SequenceRows:
    """One sequence's rows in a pass: its tokens at positions start .. start + len(token_ids) - 1."""

    seq_id: str
    start: int
    token_ids: list[int]


@dataclass
class PagedInputs:
    # [num_rows] int64: every sequence's tokens, sequence after sequence
    input_ids: torch.Tensor
    # [num_rows] int64: each row's position in its sequence
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # [num_seqs] int64: each sequence's last row (where a drafter reads its next token's logits)
    last_rows: torch.Tensor


class PagedRunner:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], blocks: BlockManager,
                 sliding_window: int | None, device: torch.device,
                 attention_backend: str = "auto") -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.blocks = blocks
        self.sliding_window = sliding_window
        self.device = device
        self.attention_backend = attention_backend

    @classmethod
    def with_own_pool(cls, model: nn.Module, arch: LlamaArch, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> PagedRunner:
        """A drafter's runner: a fresh pool of `num_blocks` and K/V for `arch`'s layers."""
        return cls(model, allocate_kv_cache(arch, num_blocks, block_size, dtype, device),
                   BlockManager(num_blocks, block_size), arch.sliding_window, device)

    # ------------------------------------------------------------------ blocks
    def reserve(self, seq_id: str, num_tokens: int) -> bool:
        """Grow the sequence's blocks to hold `num_tokens`; False (nothing taken) if the pool is full."""
        if not self.blocks.can_allocate(seq_id, num_tokens):
            return False
        self.blocks.allocate(seq_id, num_tokens)
        return True

    def free(self, seq_id: str) -> None:
        self.blocks.free(seq_id)

    # ------------------------------------------------------------------ a pass
    def prepare(self, sequences: list[SequenceRows]) -> PagedInputs:
        """The pass's tensors; every sequence holds blocks for start + len(token_ids) tokens."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables, last_rows = [], [], [], []
        for rows in sequences:
            end = rows.start + len(rows.token_ids)
            token_ids += rows.token_ids
            positions += range(rows.start, end)
            query_lens.append(len(rows.token_ids))
            seq_lens.append(end)
            tables.append(self.blocks.block_table(rows.seq_id))
            last_rows.append(len(token_ids) - 1)
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.blocks.block_size,
                                        self.sliding_window, self.device, self.attention_backend)
        return PagedInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            attn_metadata=meta,
            last_rows=torch.tensor(last_rows, dtype=torch.int64, device=self.device))

    def run(self, inputs: PagedInputs, *model_inputs: torch.Tensor) -> torch.Tensor:
        """The model's hidden state at every row: [num_rows, hidden]. `model_inputs` replace the
        token ids for a model that takes other leading inputs (EAGLE's head: embeddings, features)."""
        leading = model_inputs or (inputs.input_ids,)
        return self.model(*leading, inputs.positions, inputs.attn_metadata, self.kv_caches)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
