"""Completions and chat completions: validate and tokenize a request, run it as a Generation, and
answer with the formatter of its endpoint, as one response or as an SSE stream.

Text is decoded in this process (engine/output_processor.py); the lifecycle of the engine requests
lives in server/generation.py, OpenAI's shapes in the two formatters.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from engine.sampling_params import SamplingParams
from engine.structured import ResponseFormat, ResponseFormatError, check_grammar_support
from server.api_requests import ChatCompletionRequest, ChatMessage, CompletionRequest
from server.chat_formatter import ChatFormatter
from server.completion_formatter import CompletionFormatter
from server.engine_client import EngineClient
from server.errors import ApiError
from server.generation import Generation, WaitingRequests
from server.metrics import ServerMetrics
from server.prompt_limits import max_prompt_chars
from server.sampling_defaults import with_defaults
from server.tools.call_reader import ToolCallReader
from server.tools.conventions import tool_convention
from server.tools.conversation import template_inputs
from server.tools.forced_calls import UnenforceableToolError, check_enforceable, forced_call_format
from server.tools.tool_request import FunctionSpec, ToolChoice

Formatter = CompletionFormatter | ChatFormatter


@dataclass(frozen=True)
class PreparedChat:
    """A chat request ready for the engine: its prompt, its sampling, how its text is read."""

    prompt: list[int]
    params: SamplingParams
    # how tool calls are read out of the text; None when the request may make none
    reader: ToolCallReader | None


class OpenAIServing:
    def __init__(self, client: EngineClient, tokenizer: Any, served_model_name: str,
                 metrics: ServerMetrics, max_waiting_requests: int,
                 tool_call_parser: str | None = None,
                 sampling_defaults: dict[str, Any] | None = None) -> None:
        """`tool_call_parser`: the tool-call convention (server/tools/conventions.py); None = the
        chat template's. `sampling_defaults`: values for the sampling fields a request leaves out
        (server/sampling_defaults.py)."""
        self.sampling_defaults = sampling_defaults or {}
        self.client = client
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.waiting = WaitingRequests(max_waiting_requests, metrics)
        self.max_model_len = client.ready.max_model_len
        self.vocab_size = client.ready.vocab_size
        self.engine_k = client.ready.num_speculative_tokens
        # NOTE: a text longer than this cannot fit the context, whatever its tokens: refused
        # before tokenizing, so a 15 MiB prompt costs nothing (server/prompt_limits.py)
        self.max_prompt_chars = max_prompt_chars(tokenizer, self.max_model_len)
        self.tool_convention = tool_convention(tokenizer, tool_call_parser)

    # ------------------------------------------------------------------ entry points
    async def completions(self, body: CompletionRequest, is_disconnected: Callable[[], Any],
                          tenant: str | None = None) -> BaseModel | AsyncIterator[str]:
        """`tenant`: the API key's tenant (server/api_key.py), None on a server without keys."""
        self.check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (no prompt logprobs)",
                           param="echo")
        self._check_queue_room(len(body.prompts), body.n)
        for prompt in body.prompts:
            self.check_prompt_size(prompt, "prompt")
        await self._check_response_format(body)
        prompts = [await self._tokenize_prompt(p) for p in body.prompts]
        params = [self._sampling_params(body, ids, body.max_tokens) for ids in prompts]
        echo = [self._decode(ids) if body.echo else "" for ids in prompts]
        formatter = CompletionFormatter(self.tokenizer, self.served_model_name, echo, body.n)
        generation = await self._start(prompts, params, body, tenant)
        return await self._respond(generation, formatter, body, is_disconnected)

    async def chat(self, body: ChatCompletionRequest, is_disconnected: Callable[[], Any],
                   tenant: str | None = None) -> BaseModel | AsyncIterator[str]:
        prepared = await self.prepare_chat(body)
        formatter = ChatFormatter(self.tokenizer, self.served_model_name, prepared.reader)
        generation = await self.start(prepared, body, tenant)
        return await self._respond(generation, formatter, body, is_disconnected)

    async def prepare_chat(self, body: ChatCompletionRequest,
                           clamp_max_tokens: bool = False) -> PreparedChat:
        """A chat request checked, rendered and tokenized, ready to start: the one road of
        /v1/chat/completions, /v1/responses and /v1/messages. `clamp_max_tokens`: a max_tokens
        beyond the room left in the context is cut to that room (APIs whose clients always send
        large values), not refused."""
        self.check_model(body.model)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        self._check_queue_room(1, body.n)
        self.check_messages_size(body.messages)
        await self._check_response_format(body)
        forced = await self._forced_calls(body)
        prompt = await self.render_chat(body.messages, body.tools, body.tool_choice)
        room = self.max_model_len - len(prompt)
        if clamp_max_tokens and (body.requested_max_tokens or 0) > room > 0:
            body = body.model_copy(update={"max_completion_tokens": room, "max_tokens": None})
        params = self._sampling_params(body, prompt, body.requested_max_tokens, forced)
        reader = None
        if body.tool_choice.mode != "none":
            reader = ToolCallReader(self.tool_convention.parser, forced is not None,
                                    frozenset(f.name for f in body.functions_offered))
        return PreparedChat(prompt, params, reader)

    async def render_chat(self, messages: Sequence[ChatMessage],
                          functions: Sequence[FunctionSpec] | None, choice: ToolChoice,
                          add_generation_prompt: bool = True,
                          add_special_tokens: bool = False) -> list[int]:
        """The prompt's token ids: the conversation (and the tools it may call) through the
        model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        template_messages, tools = template_inputs(messages, functions, choice,
                                                   self.tool_convention)
        try:
            # NOTE: in a thread: a long conversation takes a while to render, and the event loop
            # must keep other requests' streams flowing meanwhile
            text = await asyncio.to_thread(
                self.tokenizer.apply_chat_template, template_messages, tools=tools,
                tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as error:  # jinja errors: the conversation does not fit the template
            raise ApiError(400, f"the chat template rejected these messages: {error}",
                           param="messages") from error
        return await self.encode(text, "messages", add_special_tokens=add_special_tokens)

    async def _forced_calls(self, body: ChatCompletionRequest) -> ResponseFormat | None:
        """The grammar of the calls tool_choice demands, checked on a thread (a large schema
        takes up to ~1 s); None where tool_choice forces nothing."""
        forced = forced_call_format(body.functions_offered, body.tool_choice,
                                    body.parallel_tool_calls, self.tool_convention.parser)
        if forced is None:
            return None
        if body.response_format is not None:
            raise ApiError(400, f"response_format cannot be combined with tool_choice "
                                f"{body.tool_choice.mode!r}: the output is a tool call",
                           param="response_format")
        try:
            await asyncio.to_thread(check_enforceable, body.functions_offered, body.tool_choice,
                                    forced)
        except UnenforceableToolError as error:
            raise ApiError(400, str(error), param=error.param) from None
        return forced

    # ------------------------------------------------------------------ running
    async def start(self, prepared: PreparedChat, body: ChatCompletionRequest,
                    tenant: str | None) -> Generation:
        """A prepared chat sent to the engine."""
        return await self._start([prepared.prompt], [prepared.params], body, tenant)

    async def _start(self, prompts: list[list[int]], params: list[SamplingParams],
                     body: CompletionRequest | ChatCompletionRequest,
                     tenant: str | None) -> Generation:
        generation = Generation(self.client, self.tokenizer, self.metrics, self.waiting, prompts,
                                params, body.n, cache_salt(tenant, body.cache_salt))
        await generation.submit()
        return generation

    async def _respond(self, generation: Generation, formatter: Formatter,
                       body: CompletionRequest | ChatCompletionRequest,
                       is_disconnected: Callable[[], Any]) -> BaseModel | AsyncIterator[str]:
        if body.stream:
            return self._stream(generation, formatter, body.include_usage)
        await run_to_end(generation, is_disconnected)
        return formatter.response(generation)

    @staticmethod
    async def _stream(generation: Generation, formatter: Formatter,
                      include_usage: bool) -> AsyncIterator[str]:
        """SSE events as OpenAI sends them, ending with `data: [DONE]` (after an error event too)."""
        try:
            for chunk in formatter.opening_chunks(generation):
                yield _sse(chunk.model_dump(mode="json"))
            try:
                async for piece in generation.pieces():
                    # the speculation metrics ride the last chunk (the usage chunk, if asked for)
                    is_last = generation.is_finished and not include_usage
                    for chunk in formatter.piece_chunks(
                            piece, formatter.metrics(generation) if is_last else None):
                        yield _sse(chunk.model_dump(mode="json"))
                if include_usage:
                    yield _sse(formatter.usage_chunk(generation).model_dump(mode="json"))
            except ApiError as error:
                yield _sse(error.body())
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: nothing of this request stays in the engine
            generation.close()

    # ------------------------------------------------------------------ validation
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model",
                           code="model_not_found", type="NotFoundError")

    def _check_queue_room(self, num_prompts: int, n: int) -> None:
        """Before any tokenizing: a request that could never fit the waiting queue is a 400."""
        if num_prompts * n > self.waiting.max_waiting:
            raise ApiError(400, f"this request asks for {num_prompts * n} completions "
                                f"({num_prompts} prompts x n {n}); this server queues at most "
                                f"{self.waiting.max_waiting}", param="n")

    def check_prompt_size(self, prompt: str | list[int], param: str) -> None:
        """Before tokenizing: a text with more characters than the context could hold in tokens,
        or token ids that fill the context alone, is a 400."""
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            raise _too_long(param, len(prompt), self.max_prompt_chars, self.max_model_len)
        if isinstance(prompt, list) and len(prompt) >= self.max_model_len:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this model's context is "
                                f"{self.max_model_len} tokens, leaving no room to generate",
                           param=param, code="context_length_exceeded")

    def check_messages_size(self, messages: Sequence[ChatMessage]) -> None:
        """Before rendering: a conversation with more characters than the context could hold in
        tokens is a 400."""
        num_chars = sum(len(m.content or "") + sum(len(c.function.arguments)
                                                   for c in m.tool_calls or ())
                        for m in messages)
        if num_chars > self.max_prompt_chars:
            raise _too_long("messages", num_chars, self.max_prompt_chars, self.max_model_len)

    @staticmethod
    async def _check_response_format(body: CompletionRequest | ChatCompletionRequest) -> None:
        """Whether the grammar can enforce the schema: up to ~1 s for a large one, on a thread
        (llguidance releases the GIL), so other requests and /health go on meanwhile."""
        if body.response_format is None:
            return
        try:
            await asyncio.to_thread(check_grammar_support, body.response_format)
        except ResponseFormatError as error:
            raise ApiError(400, str(error), param=error.param) from None

    async def _tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send token ids", param="prompt")
            return await self.encode(prompt, "prompt")
        self.check_token_ids(prompt, "prompt")
        return prompt

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if token_ids and max(token_ids) >= self.vocab_size:
            raise ApiError(400, f"every token id in {param} must be below the vocabulary size "
                                f"{self.vocab_size}", param=param)

    async def encode(self, text: str, param: str, **kwargs: Any) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # lone surrogates from JSON "\udcff" escapes
            raise ApiError(400, f"{param} is not valid Unicode text: {error}", param=param) from None
        # NOTE: in a thread: a megabyte of text takes about a second to tokenize, and the fast
        # tokenizer releases the GIL, so other requests' streams keep flowing meanwhile
        return await asyncio.to_thread(self.tokenizer.encode, text, **kwargs)

    def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest,
                         prompt: list[int], max_tokens: int | None,
                         grammar: ResponseFormat | None = None) -> SamplingParams:
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this model's context is "
                                f"{self.max_model_len} tokens, leaving no room to generate",
                           param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
                                f"exceeds the context of {self.max_model_len} tokens: at most "
                                f"{room} tokens can be generated",
                           param="max_tokens", code="context_length_exceeded")
        body = with_defaults(body, self.sampling_defaults)
        self.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        self.check_token_ids(body.logit_bias_token_ids, "logit_bias")
        spec = body.speculative_decoding
        if spec is not None and (spec.num_speculative_tokens or 0) > self.engine_k:
            raise ApiError(400, f"num_speculative_tokens {spec.num_speculative_tokens} is above "
                                f"this server's {self.engine_k}",
                           param="speculative_decoding.num_speculative_tokens")
        try:
            return body.to_sampling_params(room, grammar) if grammar is not None \
                else body.to_sampling_params(room)
        except ValueError as error:
            raise ApiError(400, str(error)) from error

    def _decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)


async def run_to_end(generation: Generation, is_disconnected: Callable[[], Any]) -> None:
    """A generation run whole (not streamed), then closed whatever happened."""
    try:
        await generation.run_to_end(is_disconnected)
    finally:
        generation.close()


def cache_salt(tenant: str | None, salt: str | None) -> str | None:
    """What the engine isolates cross-request state by (prefix-cache blocks, suffix decoding's
    output cache): the API key's tenant and the request's cache_salt. None (no key, no salt) is
    the anonymous tenant, which shares the prefix cache (engine/request.py)."""
    parts = [p for p in (tenant, salt and "salt:" + salt) if p]
    return "/".join(parts) or None


def _too_long(param: str, num_chars: int, limit: int, max_model_len: int) -> ApiError:
    return ApiError(400, f"{param} has {num_chars} characters; at most {limit} fit this model's "
                         f"context of {max_model_len} tokens", param=param,
                    code="context_length_exceeded")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
