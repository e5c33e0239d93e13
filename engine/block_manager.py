"""The paged KV block pool: which blocks each request holds, reference counts and the free list.

A request holding `n` tokens of K/V owns ceil(n / block_size) blocks, listed in its block table:

    block table [7, 2, 9]   block_size 4   tokens 0..9
    slots       7*4+0 .. 7*4+3 | 2*4+0 .. 2*4+3 | 9*4+0, 9*4+1     (9*4+2, 9*4+3 free for the next tokens)
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (exported as KV-cache usage)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def num_blocks_to_add(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request still needs so that it can hold `num_tokens` tokens of K/V."""
        num_needed = -(-num_tokens // self.block_size)
        return max(0, num_needed - len(self.block_table(request_id)))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_blocks_to_add(request_id, num_tokens) <= self.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int) -> None:
        """Grow the request's block table to hold `num_tokens`; the caller checked `can_allocate`."""
        num_new = self.num_blocks_to_add(request_id, num_tokens)
        if num_new > self.num_free_blocks:
            raise RuntimeError(
                f"request {request_id} needs {num_new} KV blocks, {self.num_free_blocks} are free")
        table = self._block_tables.setdefault(request_id, [])
        for _ in range(num_new):
            block_id = self._free_block_ids.popleft()
            self._ref_counts[block_id] = 1
            table.append(block_id)

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks nobody references go back to the pool."""
        for block_id in self._block_tables.pop(request_id, []):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_block_ids.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
