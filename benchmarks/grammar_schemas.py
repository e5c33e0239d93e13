"""The JSON schemas benchmarks/bench_grammar_libraries.py runs every grammar library over: workloads of
increasing difficulty, and one-feature probes that a library refuses, enforces or (the dangerous case)
accepts and then ignores."""

from __future__ import annotations

from typing import Any

# schemas of increasing difficulty
SCHEMAS: dict[str, dict[str, Any] | None] = {
    # None = response_format {"type": "json_object"}: any JSON object
    "json_object": None,
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "active": {"type": "boolean"}},
        "required": ["name", "age", "active"], "additionalProperties": False,
    },
    "nested_enum_array": {
        "type": "object",
        "properties": {
            "status": {"enum": ["open", "closed", "pending"]},
            "owner": {"type": "object",
                      "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
                      "required": ["id", "email"], "additionalProperties": False},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        },
        "required": ["status", "owner", "tags"], "additionalProperties": False,
    },
    "string_pattern_format": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
            "email": {"type": "string", "format": "email"},
            "day": {"type": "string", "format": "date"},
            "uid": {"type": "string", "format": "uuid"},
            "nick": {"type": "string", "minLength": 2, "maxLength": 6},
        },
        "required": ["code", "email", "day", "uid", "nick"], "additionalProperties": False,
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": 10},
            "delta": {"type": "number", "minimum": -5.5, "exclusiveMaximum": 5.5},
        },
        "required": ["age", "score", "count", "delta"], "additionalProperties": False,
    },
    "anyof_ref_defs": {
        "$defs": {
            "point": {"type": "object", "properties": {"x": {"type": "number"},
                                                        "y": {"type": "number"}},
                      "required": ["x", "y"], "additionalProperties": False},
            "circle": {"type": "object",
                       "properties": {"kind": {"const": "circle"}, "center": {"$ref": "#/$defs/point"},
                                      "r": {"type": "number", "minimum": 0}},
                       "required": ["kind", "center", "r"], "additionalProperties": False},
            "rect": {"type": "object",
                     "properties": {"kind": {"const": "rect"}, "corner": {"$ref": "#/$defs/point"},
                                    "w": {"type": "integer"}, "h": {"type": "integer"}},
                     "required": ["kind", "corner", "w", "h"], "additionalProperties": False},
        },
        "type": "object",
        "properties": {
            "shapes": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/circle"},
                                                            {"$ref": "#/$defs/rect"}]},
                       "maxItems": 3},
            "label": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": ["shapes", "label"], "additionalProperties": False,
    },
    "required_subset": {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"},
                       "c": {"type": "boolean"}, "d": {"type": "array", "items": {"type": "integer"}},
                       "e": {"type": ["string", "null"]}},
        "required": ["a", "c"], "additionalProperties": False,
    },
}

# one feature each: refused at compile time, enforced, or (the dangerous case) accepted and ignored
FEATURE_PROBES: dict[str, dict[str, Any]] = {
    "pattern": {"type": "string", "pattern": "^[a-z]{2,4}[0-9]$"},
    "format:date-time": {"type": "string", "format": "date-time"},
    "format:ipv4": {"type": "string", "format": "ipv4"},
    "format:hostname": {"type": "string", "format": "hostname"},
    "format:unknown": {"type": "string", "format": "no-such-format"},
    "minLength/maxLength": {"type": "string", "minLength": 3, "maxLength": 5},
    "multipleOf": {"type": "integer", "multipleOf": 7},
    "const/enum mixed": {"enum": [1, "a", None, True, {"k": [1]}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}},
                         "required": ["b"]}]},
    "recursive $ref": {
        "$defs": {"node": {"type": "object",
                           "properties": {"v": {"type": "integer"},
                                          "kids": {"type": "array", "maxItems": 2,
                                                   "items": {"$ref": "#/$defs/node"}}},
                           "required": ["v", "kids"], "additionalProperties": False}},
        "$ref": "#/$defs/node"},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                          "additionalProperties": False},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}},
    "min/maxProperties": {"type": "object", "additionalProperties": {"type": "integer"},
                          "minProperties": 2, "maxProperties": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
                    "minItems": 3, "uniqueItems": True},
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                    "items": False},
    "if/then/else": {"type": "object", "properties": {"a": {"type": "integer"}},
                     "if": {"properties": {"a": {"const": 1}}},
                     "then": {"required": ["b"]}},
    "not": {"not": {"type": "string"}},
    "dependentRequired": {"type": "object",
                          "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "dependentRequired": {"a": ["b"]}},
    "unknown keyword": {"type": "string", "x-made-up": 3},
}
