"""One streamed request, timed on the client: time to the first text, the gap before every later
text chunk, and the end. Usage from the final chunk (`stream_options.include_usage`) gives exact
token counts.

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
    output_len: int = 0               # completion tokens (usage; text chunks when no usage)
    ttft: float = 0.0                 # to the first non-empty text; the latency if none came
    itls: list[float] = field(default_factory=list)  # gaps between later text chunks
    latency: float = 0.0              # end to end, to the [DONE] event
    generated_text: str = ""


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


def _chunk_text(event: dict, api: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if api == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


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
    text_times: list[float] = []
    texts: list[str] = []
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
                text = _chunk_text(event, endpoint.api)
                if text:
                    text_times.append(time.perf_counter())
                    texts.append(text)
                usage = event.get("usage") or usage
    except Exception as error:  # one bad response must not end the run
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    finished_at = time.perf_counter()
    if not is_done:
        outcome.error = "the stream ended without data: [DONE]"
        return outcome
    outcome.is_success = True
    outcome.latency = finished_at - sent_at
    outcome.ttft = (text_times[0] if text_times else finished_at) - sent_at
    outcome.itls = [later - earlier for earlier, later in zip(text_times, text_times[1:])]
    outcome.generated_text = "".join(texts)
    outcome.input_len = int((usage or {}).get("prompt_tokens") or 0)
    outcome.output_len = int((usage or {}).get("completion_tokens") or len(texts))
    return outcome
