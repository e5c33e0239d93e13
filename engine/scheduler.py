"""Continuous batching: which requests run this step, and how many tokens each computes.

One mechanism covers prefill, chunked prefill, decode and recompute after preemption: a request has
`num_tokens` known tokens of which `num_computed_tokens` have K/V in the cache; a step computes the next
`num_new_tokens` of them, and when that reaches the end, the request samples.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import KVCacheSpec, SchedulerConfig
from engine.request import FinishReason, Request, RequestStatus, TokenLogprobs


@dataclass
class ScheduledRequest:
    request: Request
    # tokens whose K/V this step computes: a prefill chunk, or 1 for a decode step
    num_new_tokens: int

    @property
    def is_sampling(self) -> bool:
        """True when this step reaches the request's last known token, so its logits pick the next one."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    # in batch order: the flattened forward lays their tokens out one request after another
    scheduled: list[ScheduledRequest]
    # sum of num_new_tokens (<= max_num_batched_tokens)
    num_batched_tokens: int
    # requests sent back to waiting this step; their K/V was freed and will be recomputed
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampling_requests(self) -> list[Request]:
        return [s.request for s in self.scheduled if s.is_sampling]


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class RequestUpdate:
    """What one step did for one request: the tokens it emitted and, if it ended, why."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_spec: KVCacheSpec) -> None:
        self.config = config
        self.max_model_len = kv_spec.max_model_len
        self.block_manager = BlockManager(kv_spec.num_blocks, kv_spec.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # preemptions since start (a test hook and, later, a metric)
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def can_accept(self) -> bool:
        return len(self.waiting) < self.config.max_waiting_requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                f"{self.max_model_len}, leaving no room to generate")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> RequestUpdate | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self._finish(request, FinishReason.ABORT)
        return RequestUpdate(request_id, [], None, FinishReason.ABORT)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        # ---- running requests first, oldest first; preempt the newest when blocks run out ----
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            total = request.num_computed_tokens + num_new
            while not self.block_manager.can_allocate(request.request_id, total):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                self.block_manager.allocate(request.request_id, total)
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request itself was preempted: nothing after it is running any more
        # ---- then admit waiting requests in arrival order while budget, seats and blocks last ----
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(request.request_id, num_new):
                break
            self.waiting.popleft()
            self.block_manager.allocate(request.request_id, num_new)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        num_batched = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(scheduled, num_batched, preempted)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the K/V now, rebuild it from prompt + output later."""
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ commit
    def commit(self, output: SchedulerOutput, sampled: list[SampledToken]) -> list[RequestUpdate]:
        """Advance every scheduled request; `sampled` holds one token per sampling request, in order."""
        updates: list[RequestUpdate] = []
        samples = iter(sampled)
        for item in output.scheduled:
            request = item.request
            is_sampling = item.is_sampling
            request.num_computed_tokens += item.num_new_tokens
            if not is_sampling:
                continue
            token = next(samples)
            request.output_token_ids.append(token.token_id)
            if token.logprobs is not None:
                request.output_logprobs.append(token.logprobs)
            finish_reason, stop_reason = self._check_stop(request, token.token_id)
            updates.append(RequestUpdate(
                request.request_id, [token.token_id],
                None if token.logprobs is None else [token.logprobs], finish_reason, stop_reason))
            if finish_reason is not None:
                self.running.remove(request)
                self._finish(request, finish_reason, stop_reason)
        return updates

    def _check_stop(self, request: Request, token_id: int) -> tuple[FinishReason | None, int | None]:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return FinishReason.STOP, None
            if token_id in params.stop_token_ids:
                return FinishReason.STOP, token_id
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH, None
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | None = None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.block_manager.free(request.request_id)
        del self.requests[request.request_id]
