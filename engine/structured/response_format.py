"""The OpenAI `response_format` field: its shape checked, and the part that decides the grammar put in
one canonical JSON text, which is both the compile cache's key and what crosses the process queue.

Accepted shapes (anything else is an InvalidResponseFormatError):
    {"type": "text"}                                   -> None: no grammar
    {"type": "json_object"}                            -> any JSON object
    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...},
                                            "strict": bool, "description": "..."}}
`strict` is accepted and does not change anything: the schema is always enforced, and a schema that
cannot be enforced exactly is refused (UnsupportedSchemaError), never run half-enforced.

A third type, "lark", is never parsed from a request: the server builds it for tool calls that
`tool_choice` demands (server/tools/), a Lark grammar with `%json` schemas inside, and sends its key
down the same path, so the engine enforces it exactly as it does a JSON schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from engine.structured.errors import InvalidResponseFormatError

# a schema whose canonical JSON is longer than this (UTF-8 bytes) is refused before any compiling
# (the grammar library has its own limits on what a schema expands to)
MAX_SCHEMA_BYTES = 100_000
# objects and arrays nested deeper than this are refused before anything walks the schema
# recursively (a schema ~950 deep overflowed Python's stack: a 500); real schemas nest < 20 deep
MAX_SCHEMA_DEPTH = 64
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
_FORMAT_KEYS = {"type", "json_schema"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}

# schema keywords whose value is a map of names to sub-schemas where the ORDER is meaningful: the
# grammar writes properties in the order the schema lists them
_ORDERED_SCHEMA_MAPS = ("properties",)
# maps of names to sub-schemas where order means nothing
_UNORDERED_SCHEMA_MAPS = ("$defs", "definitions", "patternProperties", "dependentSchemas")
# keywords whose value is one sub-schema, or a list of them
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems",
              "propertyNames", "contains", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


@dataclass(frozen=True)
class ResponseFormat:
    """A parsed `response_format` that needs a grammar (`{"type": "text"}` parses to None)."""

    type: Literal["json_object", "json_schema", "lark"]
    # the JSON schema, as given (None for json_object and lark)
    schema: dict[str, Any] | None = None
    # the llguidance Lark grammar (lark only)
    grammar: str | None = None
    # json_schema.name / .strict, kept for logs and echoing; they do not change the grammar
    name: str | None = None
    strict: bool | None = None

    @cached_property
    def key(self) -> str:
        """Canonical JSON of what decides the grammar: equal for two formats that differ only in the
        key order of their JSON objects (except where order matters: the order of `properties`,
        and data such as `const` / `enum` values, which are kept as written)."""
        canonical = {"type": self.type}
        if self.schema is not None:
            canonical["schema"] = canonical_schema(self.schema)
        if self.grammar is not None:
            canonical["grammar"] = self.grammar
        return json.dumps(canonical, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False)

    @classmethod
    def from_key(cls, key: str) -> ResponseFormat:
        """Inverse of `key` (the engine side of the process queue): name and strict are dropped."""
        value = json.loads(key)
        return cls(type=value["type"], schema=value.get("schema"), grammar=value.get("grammar"))


def parse_response_format(value: Any) -> ResponseFormat | None:
    """Check the shape of a request's `response_format` (already JSON-decoded); None = no grammar.
    Raises InvalidResponseFormatError with a message naming the offending field."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _invalid("response_format must be an object, e.g. {\"type\": \"json_object\"}")
    _reject_unknown_keys(value, _FORMAT_KEYS, "response_format")
    kind = value.get("type")
    if kind is None:
        raise _invalid("response_format.type is required: 'text', 'json_object' or 'json_schema'")
    if kind == "text":
        if "json_schema" in value:
            raise _invalid("response_format.json_schema is only allowed with type 'json_schema'")
        return None
    if kind == "json_object":
        if "json_schema" in value:
            raise _invalid("response_format.json_schema is only allowed with type 'json_schema'")
        return ResponseFormat(type="json_object")
    if kind != "json_schema":
        raise _invalid(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                       f"got {kind!r}")
    return _parse_json_schema(value.get("json_schema"))


