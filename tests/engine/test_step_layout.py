"""engine/step/layout.py and the scheduler's drafts: where a step's rows, drafts and sampling tensors
sit, and the life of a draft from `update_draft_token_ids` to its verification (or its drop on
preemption, abort and finish). No model runs here."""

from __future__ import annotations

import pytest
import torch

from engine.config import KVCacheSpec, SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step.layout import DraftProposal, DraftTokens, StepLayout
from engine.step.rejection import RejectionSampler
from engine.step.types import SampledTokens, ScheduledRequest

EOS = 0
BLOCK_SIZE = 4
VOCAB = 10


def make_request(request_id: str, num_prompt_tokens: int = 4, **params: object) -> Request:
    return Request(request_id, list(range(10, 10 + num_prompt_tokens)), SamplingParams(**params),
                   frozenset({EOS}))


def make_scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens),
                     KVCacheSpec(num_blocks, BLOCK_SIZE, 64, bytes_per_token=1))


def decoding(scheduler: Scheduler, *request_ids: str) -> None:
    """Admit and prefill the requests; each then decodes one token a step."""
    for request_id in request_ids:
        scheduler.add_request(make_request(request_id))
    output = scheduler.schedule()
    scheduler.commit(output, [SampledTokens([7]) for _ in output.sampling])


def draft(scheduler: Scheduler, **drafts: list[int]) -> None:
    scheduler.update_draft_token_ids(DraftTokens({rid: DraftProposal(ids)
                                                  for rid, ids in drafts.items()}))


# ---------------------------------------------------------------- the layout


def test_layout_of_a_mixed_step() -> None:
    """A mid-prefill (4 tokens), B verifying 2 drafts, C decoding with k = 0 (the module's diagram)."""
    a, b, c = make_request("a", 8), make_request("b"), make_request("c", temperature=0.0)
    items = [ScheduledRequest(a, 4), ScheduledRequest(b, 3, True, [5, 6]),
             ScheduledRequest(c, 1, True)]
    layout = StepLayout.build(items, torch.device("cpu"))
    assert layout.token_starts == [0, 4, 7, 8]
    assert [item.request.request_id for item in layout.sampling] == ["b", "c"]
    assert layout.logits_indices.tolist() == [4, 5, 6, 7]
    assert layout.logits_starts == [0, 3]
    assert [list(layout.rows_of(i)) for i in range(2)] == [[0, 1, 2], [3]]
    assert layout.draft_token_ids.tolist() == [5, 6]
    assert layout.cu_num_draft_tokens.tolist() == [2, 2]
    assert layout.max_num_draft_tokens == 2 and layout.num_rows == 4
    assert layout.draft_probs is None
    metadata = layout.sampling_metadata
    assert metadata.request_of_row.tolist() == [0, 0, 0, 1]
    assert metadata.is_greedy.tolist() == [False, True]
    assert not metadata.is_all_greedy and metadata.has_greedy


def test_sampling_tensors_per_request() -> None:
    requests = [make_request("t", temperature=0.7, top_k=5, top_p=0.9),
                make_request("g", temperature=0.0, top_k=5, top_p=0.5),  # greedy: nothing applies
                make_request("s", seed=3, top_k=-1)]
    items = [ScheduledRequest(r, 1 + k, True, [1] * k) for r, k in zip(requests, [1, 0, 2])]
    metadata = StepLayout.build(items, torch.device("cpu")).sampling_metadata
    assert metadata.temperature.tolist() == pytest.approx([0.7, 1.0, 1.0])
    assert metadata.top_k.tolist() == [5, 0, 0]
    assert metadata.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert metadata.max_top_k == 5 and metadata.has_top_p
    # the seeded request's 2k + 1 uniforms: drafts 1..2 of 3, then rows 3..5 of 6 (after 3 drafts)
    assert [(r.request_id, k) for r, k in metadata.seeded] == [("s", 2)]
    assert metadata.seeded_uniform_index.tolist() == [1, 2, 3 + 3, 3 + 4, 3 + 5]


def test_min_tokens_bans_pairs_cover_only_rows_before_it() -> None:
    request = make_request("m", min_tokens=2, stop_token_ids=[3])
    request.output_token_ids = [7]  # output token 1 is next: rows 0 (token 1) banned, row 1 not
    layout = StepLayout.build([ScheduledRequest(request, 3, True, [4, 5])], torch.device("cpu"))
    rows, token_ids = layout.sampling_metadata.banned
    assert list(zip(rows.tolist(), token_ids.tolist())) == [(0, EOS), (0, 3)]


