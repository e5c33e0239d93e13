"""engine/scheduler.py driven directly with fake sampled tokens: chunked prefill, admission,
preemption, stop conditions, aborts and block accounting. No model runs here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from engine.config import KVCacheSpec, SchedulerConfig
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step.types import RequestUpdate, SampledTokens

EOS = 0
FILLER = 7  # a token that stops nothing
BLOCK_SIZE = 4


def make_scheduler(*, num_blocks: int = 64, max_model_len: int = 64, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64) -> Scheduler:
    # NOTE: the worker guarantees the pool holds max_model_len tokens; the tests keep that invariant
    assert num_blocks * BLOCK_SIZE >= max_model_len
    # NOTE: a plain pool, caching off: every request here has the same prompt tokens, and these
    # tests count plain blocks (caching's scheduler tests are in test_prefix_caching_engine.py)
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        KVCacheSpec(num_blocks, BLOCK_SIZE, max_model_len, bytes_per_token=1))


def make_request(request_id: str, num_prompt_tokens: int = 4, **params: object) -> Request:
    prompt = [10 + i for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(**params), frozenset({EOS}))


@dataclass
class Step:
    """What one step scheduled and what its commit reported."""

    scheduled: list[tuple[str, int]]  # (request id, num_new_tokens) in batch order
    sampling_ids: list[str]
    preempted_ids: list[str]
    num_batched_tokens: int
    updates: list[RequestUpdate]


def step(scheduler: Scheduler, next_token: Callable[[Request], int] = lambda r: FILLER) -> Step:
    """One engine step with a fake sampler: `next_token` picks each sampling request's token."""
    output = scheduler.schedule()
    scheduled = [(s.request.request_id, s.num_new_tokens) for s in output.scheduled]
    sampling = [s.request for s in output.sampling]
    updates = scheduler.commit(output, [SampledTokens([next_token(r)]) for r in sampling])
    return Step(scheduled, [r.request_id for r in sampling], output.preempted_ids,
                output.num_batched_tokens, updates)


def run_until_done(scheduler: Scheduler, max_steps: int = 200) -> list[Step]:
    steps = []
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return steps
        steps.append(step(scheduler))
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_pool_full(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


# ---------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("num_prompt_tokens, budget, chunks", [
    (10, 4, [4, 4, 2]),
    (8, 4, [4, 4]),
    (5, 64, [5]),
    (9, 1, [1] * 9),
])
def test_long_prompt_is_prefilled_in_chunks(num_prompt_tokens: int, budget: int,
                                            chunks: list[int]) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=budget)
    request = make_request("a", num_prompt_tokens)
    scheduler.add_request(request)
    for i, chunk in enumerate(chunks):
        done = step(scheduler)
        is_last = i == len(chunks) - 1
        assert done.scheduled == [("a", chunk)]
        assert done.num_batched_tokens == chunk
        assert done.sampling_ids == (["a"] if is_last else [])
        assert request.num_computed_tokens == sum(chunks[:i + 1])
        num_blocks = -(-request.num_computed_tokens // BLOCK_SIZE)
        assert len(scheduler.block_manager.block_table("a")) == num_blocks
        assert [u.new_token_ids for u in done.updates] == ([[FILLER]] if is_last else [])
    assert request.output_token_ids == [FILLER]


def test_decode_and_prefill_share_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=6)
    scheduler.add_request(make_request("a", 4))
    step(scheduler)  # a prefilled, now decoding one token a step
    scheduler.add_request(make_request("b", 10))
    done = step(scheduler)
    assert done.scheduled == [("a", 1), ("b", 5)]
    assert done.num_batched_tokens == 6
    assert done.sampling_ids == ["a"]


# ---------------------------------------------------------------- admission


def test_max_num_seqs_caps_running_and_admission_is_fcfs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i, max_tokens in enumerate([1, 3, 3, 3, 3]):
        scheduler.add_request(make_request(f"r{i}", max_tokens=max_tokens))
    admitted: list[str] = []
    while scheduler.num_unfinished:
        running_before = {r.request_id for r in scheduler.running}
        done = step(scheduler)
        assert len(done.scheduled) <= 2
        assert len(scheduler.running) <= 2
        admitted += [rid for rid, _ in done.scheduled if rid not in running_before]
    assert admitted == ["r0", "r1", "r2", "r3", "r4"]
    assert_pool_full(scheduler)


def test_head_of_waiting_that_does_not_fit_blocks_later_ones() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    scheduler.add_request(make_request("big0", 8))
    step(scheduler)  # big0 decodes its 9th token next: 3 of the 4 blocks
    scheduler.add_request(make_request("big1", 8))  # needs 2: does not fit
    scheduler.add_request(make_request("small", 1))  # would fit, but must not jump the queue
    assert step(scheduler).scheduled == [("big0", 1)]
    assert [r.request_id for r in scheduler.waiting] == ["big1", "small"]


# ---------------------------------------------------------------- preemption


