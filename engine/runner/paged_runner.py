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

A tree of drafts is verified in the same one pass (engine/draft_tree.py): its rows still fill the
slots of positions start, start + 1, ..., but each row takes the position start + its depth and
attends to the context plus its own root-to-row path only:

    tree verification SequenceRows("d", start=50, token_ids=[t50, a, b, c], parents=[-1, 0, 1, 0])
        t50 ─┬─ a ── b        slots      50 51 52 53  (t50 a b c)
             └─ c             positions  50 51 52 51
                              b sees the context, t50, a, b; c sees the context, t50, c

After verification `keep_rows` copies the accepted path's K/V to the positions it now holds; when
that path is the first branch (rows 0, 1, 2, ...) nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.kv.block_manager import BlockManager
from engine.models.arch import DecoderArch
from engine.models.attention import AttentionMetadata, build_attention_metadata, check_tree_rows
from engine.models.build import allocate_kv_cache
from engine.step.types import SequenceRows


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
                 attention_backend: str = "auto", local_window: int | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.blocks = blocks
        self.sliding_window = sliding_window
        # the sliding layers' window of a model that mixes sliding and full layers
        self.local_window = local_window
        self.device = device
        self.attention_backend = attention_backend

    @classmethod
    def with_own_pool(cls, model: nn.Module, arch: DecoderArch, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> PagedRunner:
        """A drafter's runner: a fresh pool of `num_blocks` and K/V for `arch`'s layers."""
        return cls(model, allocate_kv_cache(arch, num_blocks, block_size, dtype, device),
                   BlockManager(num_blocks, block_size), arch.sliding_window, device,
                   local_window=arch.local_window)

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
        tree_parents: list[list[int] | None] = []
        for rows in sequences:
            end = rows.start + len(rows.token_ids)
            parents = rows.tree_parents()
            token_ids += rows.token_ids
            if parents is None:
                positions += range(rows.start, end)
            else:
                check_tree_rows(parents, len(rows.token_ids))
                positions += [rows.start + depth for depth in row_depths(parents)]
            query_lens.append(len(rows.token_ids))
            seq_lens.append(end)
            tables.append(rows.block_table if rows.block_table is not None
                          else self.blocks.block_table(rows.seq_id))
            last_rows.append(len(token_ids) - 1)
            tree_parents.append(parents)
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.blocks.block_size,
                                        self.sliding_window, self.device, self.attention_backend,
                                        tree_parents, self.local_window)
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

    def run_with_logits(self, inputs: PagedInputs, logits_rows: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """run's hidden states and the logits at `logits_rows` ([R] int64), in one native call
        where the model's CPU pass holds its LM head (LlamaForCausalLM.forward_with_logits)."""
        return self.model.forward_with_logits(inputs.input_ids, inputs.positions,
                                              inputs.attn_metadata, self.kv_caches, logits_rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def keep_rows(self, seq_id: str, start: int, rows: list[int],
                  block_table: list[int] | None = None) -> None:
        """After a tree pass that began at `start`: the K/V at positions start + i (every layer)
        become those row `rows[i]` wrote. `rows` increase with rows[i] >= i (the accepted path,
        root first); rows already in place are not copied.

        A kept row's K/V is valid at its new slot because its position was start + its depth, and
        on a root-to-node path the depth of rows[i] is i.
        """
        if any(row < i for i, row in enumerate(rows)) or any(
                a >= b for a, b in zip(rows, rows[1:])):
            raise ValueError(f"kept rows must increase with rows[i] >= i, got {rows}")
        moves = [(start + i, start + row) for i, row in enumerate(rows) if row != i]
        if not moves:
            return
        table = self.blocks.block_table(seq_id) if block_table is None else block_table
        block_size = self.blocks.block_size
        if start + rows[-1] >= len(table) * block_size:
            raise ValueError(f"sequence {seq_id!r} holds no slot for position {start + rows[-1]}")
        slots = [[table[pos // block_size] * block_size + pos % block_size for pos in move]
                 for move in zip(*moves)]
        dst, src = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [num_moves] each
        for kv_cache in self.kv_caches:  # [2, kvH, num_blocks, block_size, D]
            flat = kv_cache.view(2, kv_cache.shape[1], -1, kv_cache.shape[-1])  # [2, kvH, slots, D]
            # NOTE: the gather completes before the copy: a source also overwritten is read first
            flat.index_copy_(2, dst, flat.index_select(2, src))


def row_depths(parents: list[int]) -> list[int]:
    """Each row's depth below row 0 (row 0 is at depth 0)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths
