"""Automatic prefix caching, the pool side: hashes of full KV blocks and the LRU of unreferenced ones.

A full block is named by a hash chained over its prefix, so equal names mean equal prefixes:

    root  = sha256("specserve-prefix-v1" | model identity | tenant salt)
    h[0]  = sha256(root | tokens 0..B-1)         h[i] = sha256(h[i-1] | tokens i*B..i*B+B-1)

The hash only finds a candidate. Every entry also keeps its own token ids, its tenant and the very entry
it was chained on, and a lookup compares them: a hash collision can miss the cache, never return another
prefix's K/V. Pure bookkeeping over block ids; the reference counts live in `BlockManager`.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# NOTE: bump when the encoding changes, so digests of two encodings never meet
_HASH_VERSION = b"specserve-prefix-v1"


def root_hash(model_id: str, salt: str) -> bytes:
    """The chain's parent for a prefix's first block: one per (model, tenant)."""
    model, tenant = model_id.encode(), salt.encode()
    return hashlib.sha256(struct.pack("<QQ", len(model), len(tenant)) + _HASH_VERSION
                          + model + tenant).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256 of the parent's 32-byte digest then the tokens as little-endian int64 (a fixed width, so
    the encoding is unambiguous). Python's `hash()` of a tuple is 64 bits, varies with PYTHONHASHSEED
    and can be collided on purpose; 256 bits make an accidental collision beyond reach."""
    return hashlib.sha256(parent_hash + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


@dataclass(eq=False)
class CachedBlock:
    """One cached full block. Compared by identity: `parent is entry` names one exact chain."""

    block_id: int
    block_hash: bytes
    tenant: tuple[str, str]  # (model identity, cache_salt) whose prefix this is
    parent: CachedBlock | None  # the entry for the previous block of the prefix; None for block 0
    token_ids: tuple[int, ...]  # the block's own tokens, [block_size]

    def matches(self, tenant: tuple[str, str], parent: CachedBlock | None,
                token_ids: tuple[int, ...]) -> bool:
        return self.parent is parent and self.token_ids == token_ids and self.tenant == tenant


class PrefixCache:
    """Hash -> cached block, and the blocks nobody references kept in least-recently-used order.

    A cached block is either referenced (some request's block table holds it) or evictable (in the
    LRU; it still counts as free capacity). Evicting drops its hash, so it is never found again.
    """

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self._by_hash: dict[bytes, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}
        # unreferenced cached blocks, least recently used first
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_hash)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def entry(self, block_id: int) -> CachedBlock | None:
        return self._by_block.get(block_id)

    def entries(self) -> list[CachedBlock]:
        return list(self._by_hash.values())

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    # ------------------------------------------------------------------ the hash chain
    def tenant(self, salt: str) -> tuple[str, str]:
        return (self.model_id, salt)

    def child_hash(self, salt: str, parent: CachedBlock | None, token_ids: Sequence[int]) -> bytes:
        parent_hash = root_hash(self.model_id, salt) if parent is None else parent.block_hash
        return hash_block(parent_hash, token_ids)

    def find(self, salt: str, parent: CachedBlock | None,
             token_ids: tuple[int, ...]) -> tuple[bytes, CachedBlock | None, bool]:
        """(hash, the entry under that hash or None, whether that entry really is this prefix)."""
        block_hash = self.child_hash(salt, parent, token_ids)
        entry = self._by_hash.get(block_hash)
        return block_hash, entry, entry is not None and entry.matches(self.tenant(salt), parent,
                                                                      token_ids)

    def insert(self, block_id: int, block_hash: bytes, salt: str, parent: CachedBlock | None,
               token_ids: tuple[int, ...]) -> CachedBlock:
        assert block_hash not in self._by_hash and block_id not in self._by_block
        entry = CachedBlock(block_id, block_hash, self.tenant(salt), parent, token_ids)
        self._by_hash[block_hash] = entry
        self._by_block[block_id] = entry
        return entry

    def remove(self, block_id: int) -> None:
        """Forget the block's hash (it is about to hold other tokens); no-op if it is not cached."""
        entry = self._by_block.pop(block_id, None)
        if entry is not None and self._by_hash.get(entry.block_hash) is entry:
            del self._by_hash[entry.block_hash]
        self._evictable.pop(block_id, None)

    # ------------------------------------------------------------------ the LRU
    def park(self, block_id: int) -> None:
        """The block's last reference went away: it is now the most recently used evictable block."""
        self._evictable[block_id] = None
        self._evictable.move_to_end(block_id)

    def unpark(self, block_id: int) -> None:
        """A request references the block again: it may not be evicted."""
        self._evictable.pop(block_id, None)

    def evict_lru(self) -> int:
        """Uncache the least recently used unreferenced block and return its id."""
        block_id, _ = self._evictable.popitem(last=False)
        self.remove(block_id)
        return block_id

    def evict_all(self) -> list[int]:
        """Uncache every unreferenced block; their ids, least recently used first."""
        block_ids = list(self._evictable)
        for block_id in block_ids:
            self.remove(block_id)
        return block_ids
