"""Speculation quality and prefix-cache hits from the server's own counters: /metrics is read before
and after a run and the difference gives α, τ and the hit rate for that run's traffic (and anyone
else's: run on a quiet server).

Definitions (DESIGN.md, server/metrics.py):
  acceptance rate α  = accepted draft tokens / proposed draft tokens
  block efficiency τ = 1 + accepted draft tokens / drafts   (tokens per target pass while speculating)
  prefix-cache hit rate = prompt tokens found cached / prompt tokens looked up
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

NUM_DRAFTS = "specserve:spec_decode_num_drafts_total"
NUM_DRAFT_TOKENS = "specserve:spec_decode_num_draft_tokens_total"
NUM_ACCEPTED_TOKENS = "specserve:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POSITION = "specserve:spec_decode_num_accepted_tokens_per_pos_total"
PREFIX_CACHE_QUERIES = "specserve:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "specserve:prefix_cache_hits_total"


@dataclass(frozen=True)
class SpecCounters:
    """The speculation counters at one scrape (or the difference of two), summed over labels."""

    spec_method: str | None = None     # the `spec_method` label ("none" without speculation)
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)  # 1-based position
    # prefix cache, in prompt tokens: looked up, and found cached
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0

    def since(self, earlier: SpecCounters) -> SpecCounters:
        """What happened between an earlier scrape and this one."""
        return SpecCounters(
            spec_method=self.spec_method or earlier.spec_method,
            num_drafts=self.num_drafts - earlier.num_drafts,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
            accepted_per_position={
                position: count - earlier.accepted_per_position.get(position, 0.0)
                for position, count in self.accepted_per_position.items()},
            prefix_cache_queries=self.prefix_cache_queries - earlier.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - earlier.prefix_cache_hits)

    def plus(self, other: SpecCounters) -> SpecCounters:
        """Both runs together (to sum a sweep per configuration)."""
        positions = set(self.accepted_per_position) | set(other.accepted_per_position)
        return SpecCounters(
            spec_method=self.spec_method or other.spec_method,
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            accepted_per_position={
                p: self.accepted_per_position.get(p, 0.0) + other.accepted_per_position.get(p, 0.0)
                for p in positions},
            prefix_cache_queries=self.prefix_cache_queries + other.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits + other.prefix_cache_hits)

    @property
    def acceptance_rate(self) -> float | None:
        """α; None when no draft token was proposed."""
        if self.num_draft_tokens <= 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """τ; None when nothing was drafted."""
        if self.num_drafts <= 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens found cached / looked up; None when nothing was looked up (caching off, or
        requests without a tenant)."""
        if self.prefix_cache_queries <= 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Share of drafts whose token at position i (1..k) was accepted."""
        if self.num_drafts <= 0:
            return []
        return [self.accepted_per_position[p] / self.num_drafts
                for p in sorted(self.accepted_per_position)]


def parse_spec_counters(exposition: str) -> SpecCounters:
    """The counters from a Prometheus text exposition; absent series count as zero."""
    totals = {NUM_DRAFTS: 0.0, NUM_DRAFT_TOKENS: 0.0, NUM_ACCEPTED_TOKENS: 0.0,
              PREFIX_CACHE_QUERIES: 0.0, PREFIX_CACHE_HITS: 0.0}
    per_position: dict[int, float] = {}
    spec_method = None
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
                spec_method = sample.labels.get("spec_method", spec_method)
            elif sample.name == ACCEPTED_PER_POSITION:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
    return SpecCounters(spec_method, totals[NUM_DRAFTS], totals[NUM_DRAFT_TOKENS],
                        totals[NUM_ACCEPTED_TOKENS], per_position,
                        totals[PREFIX_CACHE_QUERIES], totals[PREFIX_CACHE_HITS])


def scrape_spec_counters(base_url: str, timeout_s: float = 10.0) -> SpecCounters | None:
    """The server's counters now, or None when it has no readable /metrics (not specserve)."""
    try:
        response = httpx.get(f"{base_url}/metrics", timeout=timeout_s)
        if response.status_code != 200:
            return None
        return parse_spec_counters(response.text)
    except (httpx.HTTPError, ValueError):
        return None
