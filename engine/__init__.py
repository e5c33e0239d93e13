"""specserve's engine: continuous batching over a paged KV cache, and the offline `LLM` API.

The names below load on first use: the HTTP process imports engine modules (the engine's arguments,
its messages) and must not pay for the model code, which only the engine process runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
_HOMES = {"LLM": "engine.llm", "SamplingParams": "engine.sampling_params",
          "RequestOutput": "engine.outputs", "CompletionOutput": "engine.outputs"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