def _parse_json_schema(spec: Any) -> ResponseFormat:
    where = "response_format.json_schema"
    if spec is None:
        raise _invalid(f"{where} is required when response_format.type is 'json_schema'")
    if not isinstance(spec, Mapping):
        raise _invalid(f"{where} must be an object with 'name' and 'schema'")
    _reject_unknown_keys(spec, _JSON_SCHEMA_KEYS, where)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _invalid(f"{where}.name is required: 1 to 64 characters of a-z, A-Z, 0-9, _ or -")
    if "schema" not in spec:
        raise _invalid(f"{where}.schema is required: the JSON schema the output must match")
    schema = spec["schema"]
    if not isinstance(schema, Mapping):
        raise _invalid(f"{where}.schema must be a JSON object (a JSON schema), "
                       f"got {type(schema).__name__}")
    depth = nesting_depth(schema, MAX_SCHEMA_DEPTH)
    if depth > MAX_SCHEMA_DEPTH:
        raise _invalid(f"{where}.schema is nested too deeply (more than {MAX_SCHEMA_DEPTH} levels "
                       f"of objects and arrays; at most {MAX_SCHEMA_DEPTH})")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid(f"{where}.strict must be a boolean")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise _invalid(f"{where}.description must be a string")
    parsed = ResponseFormat(type="json_schema", schema=_plain(schema, f"{where}.schema"),
                            name=name, strict=strict)
    try:
        size = len(parsed.key.encode())
    except ValueError as error:  # NaN or infinity somewhere in the schema
        raise _invalid(f"{where}.schema is not valid JSON: {error}") from None
    if size > MAX_SCHEMA_BYTES:
        raise _invalid(f"{where}.schema is too large ({size} bytes of JSON; "
                       f"at most {MAX_SCHEMA_BYTES})")
    return parsed


def nesting_depth(value: Any, limit: int) -> int:
    """How deep objects and arrays nest in `value` (a scalar: 0), walked without recursion; stops
    counting at limit + 1, so a hostile value costs at most its size."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (Mapping, list, tuple)):
            continue
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, Mapping) else item
        stack.extend((child, depth + 1) for child in children)
    return deepest


def canonical_schema(schema: Any) -> Any:
    """`schema` with every schema object's keywords sorted, recursively through sub-schemas, and
    everything whose order carries meaning kept as written (see ResponseFormat.key)."""
    if not isinstance(schema, dict):
        return schema  # a boolean schema, or a malformed value the grammar compiler will refuse
    out: dict[str, Any] = {}
    for keyword in sorted(schema):
        value = schema[keyword]
        if keyword in _ORDERED_SCHEMA_MAPS and isinstance(value, dict):
            value = {name: canonical_schema(sub) for name, sub in value.items()}
        elif keyword in _UNORDERED_SCHEMA_MAPS and isinstance(value, dict):
            value = {name: canonical_schema(value[name]) for name in sorted(value)}
        elif keyword in _SUBSCHEMA:
            value = ([canonical_schema(sub) for sub in value] if isinstance(value, list)
                     else canonical_schema(value))
        elif keyword in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [canonical_schema(sub) for sub in value]
        out[keyword] = value
    return out


def _plain(value: Any, where: str) -> Any:
    """A JSON round trip: plain dicts and lists, and a clear error for what JSON cannot hold."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise _invalid(f"{where} is not valid JSON: {error}") from None


def _reject_unknown_keys(value: Mapping, allowed: set[str], where: str) -> None:
    unknown = sorted(str(key) for key in value if key not in allowed)
    if unknown:
        raise _invalid(f"{where} has unknown field(s) {', '.join(unknown)}; "
                       f"allowed: {', '.join(sorted(allowed))}")


def _invalid(message: str) -> InvalidResponseFormatError:
    return InvalidResponseFormatError(message)
