"""A step's inputs in fixed device buffers, padded to a bucket: the layout a CUDA graph replays.

A captured graph reads and writes the same addresses with the same shapes on every replay, so decode
and verification steps cannot build fresh tensors. Every step instead writes its inputs into buffers
allocated once, padded to the smallest bucket that holds it, and the forward reads views of those:

    bucket (num_seqs S, max_query_len Q): S * Q token rows; the Triton attention's grid (S, kv heads,
    Q-tiles) is the same for every step in the bucket

    a step of 3 sequences verifying k = 2, 0, 1 in bucket (4, 3):
    token rows        | A A A | B | C C | pad pad pad pad pad pad |   12 = 4 * 3 rows
    cu_num_query      0       3   4     6   6                        a padding sequence has no rows
    seq_lens          sA      sB  sC    0
    slot_mapping      slots of A, B, C  | padding_slot x 6           a scratch slot nobody reads

Padding rows run through every layer like real ones (row-wise ops never mix rows), write their K/V to
a scratch slot that no block table points to, and are dropped when logits are taken. Steps outside the
buckets (prefill chunks, more sequences than the largest bucket) run eagerly, with exact shapes.

All of a step's integers go to the device in one copy, from a (pinned, on CUDA) host staging buffer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from engine.models.attention import AttentionMetadata, KernelInputs


@dataclass(frozen=True)
class StepBucket:
    # sequences the step is padded to (padding sequences have no rows)
    num_seqs: int
    # query rows per sequence at most: 1 for decode, 1 + k for verification
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.max_query_len


def seq_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself): a padded
    step wastes at most 7 sequences' rows, and a model has ~max_num_seqs / 8 graphs per layout."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += range(8, max_num_seqs, 8)
    return sorted(set(sizes) | {max_num_seqs})


@dataclass
class StaticStep:
    """One step's views into the buffers, sized to its bucket."""

    bucket: StepBucket
    # [bucket.num_tokens] int64
    input_ids: torch.Tensor
    # [bucket.num_tokens] int64
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # real token rows (the first num_real_tokens of the bucket's rows)
    num_real_tokens: int


