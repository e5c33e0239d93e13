"""Pydantic models of OpenAI's responses and stream chunks, plus specserve's `metrics` extra.

They keep OpenAI's shapes and explicit nulls so the official `openai` SDK parses them.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from engine.request_report import RequestReport
from engine.spec_stats import SpecStats

# "abort" is not OpenAI's, but vLLM sends it when the server cancels a request (e.g. on shutdown)
FinishReason = Literal["stop", "length", "tool_calls", "abort"]
# OpenAI's documented "very unlikely" value; -inf is not valid JSON
MIN_LOGPROB = -9999.0


def random_id(prefix: str) -> str:
    """OpenAI-style object id, e.g. `cmpl-3f2a...`; one per response, shared by its stream chunks."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class _ResponseModel(BaseModel):
    """Dumps every field, explicit nulls included, as OpenAI does; only the names in
    `omitted_when_none` (our extras, and optional delta fields) vanish when they are None."""

    omitted_when_none: ClassVar[frozenset[str]] = frozenset()

    # NOTE: no return annotation on purpose: pydantic would take it as the JSON schema of the model
    @model_serializer(mode="wrap")
    def _omit_unset_extras(self, serialize: SerializerFunctionWrapHandler):
        data = serialize(self)
        for name in self.omitted_when_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


def _finite_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


Logprob = Annotated[float, AfterValidator(_finite_logprob)]


class PromptTokensDetails(BaseModel):
    # prompt tokens whose KV came from the prefix cache instead of being computed (OpenAI clients
    # and aiperf read the field); 0 with prefix caching off
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def count(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class SpeculativeDecodingMetrics(BaseModel):
    """vLLM's per-request speculation payload (`--per-request-spec-decode-metrics summary`), field
    for field, so clients that parse vLLM's (NVIDIA's aiperf) read ours; SpecStats' other counts
    ride along. A request that never verified a draft reads as nothing accepted: 1.0 and 0.0, never
    null (aiperf drops a payload with a null rate as malformed)."""

    # NOTE: keep keys SpecStats adds later (per-position counts, timings) instead of dropping them
    model_config = ConfigDict(extra="allow")

    # 1 + accepted drafts per verification step: tokens a step emitted, the bonus token included
    mean_acceptance_length: float
    # accepted drafts / proposed drafts
    draft_acceptance_rate: float
    # dense: index j = verification steps that accepted exactly j drafts, j = 0 .. num_spec_tokens
    acceptance_histogram: list[int]
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    # the most drafts a step could verify for this request (k); 0 without speculation
    num_spec_tokens: int

    @classmethod
    def from_spec_stats(cls, stats: SpecStats, num_spec_tokens: int) -> SpeculativeDecodingMetrics:
        histogram = list(stats.acceptance_histogram)
        histogram += [0] * (num_spec_tokens + 1 - len(histogram))
        return cls.model_validate({
            **stats.as_dict(),
            "draft_acceptance_rate": stats.draft_acceptance_rate or 0.0,
            "acceptance_histogram": histogram,
            "num_spec_tokens": num_spec_tokens,
        })


# RequestReport's numbers that the response shows in places of their own: the speculation payload,
# and usage's cached tokens
REPORT_FIELDS_SHOWN_ELSEWHERE = ("spec_stats", "num_cached_tokens")


class ResponseMetrics(BaseModel):
    """The `metrics` response extra, beside `usage`: the speculation payload, and every other number
    the engine reports of a request (engine/request_report.py), summed over the choices, under the
    report's own names, so a number the report gains reaches clients without a line here."""

    model_config = ConfigDict(extra="allow")

    speculative_decoding: SpeculativeDecodingMetrics

    @classmethod
    def from_spec_stats(cls, stats: SpecStats, num_spec_tokens: int,
                        **numbers: float) -> ResponseMetrics:
        return cls(speculative_decoding=SpeculativeDecodingMetrics.from_spec_stats(
            stats, num_spec_tokens), **numbers)

    @classmethod
    def of(cls, reports: list[RequestReport], num_spec_tokens: int) -> ResponseMetrics:
        """The metrics of a response whose choices ended with these reports."""
        numbers = {f.name: sum(getattr(report, f.name) for report in reports)
                   for f in dataclasses.fields(RequestReport)
                   if f.name not in REPORT_FIELDS_SHOWN_ELSEWHERE}
        return cls.from_spec_stats(SpecStats.merged([report.spec_stats for report in reports]),
                                   num_spec_tokens, **numbers)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    # None for the first echoed prompt token, which has no context to be scored in
    token_logprobs: list[Logprob | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)
    # character offset of each token in the choice's text
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    # the whole text in a response; the new text only in a stream chunk
    text: str
    logprobs: CompletionLogprobs | None = None
    # None in stream chunks until the choice's last one
    finish_reason: FinishReason | None = None


class CompletionResponse(_ResponseModel):
    omitted_when_none = frozenset({"metrics"})

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    metrics: ResponseMetrics | None = None


class CompletionStreamResponse(_ResponseModel):
    """One SSE chunk; OpenAI uses the same object name as the full response."""

    omitted_when_none = frozenset({"metrics"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    # empty on the final usage chunk
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: ResponseMetrics | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: Logprob
    # UTF-8 bytes of the token; None when it is not valid UTF-8 on its own
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    # JSON text of the arguments object
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_ResponseModel):
    omitted_when_none = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class FunctionCallDelta(_ResponseModel):
    omitted_when_none = frozenset({"name", "arguments"})

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_ResponseModel):
    """A call's first chunk carries its id, type and name (arguments ""); later ones pieces of its
    arguments, as OpenAI streams them."""

    omitted_when_none = frozenset({"id", "type"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(_ResponseModel):
    omitted_when_none = frozenset({"metrics"})

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    metrics: ResponseMetrics | None = None


class DeltaMessage(_ResponseModel):
    """The first chunk of a choice carries the role, later ones only content, the last one neither."""

    omitted_when_none = frozenset({"role", "content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionStreamResponse(_ResponseModel):
    omitted_when_none = frozenset({"metrics"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    # empty on the final usage chunk
    choices: list[ChatCompletionStreamChoice]
    # null on every chunk but the final usage chunk
    usage: Usage | None = None
    metrics: ResponseMetrics | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "specserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
