"""α and τ from two /metrics scrapes, with the names and definitions of server/metrics.py."""

from __future__ import annotations

import pytest

from engine.messages import StepStats
from loadtest.metrics_scrape import SpecCounters, parse_spec_counters
from server.metrics import ServerMetrics


def exposition(num_drafts: int, num_draft_tokens: int, num_accepted: int,
               per_position: tuple[int, ...]) -> str:
    """The exposition a real ServerMetrics renders after one step with these counts."""
    metrics = ServerMetrics("m", "ngram", num_speculative_tokens=len(per_position))
    metrics.observe_step(StepStats(num_drafts=num_drafts, num_draft_tokens=num_draft_tokens,
                                   num_accepted_tokens=num_accepted,
                                   accepted_per_position=list(per_position)))
    return metrics.render()[0].decode()


def test_reads_the_counters_the_server_exports():
    counters = parse_spec_counters(exposition(4, 12, 6, (3, 2, 1)))
    assert counters.spec_method == "ngram"
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (
        4, 12, 6)
    assert counters.accepted_per_position == {1: 3, 2: 2, 3: 1}
    assert counters.acceptance_rate == pytest.approx(6 / 12)
    assert counters.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert counters.acceptance_rate_per_position == pytest.approx([3 / 4, 2 / 4, 1 / 4])


def test_a_run_is_the_difference_of_two_scrapes():
    before = SpecCounters("ngram", 10, 30, 12, {1: 8, 2: 4})
    after = SpecCounters("ngram", 15, 45, 22, {1: 12, 2: 7})
    run = after.since(before)
    assert run.acceptance_rate == pytest.approx(10 / 15)
    assert run.mean_acceptance_length == pytest.approx(1 + 10 / 5)
    assert run.acceptance_rate_per_position == pytest.approx([4 / 5, 3 / 5])


def test_the_prefix_cache_hit_rate_of_a_run():
    metrics = ServerMetrics("m", "ngram", num_speculative_tokens=1)
    metrics.observe_step(StepStats(prefix_cache_queries=100, prefix_cache_hits=32))
    before = parse_spec_counters(metrics.render()[0].decode())
    assert before.prefix_cache_hit_rate == pytest.approx(0.32)
    metrics.observe_step(StepStats(prefix_cache_queries=300, prefix_cache_hits=192))
    run = parse_spec_counters(metrics.render()[0].decode()).since(before)
    assert run.prefix_cache_hit_rate == pytest.approx(160 / 200)
    assert parse_spec_counters("# nothing\n").prefix_cache_hit_rate is None


def test_no_drafts_means_no_alpha_or_tau():
    counters = parse_spec_counters("# nothing exported\n")
    assert counters.acceptance_rate is None
    assert counters.mean_acceptance_length is None
    assert counters.acceptance_rate_per_position == []