class StaticStepInputs:
    def __init__(self, max_num_seqs: int, query_len_buckets: list[int], max_num_blocks_per_seq: int,
                 padding_slot: int, sliding_window: int | None, device: torch.device) -> None:
        """query_len_buckets: the layouts, e.g. [1, 1 + k]; padding_slot: a KV slot outside every
        block table (the worker keeps one spare block for it)."""
        self.seq_buckets = seq_buckets(max_num_seqs)
        self.query_len_buckets = sorted(set(query_len_buckets))
        self.max_num_seqs = max_num_seqs
        self.max_num_blocks = max_num_blocks_per_seq
        self.padding_slot = padding_slot
        self.sliding_window = sliding_window
        self.device = device
        max_tokens = max_num_seqs * self.query_len_buckets[-1]
        self.max_tokens = max_tokens
        # staging layout: ids | positions | slots | seq_lens | cu_num_query_tokens | block tables
        self._sections = [max_tokens, max_tokens, max_tokens, max_num_seqs, max_num_seqs + 1,
                          max_num_seqs * max_num_blocks_per_seq]
        size = sum(self._sections)
        self._host = torch.zeros(size, dtype=torch.int64,
                                 pin_memory=device.type == "cuda")
        self._device = torch.zeros(size, dtype=torch.int64, device=device)
        (self.input_ids, self.positions, self.slot_mapping, seq_lens64, cu64,
         tables64) = self._device.split(self._sections)
        self._int64_sources = (seq_lens64, cu64, tables64)
        # the kernels' int32 views: copied from the int64 mirror on the device after each load
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.cu_num_query_tokens = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_num_seqs, max_num_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        # on CUDA: done once the last load's copy has read the staging buffer
        self._copied: torch.cuda.Event | None = None

    def bucket_for(self, query_lens: list[int]) -> StepBucket | None:
        """The smallest bucket that holds the step, or None: run it eagerly."""
        if not query_lens or len(query_lens) > self.max_num_seqs:
            return None
        longest = max(query_lens)
        layout = bisect.bisect_left(self.query_len_buckets, longest)
        if layout == len(self.query_len_buckets):
            return None
        seqs = self.seq_buckets[bisect.bisect_left(self.seq_buckets, len(query_lens))]
        return StepBucket(seqs, self.query_len_buckets[layout])

    def load(self, bucket: StepBucket, token_ids: list[int], positions: list[int],
             query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
             block_size: int) -> StaticStep:
        """Write one step into the buffers (one host-to-device copy) and view it at its bucket."""
        num_seqs, num_tokens = len(query_lens), len(token_ids)
        if num_seqs > bucket.num_seqs or num_tokens > bucket.num_tokens or any(
                len(table) > self.max_num_blocks for table in block_tables):
            raise ValueError(f"a step of {num_seqs} sequences and {num_tokens} rows does not fit "
                             f"bucket {bucket} (or a block table is too long)")
        if self._copied is not None:  # NOTE: the last copy may still be reading the staging
            self._copied.synchronize()   # buffer when two loads come with no sync between them
        ids, pos, slots, lens, cu, tables = self._host.split(self._sections)
        ids[:num_tokens] = torch.tensor(token_ids)
        ids[num_tokens:bucket.num_tokens] = 0
        pos[:num_tokens] = torch.tensor(positions)
        pos[num_tokens:bucket.num_tokens] = 0
        slot_list: list[int] = []
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
            slot_list += [table[p // block_size] * block_size + p % block_size
                          for p in range(seq_len - query_len, seq_len)]
        slots[:num_tokens] = torch.tensor(slot_list)
        slots[num_tokens:bucket.num_tokens] = self.padding_slot
        lens[:num_seqs] = torch.tensor(seq_lens)
        lens[num_seqs:bucket.num_seqs] = 0
        cu[0] = 0
        cu[1:num_seqs + 1] = torch.tensor(query_lens).cumsum(0)
        cu[num_seqs + 1:bucket.num_seqs + 1] = num_tokens
        tables_2d = tables.view(self.max_num_seqs, self.max_num_blocks)
        tables_2d[:bucket.num_seqs] = 0
        for row, table in enumerate(block_tables):
            tables_2d[row, :len(table)] = torch.tensor(table)
        # NOTE: in the engine the next load comes after this step's sampled tokens came back to
        # the host (the step's one sync), so the event has fired and waiting on it costs nothing
        self._device.copy_(self._host, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        seq_lens64, cu64, tables64 = self._int64_sources
        self.seq_lens.copy_(seq_lens64)
        self.cu_num_query_tokens.copy_(cu64)
        self.block_tables.copy_(tables64.view(self.max_num_seqs, self.max_num_blocks))
        kernel = KernelInputs(
            block_tables=self.block_tables[:bucket.num_seqs],
            seq_lens=self.seq_lens[:bucket.num_seqs],
            cu_num_query_tokens=self.cu_num_query_tokens[:bucket.num_seqs + 1],
            sliding_window=self.sliding_window,
            triton=True)
        meta = AttentionMetadata(
            num_seqs=bucket.num_seqs,
            max_query_len=bucket.max_query_len,
            kv_len=self.max_num_blocks * block_size,
            slot_mapping=self.slot_mapping[:bucket.num_tokens],
            block_gather_index=self.block_tables[:bucket.num_seqs],
            query_pad_index=None,
            attn_mask=None,
            kernel=kernel)
        return StaticStep(bucket=bucket, input_ids=self.input_ids[:bucket.num_tokens],
                          positions=self.positions[:bucket.num_tokens], attn_metadata=meta,
                          num_real_tokens=num_tokens)
