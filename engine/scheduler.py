"""Continuous batching: which requests run this step, and how many tokens each computes.

One mechanism covers prefill, chunked prefill, decode and recompute after preemption: a request has
`num_tokens` known tokens of which `num_computed_tokens` have K/V in the cache; a step computes the next
`num_new_tokens` of them, and when that reaches the end, the request samples.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

import torch

from engine.config import KVCacheSpec, SchedulerConfig
from engine.draft_tree import row_parents
from engine.failures import run_isolated
from engine.kv.block_manager import BlockManager
from engine.request import FinishReason, Request, RequestStatus
from engine.request_report import RequestReport
from engine.step.layout import DraftProposal, DraftTokens, StepLayout
from engine.step.scheduler_output import SchedulerOutput
from engine.step.types import (
    ForwardInput,
    RequestUpdate,
    SampledTokens,
    ScheduledRequest,
    SequenceRows,
)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_spec: KVCacheSpec,
                 device: torch.device = torch.device("cpu"),
                 block_manager: BlockManager | None = None) -> None:
        """`block_manager`: the target's pool (the worker's runner owns it); None, a plain pool of
        kv_spec's size without prefix caching (scheduler tests)."""
        self.config = config
        self.max_model_len = kv_spec.max_model_len
        # where the step layout's tensors live (the target's device)
        self.device = device
        self.block_manager = block_manager or BlockManager(kv_spec.num_blocks, kv_spec.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # drafts proposed for running requests, verified (and dropped) when the request next samples
        self.drafts: dict[str, DraftProposal] = {}
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
        return self._end(request_id, FinishReason.ABORT)

    def fail(self, request_id: str, error: str) -> RequestUpdate | None:
        """End a request the step could not serve (its grammar, drafts or logits broke): its blocks
        are freed and its update carries `error`; the other requests go on."""
        return self._end(request_id, FinishReason.ERROR, error)

    def _end(self, request_id: str, reason: FinishReason,
             error: str | None = None) -> RequestUpdate | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self._finish(request, reason)
        return RequestUpdate(request_id, [], None, reason, report=RequestReport.of(request),
                             error=error)

    def update_draft_token_ids(self, drafts: DraftTokens) -> None:
        """Take the drafts proposed for the next step; an empty proposal clears the request's draft.
        Requests that are no longer running are skipped (their drafts have nothing to verify)."""
        for request_id, proposal in drafts.proposals.items():
            request = self.requests.get(request_id)
            if proposal.token_ids and request is not None and request.status == RequestStatus.RUNNING:
                self.drafts[request_id] = proposal
            else:
                self.drafts.pop(request_id, None)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        # ---- running requests first, oldest first; preempt the newest when blocks run out ----
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            item = self._plan(request, budget)
            total = request.num_computed_tokens + item.num_new_tokens
            if item.num_draft_tokens and not self.block_manager.can_allocate(request.request_id,
                                                                               total):
                # NOTE: speculation never costs a preemption: drop this step's drafts first
                self.drafts.pop(request.request_id, None)
                item = self._plan(request, budget)
                total = request.num_computed_tokens + item.num_new_tokens
            while not self.block_manager.can_allocate(request.request_id, total):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                self.block_manager.allocate(request.request_id, total)
                scheduled.append(item)
                budget -= item.num_new_tokens
                index += 1
                continue
            break  # the request itself was preempted: nothing after it is running any more
        # ---- then admit waiting requests in arrival order while budget, seats and blocks last ----
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            known = request.token_ids_between(0, request.num_tokens)  # prompt (+ output, if preempted)
            salt = request.prefix_cache_tenant
            # NOTE: start computing after the cached prefix (0 without caching)
            request.num_computed_tokens = len(
                self.block_manager.lookup_prefix(known, salt)) * self.block_manager.block_size
            item = self._plan(request, budget)
            total = request.num_computed_tokens + item.num_new_tokens
            if not self.block_manager.can_allocate_with_prefix(known, salt, total):
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            num_cached = self.block_manager.allocate_with_prefix(request.request_id, known, salt,
                                                                 total)
            if not request.num_preemptions:  # NOTE: what the prompt found, as vLLM reports it
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(item)
            budget -= item.num_new_tokens
        num_batched = self.config.max_num_batched_tokens - budget
        layout = StepLayout.build(scheduled, self.device)
        return SchedulerOutput(scheduled, num_batched, layout,
                               self._forward_input(scheduled, layout), preempted)

    def _forward_input(self, scheduled: list[ScheduledRequest],
                       layout: StepLayout) -> ForwardInput:
        """The target pass: each request's next known tokens, then its drafts, from the position
        its computed K/V ends at, with its block table."""
        sequences = []
        for item in scheduled:
            request = item.request
            start = request.num_computed_tokens
            known = request.token_ids_between(start, start + item.num_known_tokens)
            parents = None if item.draft_parents is None else row_parents(
                item.num_known_tokens, item.draft_parents, item.num_draft_tokens)
            sequences.append(SequenceRows(request.request_id, start,
                                          known + item.draft_token_ids, parents,
                                          list(self.block_manager.block_table(request.request_id))))
        return ForwardInput(sequences, layout.logits_rows)

    def _plan(self, request: Request, budget: int) -> ScheduledRequest:
        """The next chunk of known tokens that fits the budget, then as many drafts as still fit."""
        num_known = min(request.num_tokens - request.num_computed_tokens, budget)
        is_sampling = request.num_computed_tokens + num_known == request.num_tokens
        draft = self.drafts.get(request.request_id)
        if not is_sampling or draft is None:
            return ScheduledRequest(request, num_known, is_sampling)
        draft = draft.first(max(0, budget - num_known))
        return ScheduledRequest(request, num_known + len(draft.token_ids), is_sampling,
                                draft.token_ids, draft.probs if draft.token_ids else None,
                                draft.parents)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the K/V now, rebuild it from prompt + output later."""
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        self.drafts.pop(request.request_id, None)
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ commit
    def commit(self, output: SchedulerOutput, sampled: list[SampledTokens]) -> list[RequestUpdate]:
        """Advance every scheduled request; `sampled` holds one entry per sampling request, in order.

        K/V of the accepted drafts is already in the cache, so num_computed_tokens moves past them;
        the slots of rejected drafts are simply overwritten later. A stop condition met inside an
        accepted block ends the request there and drops the rest of the block. A request whose
        sampling failed, or whose commit raises (its grammar refuses the tokens), ends with an error
        alone.
        """
        updates: list[RequestUpdate] = []
        samples = iter(sampled)
        for item in output.scheduled:
            request = item.request
            if not item.is_sampling:
                request.num_computed_tokens += item.num_known_tokens
                self._cache_full_blocks(request)
                continue
            kept = next(samples)
            error = kept.error or run_isolated(
                lambda: updates.append(self._commit_sampled(item, kept)), request.request_id,
                "commit")
            if error is not None:
                updates.append(self.fail(request.request_id, error))
        return updates

    def _commit_sampled(self, item: ScheduledRequest, kept: SampledTokens) -> RequestUpdate:
        request = item.request
        request.num_computed_tokens += item.num_known_tokens
        num_accepted = len(kept.token_ids) - 1
        request.num_computed_tokens += num_accepted
        # NOTE: the step verified the draft (or what fit of it); it is spent either way
        self.drafts.pop(request.request_id, None)
        update = RequestUpdate(request.request_id, [], [] if kept.logprobs else None)
        for position, token_id in enumerate(kept.token_ids):
            request.output_token_ids.append(token_id)
            update.new_token_ids.append(token_id)
            if kept.logprobs:
                request.output_logprobs.append(kept.logprobs[position])
                update.new_logprobs.append(kept.logprobs[position])
            update.finish_reason, update.stop_reason = self._check_stop(request, token_id)
            if update.finish_reason is not None:
                break
        if request.grammar is not None:
            request.grammar.commit(update.new_token_ids)
        self._cache_full_blocks(request)
        request.spec_stats.observe(item.num_draft_tokens, num_accepted, len(update.new_token_ids))
        if update.finish_reason is not None:
            self.running.remove(request)
            self._finish(request, update.finish_reason, update.stop_reason)
            update.report = RequestReport.of(request)
        return update

    @property
    def decoding(self) -> list[Request]:
        """Running requests whose next step is a decode step (all known tokens but the last computed)."""
        return [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]

    def num_prefill_tokens_next_step(self, num_decoding: int) -> int:
        """Prompt (or recompute) tokens the next step will likely compute beside `num_decoding`
        decoding requests: running requests mid-prefill, then waiting ones while seats last, all
        within the token budget. Adaptive speculation prices drafts against this load."""
        pending = [r for r in self.running if r.num_computed_tokens < r.num_tokens - 1]
        seats = max(0, self.config.max_num_seqs - len(self.running))
        pending += islice(self.waiting, seats)
        total = sum(r.num_tokens - r.num_computed_tokens for r in pending)
        return min(total, max(0, self.config.max_num_batched_tokens - num_decoding))

    def draft_budget(self, request: Request, k: int) -> int:
        """Drafts worth proposing: no more than the tokens the request may still emit, minus the
        one verification adds, and never past max_model_len."""
        if request.params.num_speculative_tokens is not None:
            k = min(k, request.params.num_speculative_tokens)
        remaining = self.max_model_len - request.num_tokens
        if request.params.max_tokens is not None:
            remaining = min(remaining, request.params.max_tokens - request.num_output_tokens)
        return max(0, min(k, remaining - 1))

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

    def _cache_full_blocks(self, request: Request) -> None:
        """Offer the prefix cache the request's full blocks of committed tokens with K/V, before a
        finished request's blocks are freed (so the next turn of a chat finds them). NOTE: K/V of
        accepted drafts past a stop sits in the cache but not in the tokens: it is left out."""
        pool = self.block_manager
        if pool.enable_prefix_caching:
            num_valid = min(request.num_computed_tokens, request.num_tokens)
            # NOTE: the token list is built only when a new block filled (once per block_size
            # tokens), not every step
            if num_valid // pool.block_size > pool.num_chained_blocks(request.request_id):
                pool.register_full_blocks(request.request_id,
                                          request.token_ids_between(0, num_valid))

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | None = None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.block_manager.free(request.request_id)
        self.drafts.pop(request.request_id, None)
        del self.requests[request.request_id]
