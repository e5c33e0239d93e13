"""The finished outputs that suffix decoding drafts from, kept per tenant: a request drafts only
from outputs of requests with its own `cache_salt`, so acceptance counts cannot tell one client
what another client's outputs said. The total across tenants stays bounded."""

from __future__ import annotations

from collections import OrderedDict

from engine.proposers.suffix_tree import SuffixTree

# the key of a request without a salt: never a tenant
_NO_TENANT = object()


class OutputCache:
    """Recent finished outputs of one tenant, at most max_cached_tokens tokens.

    Eviction works on whole generations: outputs go into the newer of two trees of up to half the
    bound each; when the newer one is full, the older one (the oldest outputs) is dropped and a
    fresh tree takes new outputs. Dropping a tree is O(1) and frees all of it, where removing
    outputs one by one from a shared tree would need per-node bookkeeping. The cost: right after a
    drop, only half the bound is cached.
    """

    def __init__(self, max_depth: int, max_cached_tokens: int) -> None:
        self.max_depth = max_depth
        self.max_generation_tokens = max_cached_tokens // 2
        self.newer = SuffixTree(max_depth)
        self.older: SuffixTree | None = None

    def add(self, token_ids: list[int]) -> None:
        """Cache one finished output; one longer than a generation keeps only its last tokens."""
        if self.max_generation_tokens == 0 or not token_ids:
            return
        tokens = token_ids[-self.max_generation_tokens:]
        if self.newer.num_tokens + len(tokens) > self.max_generation_tokens:
            self.older, self.newer = self.newer, SuffixTree(self.max_depth)
        self.newer.add_sequence(tokens)

    @property
    def num_cached_tokens(self) -> int:
        return sum(tree.num_tokens for tree in self.trees)

    @property
    def trees(self) -> list[SuffixTree]:
        return [tree for tree in (self.newer, self.older) if tree is not None and tree.num_tokens]


class TenantOutputCaches:
    """One OutputCache per tenant (a `cache_salt`), or a single one for everybody when
    `is_shared_across_tenants`. A request without a salt belongs to no tenant: it neither drafts
    from nor adds to any cache (the server sends none for a client it cannot tell apart).

    NOTE: all tenants together hold at most max_cached_tokens tokens. Tenants are kept in
    least-recently-used order (drafting or caching touches one); caching an output evicts whole
    caches of the least recently used other tenants until the total fits again. A client that
    invents a new salt per request therefore cannot grow memory, only push out idle tenants.
    """

    def __init__(self, max_depth: int, max_cached_tokens: int,
                 is_shared_across_tenants: bool = False) -> None:
        self.max_depth = max_depth
        self.max_cached_tokens = max_cached_tokens
        self.is_shared_across_tenants = is_shared_across_tenants
        self._caches: OrderedDict[str, OutputCache] = OrderedDict()
        self._num_cached_tokens = 0

    def trees(self, cache_salt: str | None) -> list[SuffixTree]:
        """The cached trees a request of this tenant may draft from, newest first."""
        key = self._key(cache_salt)
        cache = None if key is _NO_TENANT else self._caches.get(key)
        if cache is None:
            return []
        self._caches.move_to_end(key)
        return cache.trees

    def add(self, cache_salt: str | None, token_ids: list[int]) -> None:
        """Cache one finished output for its tenant's later requests."""
        key = self._key(cache_salt)
        if self.max_cached_tokens < 2 or not token_ids or key is _NO_TENANT:
            return  # below 2 tokens a generation holds nothing (OutputCache halves the bound)
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = OutputCache(self.max_depth, self.max_cached_tokens)
        self._caches.move_to_end(key)
        before = cache.num_cached_tokens
        cache.add(token_ids)
        self._num_cached_tokens += cache.num_cached_tokens - before
        # one tenant's cache alone never exceeds the bound, so evicting others always suffices
        while self._num_cached_tokens > self.max_cached_tokens:
            _, evicted = self._caches.popitem(last=False)
            self._num_cached_tokens -= evicted.num_cached_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached_tokens

    @property
    def num_tenants(self) -> int:
        return len(self._caches)

    def _key(self, cache_salt: str | None) -> str | object:
        if self.is_shared_across_tenants:
            return ""
        return _NO_TENANT if cache_salt is None else cache_salt
