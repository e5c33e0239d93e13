"""Server-wide defaults for the sampling fields a request leaves out (vLLM's
`--override-generation-config`): agents such as Claude Code and Codex send no temperature, so an
operator who wants their answers greedy, or at the model card's settings, says so once here."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel

from engine.sampling_params import SamplingParams, sampling_knobs

# the request fields a default may be given for: SamplingParams' knobs, which every API shares
DEFAULTABLE_FIELDS = tuple(sampling_knobs())

Request = TypeVar("Request", bound=BaseModel)


def parse_generation_config(text: str | None) -> dict[str, Any]:
    """The flag's JSON object, checked: known fields only, each value valid for SamplingParams."""
    if not text:
        return {}
    try:
        defaults = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--override-generation-config is not valid JSON: {error}") from None
    if not isinstance(defaults, dict):
        raise ValueError("--override-generation-config must be a JSON object, e.g. "
                         '\'{"temperature": 0}\'')
    unknown = sorted(set(defaults) - set(DEFAULTABLE_FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown field(s) {', '.join(unknown)}; "
                         f"it takes {', '.join(DEFAULTABLE_FIELDS)}")
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--override-generation-config: {error}") from None
    return defaults


def with_defaults(body: Request, defaults: dict[str, Any]) -> Request:
    """`body` with each defaulted field it left out (None) set to the server's default."""
    missing = {name: value for name, value in defaults.items()
               if getattr(body, name, None) is None and name in type(body).model_fields}
    return body.model_copy(update=missing) if missing else body
