"""One API request's life in the engine, and nothing of OpenAI's response shapes.

A request becomes one engine request per prompt and choice. Their deltas are folded into each choice's
CompletionTracker by one consumer, in the order they arrive, so a choice finishes exactly once and its
pieces (text, tokens, logprobs) reach the formatter in order. The waiting-queue count, per-choice
metrics and aborts live here too: however the request ends (finished, stop string, engine dead,
client gone), the engine is left with nothing of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.output_processor import CompletionTracker, StreamPiece
from engine.request_report import RequestReport
from engine.sampling_params import SamplingParams
from engine.spec_stats import SpecStats
from engine.step.types import RequestUpdate
from server.api_responses import random_id
from server.engine_client import (
    EngineClient,
    EngineDeadError,
    RequestFailedError,
    RequestRejectedError,
)
from server.errors import ApiError
from server.metrics import ServerMetrics


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) answer was ready; nobody reads a reply."""


class WaitingRequests:
    """Admission: choices sent to the engine that have no token yet, the waiting queue's length."""

    def __init__(self, max_waiting: int, metrics: ServerMetrics) -> None:
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.num_waiting = 0

    def admit(self, num_prompts: int, n: int) -> None:
        num_new = num_prompts * n
        if num_new > self.max_waiting:  # NOTE: a 429 would invite retries that never pass
            raise ApiError(400, f"this request asks for {num_new} completions ({num_prompts} "
                                f"prompts x n {n}); this server queues at most "
                                f"{self.max_waiting}", param="n")
        if self.num_waiting + num_new > self.max_waiting:
            self.metrics.request_rejected(429)
            raise ApiError(429, f"the server is at capacity ({self.num_waiting} requests waiting); "
                                "retry shortly", type="RateLimitError", retry_after=1)


@dataclass
class Choice:
    """One engine request: one prompt's one completion, and its timings for the metrics."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tracker: CompletionTracker
    queue: asyncio.Queue | None = None
    # counted in WaitingRequests (sent, no token yet)
    is_waiting: bool = False
    # its last piece (the one with finish_reason) has been taken
    is_done: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass
class ChoicePiece:
    """What a formatter turns into a stream chunk: one choice's new text, tokens and logprobs."""

    index: int
    piece: StreamPiece