def test_newest_running_request_is_preempted_and_resumes() -> None:
    # 4 blocks of 4 tokens: a and b (7-token prompts) hold 2 blocks each; c waits for a seat
    scheduler = make_scheduler(num_blocks=4, max_model_len=16, max_num_seqs=2)
    a, b, c = (make_request("a", 7, max_tokens=6), make_request("b", 7, max_tokens=6),
               make_request("c", 3, max_tokens=2))
    for request in (a, b, c):
        scheduler.add_request(request)
    for _ in range(2):  # prefill, then one decode: both hold 9 tokens, 8 computed
        assert not step(scheduler).preempted_ids
    assert scheduler.block_manager.num_free_blocks == 0

    done = step(scheduler)  # a needs a third block: b, the newest, gives its two back
    assert done.preempted_ids == ["b"]
    assert done.scheduled == [("a", 1)]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.WAITING, 0, 1)
    assert scheduler.block_manager.block_table("b") == []
    assert b.output_token_ids == [FILLER, FILLER]  # output kept; its K/V is recomputed later
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert [r.request_id for r in scheduler.running] == ["a"]

    resumed = next(s for s in run_until_done(scheduler) if ("b", 9) in s.scheduled)
    assert "b" in resumed.sampling_ids  # 7 prompt + 2 output tokens recomputed, then it samples
    assert [len(r.output_token_ids) for r in (a, b, c)] == [6, 6, 2]
    assert all(r.finish_reason == FinishReason.LENGTH for r in (a, b, c))
    assert_pool_full(scheduler)


# ---------------------------------------------------------------- stop conditions


def run_alone(tokens: list[int], num_prompt_tokens: int = 4, max_model_len: int = 64,
              **params: object) -> tuple[Request, RequestUpdate]:
    """Run one request on the given sampled tokens; returns it and its final update."""
    scheduler = make_scheduler(max_model_len=max_model_len)
    request = make_request("a", num_prompt_tokens, **params)
    scheduler.add_request(request)
    feed = iter(tokens)
    while scheduler.num_unfinished:
        updates = step(scheduler, lambda r: next(feed)).updates
    assert_pool_full(scheduler)
    assert request.is_finished and not scheduler.requests
    return request, updates[-1]


STOP_TOKEN = 9
# tokens fed, params -> (output tokens, finish reason, stop reason)
STOP_CASES = [
    ([5, 5, 5, 5], {"max_tokens": 3}, (3, FinishReason.LENGTH, None)),
    ([5, EOS, 5], {}, (2, FinishReason.STOP, None)),
    ([EOS], {"max_tokens": 1}, (1, FinishReason.STOP, None)),
    ([5, STOP_TOKEN, 5], {"stop_token_ids": [STOP_TOKEN]}, (2, FinishReason.STOP, STOP_TOKEN)),
    ([EOS, EOS, 5], {"ignore_eos": True, "max_tokens": 3}, (3, FinishReason.LENGTH, None)),
    ([EOS, STOP_TOKEN], {"ignore_eos": True, "stop_token_ids": [STOP_TOKEN]},
     (2, FinishReason.STOP, STOP_TOKEN)),
    ([EOS, STOP_TOKEN, 5, EOS], {"min_tokens": 3, "stop_token_ids": [STOP_TOKEN]},
     (4, FinishReason.STOP, None)),
    ([EOS, 5, 5, 5], {"min_tokens": 2, "max_tokens": 4}, (4, FinishReason.LENGTH, None)),
]


@pytest.mark.parametrize("tokens, params, expected", STOP_CASES)
def test_stop_conditions(tokens: list[int], params: dict[str, object],
                         expected: tuple[int, FinishReason, int | None]) -> None:
    num_output, finish_reason, stop_reason = expected
    request, last = run_alone(tokens, **params)
    assert request.output_token_ids == tokens[:num_output]
    assert (request.finish_reason, request.stop_reason) == (finish_reason, stop_reason)
    assert (last.finish_reason, last.stop_reason) == (finish_reason, stop_reason)


@pytest.mark.parametrize("num_prompt_tokens, max_model_len, num_output", [(4, 8, 4), (7, 8, 1)])
def test_max_model_len_ends_with_length(num_prompt_tokens: int, max_model_len: int,
                                        num_output: int) -> None:
    request, last = run_alone([5] * 10, num_prompt_tokens, max_model_len, max_tokens=None)
    assert request.num_output_tokens == num_output
    assert request.num_tokens == max_model_len
    assert last.finish_reason == FinishReason.LENGTH


# ---------------------------------------------------------------- aborts, leaks, rejections


def test_abort_waiting_and_running_frees_blocks() -> None:
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=4)
    running, waiting = make_request("run", 10), make_request("wait")
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler)  # "run" is mid-prefill and holds a block; "wait" has no seat
    assert scheduler.block_manager.num_free_blocks < scheduler.block_manager.num_blocks

    for request in (waiting, running):
        update = scheduler.abort(request.request_id)
        assert update is not None and update.finish_reason == FinishReason.ABORT
        assert (request.status, request.finish_reason) == (RequestStatus.FINISHED,
                                                            FinishReason.ABORT)
    assert scheduler.abort("run") is None
    assert not scheduler.waiting and not scheduler.running and scheduler.num_unfinished == 0
    assert_pool_full(scheduler)
    assert scheduler.schedule().is_empty


def test_many_requests_leave_no_leaks() -> None:
    scheduler = make_scheduler(num_blocks=8, max_model_len=32, max_num_seqs=4,
                               max_num_batched_tokens=8)
    requests = [make_request(f"r{i}", 3 + 2 * i, max_tokens=4 + i % 3) for i in range(8)]
    for request in requests:
        scheduler.add_request(request)
    steps = run_until_done(scheduler)
    assert any(s.preempted_ids for s in steps)  # the pool is small enough to force preemption
    assert all(s.num_batched_tokens <= 8 for s in steps)
    assert [r.num_output_tokens for r in requests] == [4 + i % 3 for i in range(8)]
    assert_pool_full(scheduler)


@pytest.mark.parametrize("num_prompt_tokens", [16, 17])
def test_prompt_filling_max_model_len_is_rejected(num_prompt_tokens: int) -> None:
    scheduler = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("a", num_prompt_tokens))
    assert scheduler.num_unfinished == 0


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(ValueError, match="already in the engine"):
        scheduler.add_request(make_request("a"))
    assert len(scheduler.waiting) == 1
