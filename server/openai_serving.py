"""Completions and chat completions: from a validated request to engine requests (one per prompt and
choice), and from their token deltas back to an OpenAI response or SSE stream.

Text is decoded here, in the HTTP process (engine/output_processor.py): a stop string ends a choice
here and aborts it in the engine. A client that goes away aborts its requests, which frees their KV
blocks. Every way a request can end (finished, stopped, rejected, engine dead, client gone) leaves the
engine with nothing of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.messages import TokenDelta
from engine.output_processor import CompletionTracker
from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.spec_stats import SpecStats
from server.api_requests import ChatCompletionRequest, CompletionRequest
from server.api_responses import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ResponseMetrics,
    TopLogprob,
    Usage,
    random_id,
)
from server.engine_client import EngineClient, EngineDeadError, RequestRejectedError
from server.errors import ApiError
from server.metrics import ServerMetrics


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) answer was ready; nobody reads a reply."""


@dataclass
class Choice:
    """One engine request: one prompt's one completion, and its timings for the metrics."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tracker: CompletionTracker
    queue: asyncio.Queue | None = None
    # still counted in OpenAIServing.num_waiting (sent, no token yet)
    is_waiting: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)


class OpenAIServing:
    def __init__(self, client: EngineClient, tokenizer: Any, served_model_name: str,
                 metrics: ServerMetrics, max_waiting_requests: int) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.max_model_len = client.ready.max_model_len
        self.vocab_size = client.ready.vocab_size
        self.engine_k = client.ready.num_speculative_tokens
        # choices sent to the engine that have not produced a token yet: the waiting queue's length
        self.num_waiting = 0

    # ------------------------------------------------------------------ entry points
    async def completions(self, body: CompletionRequest,
                          is_disconnected: Callable[[], Any]) -> CompletionResponse | AsyncIterator[str]:
        self._check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (no prompt logprobs)",
                           param="echo")
        prompts = [await self._tokenize_prompt(p) for p in body.prompts]
        params = [self._sampling_params(body, ids, body.max_tokens) for ids in prompts]
        choices = await self._submit(prompts, params, body.n)
        echo = [self._decode(ids) if body.echo else "" for ids in prompts]
        if body.stream:
            return self._stream(choices, body.include_usage, chat=False, echo=echo)
        await self._run_to_end(choices, is_disconnected)
        return CompletionResponse(
            model=self.served_model_name,
            choices=[CompletionChoice(index=c.index, text=echo[c.index // body.n] + c.tracker.text,
                                      logprobs=self._completion_logprobs(c.tracker.logprobs),
                                      finish_reason=c.tracker.finish_reason) for c in choices],
            usage=self._usage(choices, body.n), metrics=self._metrics(choices))

    async def chat(self, body: ChatCompletionRequest,
                   is_disconnected: Callable[[], Any]) -> ChatCompletionResponse | AsyncIterator[str]:
        self._check_model(body.model)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(body.template_messages(), tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as error:  # jinja errors: the conversation does not fit the template
            raise ApiError(400, f"the chat template rejected these messages: {error}",
                           param="messages") from error
        prompt = await self._encode(text, "messages", add_special_tokens=False)
        params = self._sampling_params(body, prompt, body.requested_max_tokens)
        choices = await self._submit([prompt], [params], body.n)
        if body.stream:
            return self._stream(choices, body.include_usage, chat=True, echo=[""])
        await self._run_to_end(choices, is_disconnected)
        return ChatCompletionResponse(
            model=self.served_model_name,
            choices=[ChatCompletionChoice(
                index=c.index, message=ChatResponseMessage(content=c.tracker.text),
                logprobs=self._chat_logprobs(c.tracker.logprobs),
                finish_reason=c.tracker.finish_reason) for c in choices],
            usage=self._usage(choices, body.n), metrics=self._metrics(choices))

    # ------------------------------------------------------------------ validation
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model",
                           code="model_not_found", type="NotFoundError")

    async def _tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send token ids", param="prompt")
            return await self._encode(prompt, "prompt")
        self._check_token_ids(prompt, "prompt")
        return prompt

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        if token_ids and max(token_ids) >= self.vocab_size:
            raise ApiError(400, f"every token id in {param} must be below the vocabulary size "
                                f"{self.vocab_size}", param=param)

    async def _encode(self, text: str, param: str, **kwargs: Any) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # lone surrogates from JSON "\udcff" escapes
            raise ApiError(400, f"{param} is not valid Unicode text: {error}", param=param) from None
        # NOTE: in a thread: a megabyte of text takes about a second to tokenize, and the fast
        # tokenizer releases the GIL, so other requests' streams keep flowing meanwhile
        return await asyncio.to_thread(self.tokenizer.encode, text, **kwargs)

    def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest,
                         prompt: list[int], max_tokens: int | None) -> SamplingParams:
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this model's context is "
                                f"{self.max_model_len} tokens, leaving no room to generate",
                           param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
                                f"exceeds the context of {self.max_model_len} tokens",
                           param="max_tokens", code="context_length_exceeded")
        self._check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        spec = body.speculative_decoding
        if spec is not None and (spec.num_speculative_tokens or 0) > self.engine_k:
            raise ApiError(400, f"num_speculative_tokens {spec.num_speculative_tokens} is above "
                                f"this server's {self.engine_k}",
                           param="speculative_decoding.num_speculative_tokens")
        try:
            return body.to_sampling_params(room)
        except ValueError as error:
            raise ApiError(400, str(error)) from error

    # ------------------------------------------------------------------ engine requests
    async def _submit(self, prompts: list[list[int]], params: list[SamplingParams],
                      n: int) -> list[Choice]:
        if not self.client.is_alive:
            raise ApiError(503, "the engine is not running", type="ServiceUnavailableError")
        num_new = len(prompts) * n
        if num_new > self.max_waiting_requests:  # NOTE: a 429 would invite retries that never pass
            raise ApiError(400, f"this request asks for {num_new} completions ({len(prompts)} "
                                f"prompts x n {n}); this server queues at most "
                                f"{self.max_waiting_requests}", param="n")
        if self.num_waiting + num_new > self.max_waiting_requests:
            self.metrics.request_rejected(429)
            raise ApiError(429, f"the server is at capacity ({self.num_waiting} requests waiting); "
                                "retry shortly", type="RateLimitError", retry_after=1)
        base_id = random_id("req")
        choices = []
        for prompt_index, (prompt, prompt_params) in enumerate(zip(prompts, params)):
            for j in range(n):
                child = dataclasses.replace(prompt_params, n=1, seed=None if prompt_params.seed
                                            is None else prompt_params.seed + j)
                choices.append(Choice(prompt_index * n + j, f"{base_id}-{prompt_index}-{j}", prompt,
                                      child, CompletionTracker(self.tokenizer, prompt, child)))
        try:
            for choice in choices:
                choice.queue = await self.client.add_request(choice.request_id,
                                                             choice.prompt_token_ids, choice.params)
                choice.is_waiting = True
                self.num_waiting += 1
        except EngineDeadError as error:
            self._abort(choices)
            raise ApiError(503, str(error), type="ServiceUnavailableError") from error
        except RequestRejectedError as error:  # it could not even be sent to the engine
            self._abort(choices)
            raise ApiError(400, str(error)) from error
        return choices

    async def _next_delta(self, choice: Choice) -> TokenDelta:
        """The choice's next delta, folded into its tracker; raises ApiError if the request failed."""
        item = await choice.queue.get()
        if isinstance(item, Exception):
            self._end_waiting(choice)
            status = 400 if isinstance(item, RequestRejectedError) else 503
            raise ApiError(status, str(item), type="BadRequestError" if status == 400
                           else "ServiceUnavailableError")
        now = time.perf_counter()
        if item.new_token_ids:
            if choice.first_token_at is None:
                choice.first_token_at = now
                self._end_waiting(choice)
            else:
                choice.inter_token_latencies.append(now - choice.last_token_at)
            choice.last_token_at = now
        logprobs = None if item.new_logprobs is None else [
            TokenLogprobs(t, lp, rank, [tuple(x) for x in top]) for t, lp, rank, top in item.new_logprobs]
        choice.tracker.apply(item.new_token_ids, logprobs, item.finish_reason, item.stop_reason,
                             item.spec_stats)
        if choice.tracker.needs_abort:  # a stop string ended it here
            choice.tracker.needs_abort = False
            self.client.abort_soon([choice.request_id])
        if choice.tracker.finished:
            self._end_waiting(choice)
            self._record(choice)
        return item

    async def _run_to_end(self, choices: list[Choice], is_disconnected: Callable[[], Any]) -> None:
        """Wait for every choice; abort them all if the client disconnects or one fails."""
        async def finish(choice: Choice) -> None:
            while not choice.tracker.finished:
                await self._next_delta(choice)

        async def watch_client() -> None:
            while not await is_disconnected():
                await asyncio.sleep(0.25)

        work = asyncio.gather(*(finish(c) for c in choices))
        # NOTE: a cancelled gather holds a CancelledError that asyncio logs unless someone reads it
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
            self._abort(choices)

    async def _stream(self, choices: list[Choice], include_usage: bool, chat: bool,
                      echo: list[str]) -> AsyncIterator[str]:
        """SSE events as OpenAI sends them, ending with `data: [DONE]`."""
        response_id, created = random_id("chatcmpl" if chat else "cmpl"), int(time.time())
        n = len(choices) // len(echo)
        merged: asyncio.Queue[tuple[Choice, TokenDelta | ApiError]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                while not choice.tracker.finished:
                    merged.put_nowait((choice, await self._next_delta(choice)))
            except ApiError as error:
                merged.put_nowait((choice, error))

        def event(chunk_choices: list, usage: Usage | None = None,
                  metrics: ResponseMetrics | None = None) -> str:
            model = ChatCompletionStreamResponse if chat else CompletionStreamResponse
            chunk = model(id=response_id, created=created, model=self.served_model_name,
                          choices=chunk_choices, usage=usage, metrics=metrics)
            return f"data: {json.dumps(chunk.model_dump(mode='json'))}\n\n"

        pumps = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            for choice in choices:  # the opening chunk: the role, or the echoed prompt
                if chat:
                    yield event([ChatCompletionStreamChoice(index=choice.index,
                                                            delta=DeltaMessage(role="assistant",
                                                                               content=""))])
                elif echo[choice.index // n]:
                    yield event([CompletionChoice(index=choice.index, text=echo[choice.index // n])])
            remaining = len(choices)
            while remaining:
                choice, item = await merged.get()
                if isinstance(item, ApiError):
                    yield f"data: {json.dumps(item.body())}\n\n"
                    break
                text = choice.tracker.take_stream_text()
                finished = choice.tracker.finished
                remaining -= finished
                if not text and not finished:
                    continue
                metrics = self._metrics(choices) if finished and not remaining and not include_usage \
                    else None
                reason = choice.tracker.finish_reason if finished else None
                new_logprobs = self._new_logprobs(choice, item)
                if chat:
                    yield event([ChatCompletionStreamChoice(
                        index=choice.index, delta=DeltaMessage(content=text or None),
                        logprobs=self._chat_logprobs(new_logprobs), finish_reason=reason)],
                        metrics=metrics)
                else:
                    yield event([CompletionChoice(
                        index=choice.index, text=text,
                        logprobs=self._completion_logprobs(new_logprobs), finish_reason=reason)],
                        metrics=metrics)
            else:
                if include_usage:
                    yield event([], usage=self._usage(choices, n), metrics=self._metrics(choices))
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: nothing of this request stays in the engine
            for task in pumps:
                task.cancel()
            self._abort(choices)

    # ------------------------------------------------------------------ bookkeeping
    def _end_waiting(self, choice: Choice) -> None:
        if choice.is_waiting:
            choice.is_waiting = False
            self.num_waiting -= 1

    def _abort(self, choices: list[Choice]) -> None:
        unfinished = [c for c in choices if c.queue is not None and not c.tracker.finished]
        for choice in unfinished:
            self._end_waiting(choice)
            choice.tracker.finish_reason = choice.tracker.finish_reason or "abort"
            self._record(choice)
        self.client.abort_soon([c.request_id for c in unfinished])

    def _record(self, choice: Choice) -> None:
        now = time.perf_counter()
        self.metrics.request_finished(
            ttft=None if choice.first_token_at is None else choice.first_token_at - choice.arrival,
            inter_token_latencies=choice.inter_token_latencies, e2e=now - choice.arrival,
            num_prompt_tokens=len(choice.prompt_token_ids),
            num_generation_tokens=len(choice.tracker.token_ids),
            finish_reason=choice.tracker.finish_reason)

    @staticmethod
    def _usage(choices: list[Choice], n: int) -> Usage:
        prompt_tokens = sum(len(c.prompt_token_ids) for c in choices[::n])
        return Usage.count(prompt_tokens, sum(len(c.tracker.token_ids) for c in choices))

    @staticmethod
    def _metrics(choices: list[Choice]) -> ResponseMetrics:
        parts = [SpecStats.from_dict(c.tracker.spec_stats)
                 for c in choices if c.tracker.spec_stats is not None]
        return ResponseMetrics.from_spec_stats(SpecStats.merged(parts))

    def _decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    @staticmethod
    def _new_logprobs(choice: Choice, delta: TokenDelta) -> list[TokenLogprobs] | None:
        logprobs = choice.tracker.logprobs
        if logprobs is None or not delta.new_token_ids:
            return None
        return logprobs[len(logprobs) - len(delta.new_token_ids):] or None

    def _completion_logprobs(self, logprobs: list[TokenLogprobs] | None) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        out = CompletionLogprobs()
        offset = 0
        for lp in logprobs:
            token = self._decode([lp.token_id])
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self._decode([t]): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def _chat_logprobs(self, logprobs: list[TokenLogprobs] | None) -> ChatChoiceLogprobs | None:
        if logprobs is None:
            return None

        def top(token_id: int, logprob: float) -> TopLogprob:
            token = self._decode([token_id])
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        return ChatChoiceLogprobs(content=[
            ChatTokenLogprob(**top(lp.token_id, lp.logprob).model_dump(),
                             top_logprobs=[top(t, v) for t, v in lp.top]) for lp in logprobs])
