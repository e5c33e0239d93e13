"""The paged KV block pool: which blocks each request holds, reference counts and the free list.

A request holding `n` tokens of K/V owns ceil(n / block_size) blocks, listed in its block table:

    block table [7, 2, 9]   block_size 4   tokens 0..9
    slots       7*4+0 .. 7*4+3 | 2*4+0 .. 2*4+3 | 9*4+0, 9*4+1     (9*4+2, 9*4+3 free for the next tokens)

With prefix caching on, full blocks of committed tokens are also cached by a hash of their prefix
(engine/kv/prefix_cache.py) and shared between requests of one tenant:

    request a   [7, 2, 9]        7, 2 cached (ref count 2)   9 holds a's last prompt token: a's own
    request b   [7, 2, 4, 5]     b computes from token 8 on, writing only into 4 and 5

A block nobody references stays cached (evictable, least recently used first) until a fresh block is
needed and the free list is empty.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engine.kv.prefix_cache import CachedBlock, PrefixCache


class BlockManager:
    """Block tables, ref counts and the free list; with `enable_prefix_caching`, the prefix cache.

    The scheduler's side of prefix caching (salt None, or caching off: every call below acts as the
    plain `allocate`, and nothing is looked up, cached or counted):
      1. admission: `num_cached = len(lookup_prefix(prompt, salt)) * block_size` sets where the
         request's computation starts; `can_allocate_with_prefix` / `allocate_with_prefix` take the
         cached blocks and fresh ones for the rest (the cached count is returned again);
      2. growth: `can_allocate` / `allocate` as without caching;
      3. after each step: `register_full_blocks(request_id, committed_token_ids)` with the tokens whose
         K/V is computed AND committed (never drafts), so their newly full blocks become shareable;
      4. finish or preemption: `free`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 model_id: str = "") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._block_tables: dict[str, list[int]] = {}
        # ---- prefix caching (model_id: cached blocks of two models never meet) ----
        self.enable_prefix_caching = enable_prefix_caching
        self._cache = PrefixCache(model_id)
        self._salts: dict[str, str] = {}  # request -> its tenant, for requests that may cache
        # request -> the cache entries its full blocks match so far (its own blocks, or equal ones)
        self._chains: dict[str, list[CachedBlock]] = {}
        self._closed_chains: set[str] = set()  # requests whose chain met a colliding hash
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get now: free ones and cached ones nobody references."""
        return len(self._free_block_ids) + self._cache.num_evictable

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
            block_id = self._take_free_block()
            self._ref_counts[block_id] = 1
            table.append(block_id)

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks nobody references go back to the pool, cached ones
        as evictable (the table's tail first, so a prefix outlives its continuations)."""
        table = self._block_tables.pop(request_id, [])
        self._salts.pop(request_id, None)
        self._chains.pop(request_id, None)
        self._closed_chains.discard(request_id)
        for block_id in table:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0 and self._cache.entry(block_id) is None:
                self._free_block_ids.append(block_id)
        for block_id in reversed(table):
            if self._ref_counts[block_id] == 0 and self._cache.entry(block_id) is not None:
                self._cache.park(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def _take_free_block(self) -> int:
        """A block nobody references: from the free list, else the least recently used cached one."""
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        return self._cache.evict_lru()

    # ------------------------------------------------------------------ prefix caching
    def lookup_prefix(self, token_ids: Sequence[int], salt: str | None) -> list[int]:
        """The cached blocks holding the longest cached full-block prefix of `token_ids`, in order.

        Changes nothing. Stops before the block holding the last token: the caller computes at least
        that token (its logits), and a shared block is never written.
        """
        return [entry.block_id for entry in self._match_prefix(token_ids, salt)]

    def can_allocate_with_prefix(self, token_ids: Sequence[int], salt: str | None,
                                 num_tokens: int) -> bool:
        """Whether `allocate_with_prefix` with the same arguments fits."""
        return self._num_short_with_prefix(token_ids, salt, num_tokens) <= 0

    def allocate_with_prefix(self, request_id: str, token_ids: Sequence[int], salt: str | None,
                             num_tokens: int) -> int:
        """Admit a request holding no blocks: reference the cached prefix of `token_ids` (its prompt,
        or prompt + output after a preemption), then grow the table to `num_tokens` with fresh blocks.

        Returns the number of leading tokens whose K/V is already cached: a multiple of block_size,
        at most len(token_ids) - 1; the caller starts computing there. `num_tokens` is the table's
        size after this step (cached tokens + this step's chunk). Raises, changing nothing, if it
        does not fit. `salt` None: nothing is looked up or later cached (a tenant of its own).
        """
        if self.block_table(request_id):
            raise RuntimeError(f"request {request_id} already holds KV blocks")
        num_short = self._num_short_with_prefix(token_ids, salt, num_tokens)
        if num_short > 0:
            raise RuntimeError(f"request {request_id} is {num_short} KV blocks short")
        if not self.enable_prefix_caching or salt is None:
            self.allocate(request_id, num_tokens)
            return 0
        chain = self._match_prefix(token_ids, salt)
        table = self._block_tables.setdefault(request_id, [])
        for entry in chain:
            if self._ref_counts[entry.block_id] == 0:
                self._cache.unpark(entry.block_id)
            self._ref_counts[entry.block_id] += 1
            table.append(entry.block_id)
        self._salts[request_id] = salt
        self._chains[request_id] = chain
        num_cached = len(chain) * self.block_size
        self.allocate(request_id, max(num_tokens, num_cached))
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_cached
        return num_cached

    def register_full_blocks(self, request_id: str, committed_token_ids: Sequence[int]) -> None:
        """Cache the request's blocks that `committed_token_ids` (tokens 0.. whose K/V is computed
        and committed: never a draft) fill completely. Call after each step; repeats are cheap.

        A block equal to one already cached stays the request's own, uncached copy. A hash that
        collides with another prefix's block ends caching for the rest of this request.
        """
        salt = self._salts.get(request_id)
        if salt is None or request_id in self._closed_chains:
            return
        table, chain = self._block_tables[request_id], self._chains[request_id]
        num_full = min(len(committed_token_ids) // self.block_size, len(table))
        for index in range(len(chain), num_full):
            start = index * self.block_size
            token_ids = tuple(committed_token_ids[start:start + self.block_size])
            parent = chain[-1] if chain else None
            block_hash, entry, is_match = self._cache.find(salt, parent, token_ids)
            if entry is not None and not is_match:
                if self._ref_counts[entry.block_id] > 0:
                    self._closed_chains.add(request_id)
                    return
                # an unreferenced entry under our hash: a collision or a chain whose parent was
                # evicted (unreachable either way); the newer prefix takes the name
                self._cache.remove(entry.block_id)
                self._free_block_ids.append(entry.block_id)
                entry = None
            if entry is None:
                entry = self._cache.insert(table[index], block_hash, salt, parent, token_ids)
            chain.append(entry)

    def num_chained_blocks(self, request_id: str) -> int:
        """The request's leading blocks already matched or cached: register_full_blocks has nothing
        to do until its committed tokens fill more than these."""
        return len(self._chains.get(request_id, ()))

    def reset_prefix_cache(self) -> int:
        """Uncache every block nobody references (they join the free list); returns how many."""
        block_ids = self._cache.evict_all()
        self._free_block_ids.extend(block_ids)
        return len(block_ids)

    def _match_prefix(self, token_ids: Sequence[int], salt: str | None) -> list[CachedBlock]:
        if not self.enable_prefix_caching or salt is None:
            return []
        chain: list[CachedBlock] = []
        for index in range((len(token_ids) - 1) // self.block_size):
            start = index * self.block_size
            _, entry, is_match = self._cache.find(salt, chain[-1] if chain else None,
                                                  tuple(token_ids[start:start + self.block_size]))
            if entry is None or not is_match:
                break
            chain.append(entry)
        return chain

    def _num_short_with_prefix(self, token_ids: Sequence[int], salt: str | None,
                               num_tokens: int) -> int:
        """Blocks missing for `allocate_with_prefix` of a request holding none; <= 0: it fits."""
        chain = self._match_prefix(token_ids, salt)
        # cached blocks nobody references count as free now, but this request is about to take them
        num_taken = sum(1 for entry in chain if self._ref_counts[entry.block_id] == 0)
        num_fresh = max(0, -(-num_tokens // self.block_size) - len(chain))
        return num_fresh - (self.num_free_blocks - num_taken)
