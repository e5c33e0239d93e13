"""`--speculative-config`: which proposer drafts tokens, and how many, parsed from vLLM-style JSON.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}

Unknown keys and bad values fail here, at start-up, with the name of what was wrong.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "mlp_speculator", "suffix")
# methods whose proposer exists in this build
BUILT_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # k: draft tokens proposed per step for one request (a request may get fewer, or none)
    num_speculative_tokens: int
    # n-gram: the shortest and longest suffix of the context looked up earlier in it
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft_model / eagle / mlp_speculator: a local folder with the proposer's weights
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        if self.method not in BUILT_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not built yet; "
                             f"available: {', '.join(BUILT_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs "model": a local folder or '
                             '.gguf file of a smaller model with the same tokenizer')
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_json(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """Parse a JSON string or a dict; `num_speculative_tokens` is required, as in vLLM."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(fields)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative config needs {required!r}")
        for key, expected in (("method", str), ("num_speculative_tokens", int), ("model", str),
                              ("prompt_lookup_min", int), ("prompt_lookup_max", int)):
            if key in value and (not isinstance(value[key], expected)
                                 or isinstance(value[key], bool)):
                raise ValueError(f"speculative config {key!r} must be {expected.__name__}, "
                                 f"got {value[key]!r}")
        return cls(**value)
