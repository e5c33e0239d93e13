"""What the HTTP process and the engine process say to each other: dataclasses, each crossing the
queue as itself (msgpack, every dataclass of WIRE_TYPES tagged with its name, at any depth).
A request's SamplingParams is validated once, where the server builds it, and arrives as the same
object; a request's SpecStats arrives with every count.

server -> engine: AddRequest, AbortRequests, Shutdown.
engine -> server: EngineReady once, then EngineOutputs per step (the step's RequestUpdates and
StepStats, engine/step/types.py),
RequestRejected for a request the engine refused, EngineFailed before it dies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack

from engine.request import FinishReason, TokenLogprobs
from engine.request_report import RequestReport
from engine.sampling_params import SamplingParams
from engine.spec_stats import SpecStats
from engine.step.types import RequestUpdate, StepStats


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
class EngineOutputs:
    """One step's updates (each request's new tokens, and why it ended if it did) and stats."""

    updates: list[RequestUpdate]
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
    AddRequest, AbortRequests, Shutdown, EngineReady, RequestUpdate, StepStats, EngineOutputs,
    RequestRejected, EngineFailed, SamplingParams, RequestReport, SpecStats, TokenLogprobs)}
# the (str) enums among their fields, by name: msgpack sends their value, the field's annotation
# names the enum to rebuild
WIRE_ENUMS = {cls.__name__: cls for cls in (FinishReason,)}
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
    become tuples again where the field is a tuple, and strings the field's enum."""
    if code != _DATACLASS_EXT:
        return msgpack.ExtType(code, data)
    name, values = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_from_wire)
    cls = WIRE_TYPES[name]
    obj = object.__new__(cls)
    for f, value in zip(dataclasses.fields(cls), values, strict=True):
        object.__setattr__(obj, f.name, _as_declared(value, str(f.type)))
    return obj


def _as_declared(value: Any, declared: str) -> Any:
    """Lists back to tuples where the annotation says tuple (at the top or inside a list), and a
    string back to the enum the annotation names."""
    if isinstance(value, str):
        enums = [enum for name, enum in WIRE_ENUMS.items() if name in declared]
        return enums[0](value) if enums else value
    if isinstance(value, list) and declared.startswith("tuple"):
        return _tuples(value)
    if isinstance(value, list) and declared.startswith("list[tuple"):
        return [_tuples(item) for item in value]
    return value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value
