"""One streamed request, timed on the client: time to the first output (text or a tool-call
piece), the gap before every later output chunk, and the end. Usage from the final chunk
(`stream_options.include_usage`) gives exact token counts; specserve's per-request speculation
extra (`metrics.speculative_decoding`) rides on the same chunk.

NOTE: under speculation one SSE chunk may carry several tokens (all those a verification step
accepted), so ITL here is the gap between chunks, as `vllm bench serve` measures it; TPOT spreads
the time after the first token over every later token.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.datasets import LoadRequest
from loadtest.target import Endpoint
from loadtest.tool_calls import ToolCallAssembler


@dataclass(frozen=True)
class SamplingOptions:
    """Generation settings shared by every request of a run."""

    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False   # a specserve/vLLM extra; only sent when set


@dataclass
class RequestOutcome:
    """What one request did. Times in seconds, from time.perf_counter()."""

    is_success: bool
    start_time: float                 # when it was sent, seconds after the run started
    status_code: int | None = None    # HTTP status, None when no response came back
    error: str = ""                   # "" on success
    input_len: int = 0                # prompt tokens (usage), 0 when unknown
    output_len: int = 0               # completion tokens (usage; output chunks when no usage)
    ttft: float = 0.0                 # to the first text or tool-call piece; the latency if none
    itls: list[float] = field(default_factory=list)  # gaps between later output chunks
    latency: float = 0.0              # end to end, to the [DONE] event
    generated_text: str = ""
    # the whole calls of the first choice, as an assistant message's `tool_calls`
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None  # of the first choice: "stop", "length", "tool_calls", ...
    # the server's `metrics.speculative_decoding` (num_spec_steps, num_accepted_draft_tokens, ...)
    # from the last chunk carrying it; None when the server sends no such extra
    spec_decoding: dict[str, Any] | None = None


def request_body(request: LoadRequest, endpoint: Endpoint, sampling: SamplingOptions) -> dict:
    """The JSON body for one request, OpenAI-shaped, always streamed with usage."""
    body: dict[str, Any] = {
        "model": endpoint.model,
        "max_tokens": request.max_tokens or sampling.max_tokens,
        "temperature": sampling.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.api == "chat":
        body["messages"] = request.chat_messages()
    else:
        body["prompt"] = request.completion_prompt()
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    return body


def _first_choice(event: dict) -> dict:
    """The chunk's piece of choice 0 ({} when it carries none, as the usage chunk does)."""
    return next((choice for choice in event.get("choices") or [] if choice.get("index", 0) == 0),
                {})


def _chunk_text(choice: dict, api: str) -> str:
    if api == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _error_message(status_code: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:200]
    return f"HTTP {status_code}: {message}"


async def send_streaming(client: httpx.AsyncClient, endpoint: Endpoint, body: dict,
                         run_start: float) -> RequestOutcome:
    """Send one request and read its SSE stream to the end. Never raises for a bad response:
    a refused request (429, 503, ...), a broken stream or a connection error comes back as a
    failed outcome; only cancellation propagates."""
    sent_at = time.perf_counter()
    outcome = RequestOutcome(is_success=False, start_time=sent_at - run_start)
    output_times: list[float] = []
    texts: list[str] = []
    tool_calls = ToolCallAssembler()
    usage: dict | None = None
    is_done = False
    try:
        async with client.stream("POST", endpoint.url, json=body,
                                 headers=endpoint.headers) as response:
            outcome.status_code = response.status_code
            if response.status_code != 200:
                outcome.error = _error_message(response.status_code, await response.aread())
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    is_done = True
                    break
                event = json.loads(data)
                if "error" in event:  # the server failed the request mid-stream
                    outcome.error = f"stream error: {event['error'].get('message', event)}"
                    return outcome
                choice = _first_choice(event)
                text = _chunk_text(choice, endpoint.api)
                call_deltas = (choice.get("delta") or {}).get("tool_calls") or []
                if text or call_deltas:
                    output_times.append(time.perf_counter())
                texts.append(text)
                tool_calls.add(call_deltas)
                outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                usage = event.get("usage") or usage
                outcome.spec_decoding = ((event.get("metrics") or {}).get("speculative_decoding")
                                         or outcome.spec_decoding)
    except Exception as error:  # one bad response must not end the run
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    finished_at = time.perf_counter()
    if not is_done:
        outcome.error = "the stream ended without data: [DONE]"
        return outcome
    outcome.is_success = True
    outcome.latency = finished_at - sent_at
    outcome.ttft = (output_times[0] if output_times else finished_at) - sent_at
    outcome.itls = [later - earlier for earlier, later in zip(output_times, output_times[1:])]
    outcome.generated_text = "".join(texts)
    outcome.tool_calls = tool_calls.tool_calls()
    outcome.input_len = int((usage or {}).get("prompt_tokens") or 0)
    outcome.output_len = int((usage or {}).get("completion_tokens") or len(output_times))
    return outcome
