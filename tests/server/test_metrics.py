"""ServerMetrics as a scraper sees it: parsed exposition text, not the objects behind it."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from engine.messages import StepStats
from server.metrics import (
    ACCEPTANCE_RATE_PROMQL,
    BLOCK_EFFICIENCY_PROMQL,
    MEAN_CHOSEN_K_PROMQL,
    SPECULATING_SHARE_PROMQL,
    ServerMetrics,
)

BASE_LABELS = {"model_name": "tiny", "spec_method": "ngram"}

EXPECTED_NAMES = {
    "specserve:num_requests_running",
    "specserve:num_requests_waiting",
    "specserve:kv_cache_usage_perc",
    "specserve:num_preemptions_total",
    "specserve:prefix_cache_queries_total",
    "specserve:prefix_cache_hits_total",
    "specserve:engine_steps_total",
    "specserve:prompt_tokens_total",
    "specserve:generation_tokens_total",
    "specserve:spec_decode_num_speculative_tokens",
    "specserve:spec_decode_num_drafts_total",
    "specserve:spec_decode_num_draft_tokens_total",
    "specserve:spec_decode_num_accepted_tokens_total",
    "specserve:spec_decode_num_accepted_tokens_per_pos_total",
    "specserve:spec_decode_acceptance_length",
    "specserve:spec_decode_draft_seconds_total",
    "specserve:spec_decode_verify_seconds_total",
    "specserve:spec_decode_k_choices_total",
    "specserve:spec_decode_k_chosen_total",
    "specserve:spec_decode_speculating_choices_total",
    "specserve:spec_decode_current_k",
    "specserve:spec_decode_speculating_share",
    "specserve:time_to_first_token_seconds",
    "specserve:inter_token_latency_seconds",
    "specserve:e2e_request_latency_seconds",
    "specserve:request_prompt_tokens",
    "specserve:request_generation_tokens",
    "specserve:request_success_total",
    "specserve:request_rejected_total",
}


def scrape(metrics: ServerMetrics) -> list:
    body, content_type = metrics.render()
    assert content_type == CONTENT_TYPE_LATEST
    return [sample for family in text_string_to_metric_families(body.decode())
            for sample in family.samples]


def value(metrics: ServerMetrics, name: str, **labels: str) -> float:
    """The one sample called `name` whose labels include `labels` (besides the base ones)."""
    wanted = {**BASE_LABELS, **labels}
    matches = [s.value for s in scrape(metrics)
               if s.name == name and wanted.items() <= s.labels.items()]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0]


def exposed_name(sample_name: str) -> str:
    """The metric a sample belongs to, as the names above spell it (histograms lose suffixes)."""
    return re.sub(r"_(bucket|count|sum)$", "", sample_name)


@pytest.fixture
def metrics() -> ServerMetrics:
    return ServerMetrics("tiny", "ngram", num_speculative_tokens=3)


def test_exposes_exactly_the_documented_names(metrics):
    metrics.request_rejected(429)
    names = {exposed_name(s.name) for s in scrape(metrics) if not s.name.endswith("_created")}
    assert names == EXPECTED_NAMES


def test_promql_constants_use_exposed_names():
    for expr in (ACCEPTANCE_RATE_PROMQL, BLOCK_EFFICIENCY_PROMQL, MEAN_CHOSEN_K_PROMQL,
                 SPECULATING_SHARE_PROMQL):
        assert set(re.findall(r"specserve:\w+", expr)) <= EXPECTED_NAMES


def test_every_sample_carries_model_and_method(metrics):
    metrics.observe_step(StepStats(accepted_per_position=[1], accepted_lengths=[1]))
    metrics.request_finished(ttft=0.1, inter_token_latencies=[0.01], e2e=0.2,
                             num_prompt_tokens=4, num_generation_tokens=2, finish_reason="stop")
    metrics.request_rejected(400)
    for sample in scrape(metrics):
        assert BASE_LABELS.items() <= sample.labels.items(), sample


def test_method_label_is_none_without_speculation():
    metrics = ServerMetrics("tiny", None, num_speculative_tokens=0)
    samples = scrape(metrics)
    assert samples and all(s.labels["spec_method"] == "none" for s in samples)


def test_step_counters_add_up_and_gauges_keep_the_last_step(metrics):
    metrics.observe_step(StepStats(num_running=3, num_waiting=2, kv_cache_usage=0.5,
                                   num_prompt_tokens=10, num_generation_tokens=4, num_drafts=2,
                                   num_draft_tokens=6, num_accepted_tokens=3, draft_seconds=0.25,
                                   verify_seconds=0.5))
    metrics.observe_step(StepStats(num_running=1, kv_cache_usage=0.25, num_generation_tokens=3,
                                   num_drafts=1, num_draft_tokens=3, num_accepted_tokens=2,
                                   draft_seconds=0.125, verify_seconds=0.25))
    expected = {
        "specserve:num_requests_running": 1,
        "specserve:num_requests_waiting": 0,
        "specserve:kv_cache_usage_perc": 0.25,
        "specserve:engine_steps_total": 2,
        "specserve:prompt_tokens_total": 10,
        "specserve:generation_tokens_total": 7,
        "specserve:spec_decode_num_speculative_tokens": 3,
        "specserve:spec_decode_num_drafts_total": 3,
        "specserve:spec_decode_num_draft_tokens_total": 9,
        "specserve:spec_decode_num_accepted_tokens_total": 5,
        "specserve:spec_decode_draft_seconds_total": 0.375,
        "specserve:spec_decode_verify_seconds_total": 0.75,
    }
    assert {name: value(metrics, name) for name in expected} == expected


def test_chosen_k_counts_add_up_and_gauges_show_the_latest_choices(metrics):
    metrics.observe_step(StepStats(num_k_choices=4, num_speculating_choices=3, sum_chosen_k=7))
    metrics.observe_step(StepStats(num_k_choices=2, num_speculating_choices=1, sum_chosen_k=3))
    metrics.observe_step(StepStats())  # a step that drafted for nobody keeps the gauges
    assert value(metrics, "specserve:spec_decode_k_choices_total") == 6
    assert value(metrics, "specserve:spec_decode_k_chosen_total") == 10
    assert value(metrics, "specserve:spec_decode_speculating_choices_total") == 4
    assert value(metrics, "specserve:spec_decode_current_k") == 1.5
    assert value(metrics, "specserve:spec_decode_speculating_share") == 0.5


@pytest.mark.parametrize("cumulative, expected_total", [
    ([0, 2, 2, 5], 5),
    # a drop means the engine restarted and counts from zero again
    ([4, 1, 3], 7),
])
def test_preemptions_count_the_increase_of_a_running_total(metrics, cumulative, expected_total):
    for num_preemptions in cumulative:
        metrics.observe_step(StepStats(num_preemptions=num_preemptions))
    assert value(metrics, "specserve:num_preemptions_total") == expected_total


def test_prefix_cache_counters_count_tokens_from_running_totals(metrics):
    for queries, hits in [(100, 0), (220, 96), (220, 96), (30, 16)]:  # the last: engine restarted
        metrics.observe_step(StepStats(prefix_cache_queries=queries, prefix_cache_hits=hits))
    assert value(metrics, "specserve:prefix_cache_queries_total") == 250
    assert value(metrics, "specserve:prefix_cache_hits_total") == 112


def test_per_position_counts_are_one_based_and_start_at_zero(metrics):
    name = "specserve:spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(metrics, name, position=str(p)) for p in (1, 2, 3)] == [0, 0, 0]
    metrics.observe_step(StepStats(accepted_per_position=[2, 1, 0]))
    # k may vary per request: a longer draft adds a position beyond the configured k
    metrics.observe_step(StepStats(accepted_per_position=[1, 1, 1, 1]))
    assert [value(metrics, name, position=str(p)) for p in (1, 2, 3, 4)] == [3, 2, 1, 1]


def test_acceptance_length_histogram_has_one_observation_per_draft(metrics):
    name = "specserve:spec_decode_acceptance_length"
    metrics.observe_step(StepStats(accepted_lengths=[0, 2, 3]))
    metrics.observe_step(StepStats(accepted_lengths=[2]))
    assert value(metrics, f"{name}_count") == 4
    assert value(metrics, f"{name}_sum") == 7
    cumulative = [value(metrics, f"{name}_bucket", le=f"{n}.0") for n in range(17)]
    assert cumulative == [1, 1, 3, 4] + [4] * 13
    assert value(metrics, f"{name}_bucket", le="+Inf") == 4


def test_request_finished_fills_latency_and_size_histograms(metrics):
    metrics.request_finished(ttft=0.05, inter_token_latencies=[0.0005, 0.003, 0.02], e2e=0.5,
                             num_prompt_tokens=12, num_generation_tokens=4, finish_reason="stop")
    metrics.request_finished(ttft=None, inter_token_latencies=[], e2e=0.01,
                             num_prompt_tokens=3, num_generation_tokens=0, finish_reason="abort")
    itl = "specserve:inter_token_latency_seconds"
    assert value(metrics, "specserve:time_to_first_token_seconds_count") == 1
    assert value(metrics, f"{itl}_count") == 3
    # sub-10 ms gaps are told apart, not lumped into one bucket
    assert value(metrics, f"{itl}_bucket", le="0.001") == 1
    assert value(metrics, f"{itl}_bucket", le="0.005") == 2
    assert value(metrics, "specserve:e2e_request_latency_seconds_count") == 2
    assert value(metrics, "specserve:e2e_request_latency_seconds_sum") == pytest.approx(0.51)
    assert value(metrics, "specserve:request_prompt_tokens_sum") == 15
    assert value(metrics, "specserve:request_generation_tokens_sum") == 4
    success = "specserve:request_success_total"
    assert value(metrics, success, finished_reason="stop") == 1
    assert value(metrics, success, finished_reason="abort") == 1
    assert value(metrics, success, finished_reason="length") == 0


def test_rejections_are_counted_by_status_code(metrics):
    for code in (400, 400, 503):
        metrics.request_rejected(code)
    assert value(metrics, "specserve:request_rejected_total", code="400") == 2
    assert value(metrics, "specserve:request_rejected_total", code="503") == 1


def test_two_instances_keep_separate_registries():
    first = ServerMetrics("tiny", "ngram", num_speculative_tokens=3)
    second = ServerMetrics("tiny", "ngram", num_speculative_tokens=3)
    first.observe_step(StepStats(num_drafts=5))
    assert value(first, "specserve:spec_decode_num_drafts_total") == 5
    assert value(second, "specserve:spec_decode_num_drafts_total") == 0