def test_draft_probs_rows_follow_the_drafts() -> None:
    q = torch.softmax(torch.randn(3, VOCAB), dim=-1)
    items = [ScheduledRequest(make_request("a"), 3, True, [1, 2], q[:2]),
             ScheduledRequest(make_request("g", temperature=0.0), 2, True, [4]),  # greedy: no q
             ScheduledRequest(make_request("b"), 2, True, [5], q[2:])]
    layout = StepLayout.build(items, torch.device("cpu"))
    assert torch.equal(layout.draft_probs[[0, 1, 3]], q)  # row 2 (greedy) is never read


def test_a_seeded_request_keys_its_2k_plus_1_uniforms_and_leaves_its_generator() -> None:
    """Its uniforms are keyed by (seed, output position, stream) (engine/sample/keyed_random.py),
    so sampling draws nothing from the request's generator (left to its drafter)."""
    request = make_request("s", seed=11)
    request.output_token_ids = [4, 4]
    neighbour = make_request("n")
    items = [ScheduledRequest(neighbour, 2, True, [1]),
             ScheduledRequest(request, 3, True, [2, 3])]
    layout = StepLayout.build(items, torch.device("cpu"))
    seeds, positions, streams = layout.sampling_metadata.seeded_uniform_keys
    # acceptance uniforms of drafts 1 and 2 (tried at positions 2, 3), then rows 0..2's samples
    assert list(zip(seeds, positions, streams)) == [(11, 2, 1), (11, 3, 1), (11, 2, 0),
                                                    (11, 3, 0), (11, 4, 0)]
    before = request.generator.get_state()
    RejectionSampler()(torch.randn(5, VOCAB), layout)
    assert torch.equal(request.generator.get_state(), before)


def test_request_carries_no_draft() -> None:
    request = make_request("a")
    assert not hasattr(request, "draft_token_ids") and not hasattr(request, "draft_probs")


# ---------------------------------------------------------------- the scheduler's drafts


def test_drafts_are_scheduled_then_dropped_at_commit() -> None:
    scheduler = make_scheduler()
    decoding(scheduler, "a", "b")
    draft(scheduler, a=[1, 2, 3])
    output = scheduler.schedule()
    assert [(i.request.request_id, i.num_new_tokens, i.draft_token_ids) for i in output.scheduled] \
        == [("a", 4, [1, 2, 3]), ("b", 1, [])]
    assert output.layout.draft_token_ids.tolist() == [1, 2, 3]
    scheduler.commit(output, [SampledTokens([1, 9]), SampledTokens([7])])
    assert scheduler.drafts == {}
    assert [i.num_draft_tokens for i in scheduler.schedule().scheduled] == [0, 0]


def test_drafts_are_cut_to_the_budget_with_their_probs() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=3)
    decoding(scheduler, "a")
    q = torch.softmax(torch.randn(4, VOCAB), dim=-1)
    scheduler.update_draft_token_ids(DraftTokens({"a": DraftProposal([1, 2, 3, 4], q)}))
    [item] = scheduler.schedule().scheduled
    assert item.draft_token_ids == [1, 2] and torch.equal(item.draft_probs, q[:2])


def test_an_empty_proposal_clears_and_a_missing_one_keeps() -> None:
    scheduler = make_scheduler()
    decoding(scheduler, "a", "b")
    draft(scheduler, a=[1, 2], b=[3])
    draft(scheduler, a=[])  # b is left out: its draft stands
    assert list(scheduler.drafts) == ["b"]


def test_drafts_for_unknown_or_waiting_requests_are_ignored() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("w"))
    draft(scheduler, w=[1], ghost=[2])
    assert scheduler.drafts == {}


@pytest.mark.parametrize("how", ["abort", "finish", "preempt"])
def test_drafts_are_dropped_when_the_request_stops_running(how: str) -> None:
    scheduler = make_scheduler(num_blocks=16)
    decoding(scheduler, "a", "b")
    draft(scheduler, a=[1], b=[2])
    if how == "abort":
        scheduler.abort("b")
    elif how == "finish":
        output = scheduler.schedule()
        scheduler.commit(output, [SampledTokens([1, EOS]), SampledTokens([2, EOS])])
    else:
        scheduler._preempt(scheduler.running.pop())
    assert "b" not in scheduler.drafts