class Generation:
    """The choices of one API request. `submit()`, then `pieces()` (a stream) or `run_to_end()`;
    `close()` always, which aborts whatever has not finished."""

    def __init__(self, client: EngineClient, tokenizer: Any, metrics: ServerMetrics,
                 waiting: WaitingRequests, prompts: list[list[int]],
                 params: list[SamplingParams], n: int, cache_salt: str | None = None) -> None:
        self.client = client
        self.metrics = metrics
        self.waiting = waiting
        self.n = n
        self.cache_salt = cache_salt
        base_id = random_id("req")
        self.choices: list[Choice] = []
        for prompt_index, (prompt, prompt_params) in enumerate(zip(prompts, params)):
            for j in range(n):
                child = prompt_params.for_completion(j)
                self.choices.append(Choice(prompt_index * n + j, f"{base_id}-{prompt_index}-{j}",
                                           prompt, child,
                                           CompletionTracker(tokenizer, prompt, child)))
        self._merged: asyncio.Queue[tuple[Choice, RequestUpdate | Exception]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle
    async def submit(self) -> None:
        if not self.client.is_alive:
            raise ApiError(503, "the engine is not running", type="ServiceUnavailableError")
        self.waiting.admit(len(self.choices) // self.n, self.n)
        try:
            for choice in self.choices:
                choice.queue = await self.client.add_request(
                    choice.request_id, choice.prompt_token_ids, choice.params, self.cache_salt)
                choice.is_waiting = True
                self.waiting.num_waiting += 1
                self._pumps.append(asyncio.ensure_future(self._pump(choice)))
        except EngineDeadError as error:
            self.close()
            raise ApiError(503, str(error), type="ServiceUnavailableError") from error
        except RequestRejectedError as error:  # it could not even be sent to the engine
            self.close()
            raise ApiError(400, str(error)) from error

    async def pieces(self) -> AsyncIterator[ChoicePiece]:
        """Every non-empty piece of every choice, in arrival order, until all have finished;
        raises ApiError when the engine refused a request or died."""
        num_unfinished = sum(not c.is_done for c in self.choices)
        while num_unfinished:
            choice, item = await self._merged.get()
            if choice.is_done:
                continue  # deltas after a stop string ended it here, until the abort lands
            if isinstance(item, Exception):
                raise self._error(choice, item)
            self._fold(choice, item)
            piece = choice.tracker.take_stream_piece()
            if piece.finish_reason is not None:
                choice.is_done = True
                num_unfinished -= 1
            if not piece.is_empty:
                yield ChoicePiece(choice.index, piece)

    async def run_to_end(self, is_disconnected: Callable[[], Any]) -> None:
        """Wait for every choice; raises ClientDisconnected if the client goes away first."""
        async def consume() -> None:
            async for _ in self.pieces():
                pass

        async def watch_client() -> None:
            while not await is_disconnected():
                await asyncio.sleep(0.25)

        work = asyncio.ensure_future(consume())
        # NOTE: a cancelled task holds a CancelledError that asyncio logs unless someone reads it
        work.add_done_callback(lambda future: future.cancelled() or future.exception())
        watcher = asyncio.ensure_future(watch_client())
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise ClientDisconnected
            work.result()
        finally:
            watcher.cancel()
            work.cancel()

    def close(self) -> None:
        """Abort every choice that has not finished; idempotent."""
        for task in self._pumps:
            task.cancel()
        unfinished = [c for c in self.choices if c.queue is not None and not c.tracker.finished]
        for choice in unfinished:
            self._end_waiting(choice)
            choice.tracker.finish_reason = "abort"
            self._record(choice)
        self.client.abort_soon([c.request_id for c in unfinished])

    @property
    def is_finished(self) -> bool:
        return all(c.is_done for c in self.choices)

    # ------------------------------------------------------------------ results
    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(c.prompt_token_ids) for c in self.choices[::self.n])

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held, per prompt (the most any of its choices found)."""
        return sum(max(c.tracker.num_cached_tokens for c in self.choices[i:i + self.n])
                   for i in range(0, len(self.choices), self.n))

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.tracker.token_ids) for c in self.choices)

    @property
    def num_spec_tokens(self) -> int:
        """The most drafts one step could verify for this request: the server's k, or the
        request's own smaller one (`speculative_decoding.num_speculative_tokens`)."""
        engine_k = self.client.ready.num_speculative_tokens if self.client.ready.speculative_method \
            else 0
        own = [c.params.num_speculative_tokens for c in self.choices]
        return max((engine_k if k is None else min(k, engine_k) for k in own), default=engine_k)

    def reports(self) -> list[RequestReport]:
        """What the engine reported of each choice that has ended with a report."""
        return [c.tracker.report for c in self.choices if c.tracker.report is not None]

    def spec_stats(self) -> SpecStats:
        """Speculation over every choice (zero drafts when speculation is off)."""
        return SpecStats.merged([report.spec_stats for report in self.reports()])

    # ------------------------------------------------------------------ internals
    async def _pump(self, choice: Choice) -> None:
        """Forward the choice's engine queue into the merged one, untouched, until its last item."""
        while True:
            item = await choice.queue.get()
            self._merged.put_nowait((choice, item))
            if isinstance(item, Exception) or item.finish_reason is not None:
                return

    def _fold(self, choice: Choice, delta: RequestUpdate) -> None:
        now = time.perf_counter()
        if delta.new_token_ids:
            if choice.first_token_at is None:
                choice.first_token_at = now
                self._end_waiting(choice)
            else:
                choice.inter_token_latencies.append(now - choice.last_token_at)
            choice.last_token_at = now
        choice.tracker.apply(delta)
        if choice.tracker.take_abort():
            self.client.abort_soon([choice.request_id])
        if choice.tracker.finished:
            self._end_waiting(choice)
            self._record(choice)

    def _error(self, choice: Choice, error: Exception) -> ApiError:
        self._end_waiting(choice)
        if isinstance(error, RequestRejectedError):
            return ApiError(400, str(error))
        if isinstance(error, RequestFailedError):  # the engine ended it: no abort to send
            choice.tracker.finish_reason = "error"
            self._record(choice)
            return ApiError(500, f"the engine could not finish this request: {error}",
                            code="request_failed")
        return ApiError(503, str(error), type="ServiceUnavailableError")

    def _end_waiting(self, choice: Choice) -> None:
        if choice.is_waiting:
            choice.is_waiting = False
            self.waiting.num_waiting -= 1

    def _record(self, choice: Choice) -> None:
        self.metrics.request_finished(
            ttft=None if choice.first_token_at is None else choice.first_token_at - choice.arrival,
            inter_token_latencies=choice.inter_token_latencies,
            e2e=time.perf_counter() - choice.arrival,
            num_prompt_tokens=len(choice.prompt_token_ids),
            num_generation_tokens=len(choice.tracker.token_ids),
            finish_reason=choice.tracker.finish_reason)
