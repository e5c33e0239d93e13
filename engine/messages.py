"""What the HTTP process and the engine process say to each other: dataclasses, each crossing the
queue as itself (msgpack, every dataclass of WIRE_TYPES tagged with its name, at any depth).
A request's SamplingParams is validated once, where the server builds it, and arrives as the same
object; a request's SpecStats arrives with every count.

server -> engine: AddRequest, AbortRequests, Shutdown.
engine -> server: EngineReady once, then EngineOutputs per step (token deltas + step stats),
RequestRejected for a request the engine refused, EngineFailed before it dies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.spec_stats import SpecStats


# ---------------------------------------------------------------- server -> engine
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    # validated where the server built it; not again
    params: SamplingParams
    # tenant isolation key (engine/request.py Request.cache_salt); None belongs to no tenant
    cache_salt: str | None = None


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


# ---------------------------------------------------------------- engine -> server
@dataclass
class EngineReady:
    model_name: str
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    num_kv_blocks: int
    block_size: int
    # None when speculation is off
    speculative_method: str | None
    num_speculative_tokens: int
    # weights as held, KV cache and resident memory, in words (engine/models/memory.py)
    memory: str = ""


@dataclass
class TokenDelta:
    """One request's tokens from one step; finish_reason set on its last delta."""

    request_id: str
    new_token_ids: list[int]
    # per new token, the target's logprob and top alternatives; None if not asked for
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    # the stop token id that ended it, if one did
    stop_reason: int | None = None
    # on the last delta
    spec_stats: SpecStats | None = None
    # prompt tokens found in the prefix cache, on the last delta
    num_cached_tokens: int = 0
    # with finish_reason "error": why the engine ended this request (the others went on)
    error: str | None = None


@dataclass
class StepStats:
    """One engine step, for the metrics the server owns (engine/core.py fills it).

    `is_step` False marks a snapshot sent after an abort, outside any step: only its gauges (running,
    waiting, KV-cache usage, preemptions) mean anything, so freed blocks show without waiting for work.
    """

    is_step: bool = True
    num_running: int = 0
    num_waiting: int = 0
    # fraction of KV blocks in use, 0..1
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    # prefix caching, running totals in tokens (vLLM's): prompt tokens looked up, and found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # speculation: drafts verified this step (one per request that had any), their tokens, accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose position i + 1 was accepted this step
    accepted_per_position: list[int] = field(default_factory=list)
    # per draft verified this step: how many of its tokens were accepted
    accepted_lengths: list[int] = field(default_factory=list)
    # seconds of this step in the target pass + verification, and in proposing the next drafts
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    # drafting for the next step: requests whose k was chosen, how many of them got k > 0, and the
    # sum of their k (fixed k: the configured k within each request's cap; adaptive: the choice)
    num_k_choices: int = 0
    num_speculating_choices: int = 0
    sum_chosen_k: int = 0


@dataclass
class EngineOutputs:
    deltas: list[TokenDelta]
    stats: StepStats | None = None


@dataclass
class RequestRejected:
    request_id: str
    message: str


@dataclass
class EngineFailed:
    message: str


# every dataclass that crosses the queue, messages and the values inside them, by name
WIRE_TYPES = {cls.__name__: cls for cls in (
    AddRequest, AbortRequests, Shutdown, EngineReady, TokenDelta, StepStats, EngineOutputs,
    RequestRejected, EngineFailed, SamplingParams, SpecStats, TokenLogprobs)}
_DATACLASS_EXT = 1  # the msgpack extension type of a tagged dataclass


def encode(message: Any) -> bytes:
    return msgpack.packb(message, default=_to_wire, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_from_wire)


def _to_wire(value: Any) -> msgpack.ExtType:
    name = type(value).__name__
    if WIRE_TYPES.get(name) is not type(value):
        raise TypeError(f"a {name} cannot cross the engine queue")
    values = [getattr(value, f.name) for f in dataclasses.fields(value)]
    return msgpack.ExtType(_DATACLASS_EXT, msgpack.packb([name, values], default=_to_wire,
                                                         use_bin_type=True))


def _from_wire(code: int, data: bytes) -> Any:
    """The dataclass as it was sent: its fields set as they were, without __init__ or
    __post_init__ (the sender's object was built, and validated, already); msgpack's lists
    become tuples again where the field is a tuple."""
    if code != _DATACLASS_EXT:
        return msgpack.ExtType(code, data)
    name, values = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_from_wire)
    cls = WIRE_TYPES[name]
    obj = object.__new__(cls)
    for f, value in zip(dataclasses.fields(cls), values, strict=True):
        object.__setattr__(obj, f.name, _as_declared(value, str(f.type)))
    return obj


def _as_declared(value: Any, declared: str) -> Any:
    """Lists back to tuples where the annotation says tuple (at the top or inside a list)."""
    if isinstance(value, list) and declared.startswith("tuple"):
        return _tuples(value)
    if isinstance(value, list) and declared.startswith("list[tuple"):
        return [_tuples(item) for item in value]
    return value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value
