"""response_format: its shape, the canonical key the compile cache uses, and the schema features that are
refused with a clear error (the server's 400) before any tokenizer is involved."""

from __future__ import annotations

import re

import pytest

from engine.structured import (
    InvalidResponseFormatError,
    ResponseFormat,
    ResponseFormatError,
    UnsupportedSchemaError,
    check_response_format,
    parse_response_format,
)
from engine.structured.response_format import MAX_SCHEMA_BYTES

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


def json_schema(schema, **extra):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **extra}}


# ---------------------------------------------------------------- accepted shapes


@pytest.mark.parametrize("value", [None, {"type": "text"}])
def test_no_grammar(value):
    assert parse_response_format(value) is None
    assert check_response_format(value) is None


def test_json_object_and_json_schema():
    assert parse_response_format({"type": "json_object"}) == ResponseFormat(type="json_object")
    fmt = parse_response_format(json_schema(PERSON, strict=True, description="a person"))
    assert (fmt.type, fmt.schema, fmt.name, fmt.strict) == ("json_schema", PERSON, "answer", True)


# ---------------------------------------------------------------- malformed shapes: a clear ValueError

MALFORMED = [
    ("not an object", "json_object", "response_format must be an object"),
    ("type missing", {}, "response_format.type is required"),
    ("type missing, schema given", {"json_schema": {"name": "a", "schema": {}}},
     "response_format.type is required"),
    ("unknown type", {"type": "xml"}, "response_format.type must be"),
    ("type not a string", {"type": ["json_object"]}, "response_format.type must be"),
    ("unknown top-level key", {"type": "json_object", "schema": {}}, "unknown field(s) schema"),
    ("json_schema with json_object", {"type": "json_object", "json_schema": {}},
     "only allowed with type 'json_schema'"),
    ("json_schema missing", {"type": "json_schema"}, "response_format.json_schema is required"),
    ("json_schema not an object", {"type": "json_schema", "json_schema": "x"},
     "must be an object"),
    ("name missing", {"type": "json_schema", "json_schema": {"schema": {}}},
     "json_schema.name is required"),
    ("bad name", {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
     "json_schema.name is required"),
    ("schema missing", {"type": "json_schema", "json_schema": {"name": "a"}},
     "json_schema.schema is required"),
    ("schema a list", json_schema([{"type": "object"}]), "schema must be a JSON object"),
    ("schema a boolean", json_schema(True), "schema must be a JSON object"),
    ("schema a string", json_schema('{"type": "object"}'), "schema must be a JSON object"),
    ("strict not a boolean", json_schema(PERSON, strict="yes"), "strict must be a boolean"),
    ("unknown json_schema key", json_schema(PERSON, format="json"), "unknown field(s) format"),
    ("NaN in the schema", json_schema({"type": "number", "maximum": float("nan")}),
     "not valid JSON"),
    ("schema too large", json_schema({"enum": ["x" * MAX_SCHEMA_BYTES]}), "too large"),
]


@pytest.mark.parametrize("case,value,message", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_response_format(case, value, message):
    for parse in (parse_response_format, check_response_format):
        with pytest.raises(InvalidResponseFormatError, match=re.escape(message)) as caught:
            parse(value)
        assert isinstance(caught.value, ValueError)
        assert caught.value.param == "response_format"


# ---------------------------------------------------------------- the canonical key


def test_key_ignores_key_order_name_and_strict():
    shuffled = {"additionalProperties": False, "required": ["name", "age"],
                "properties": {"name": {"type": "string"},
                               "age": {"minimum": 0, "type": "integer"}},
                "type": "object"}
    first = parse_response_format(json_schema(PERSON))
    second = parse_response_format({"json_schema": {"strict": False, "schema": shuffled,
                                                    "name": "other"}, "type": "json_schema"})
    assert first.key == second.key
    assert ResponseFormat.from_key(first.key).key == first.key


def test_key_keeps_what_order_means():
    """The grammar writes properties in schema order, and a const object is written as given."""
    reordered = dict(PERSON, properties={"age": PERSON["properties"]["age"],
                                         "name": PERSON["properties"]["name"]})
    assert parse_response_format(json_schema(PERSON)).key != \
        parse_response_format(json_schema(reordered)).key
    const_ab = parse_response_format(json_schema({"const": {"a": 1, "b": 2}}))
    const_ba = parse_response_format(json_schema({"const": {"b": 2, "a": 1}}))
    assert const_ab.key != const_ba.key
    # $defs order means nothing
    defs_xy = {"$defs": {"x": {"type": "string"}, "y": {"type": "integer"}}, "$ref": "#/$defs/x"}
    defs_yx = {"$ref": "#/$defs/x", "$defs": {"y": {"type": "integer"}, "x": {"type": "string"}}}
    assert parse_response_format(json_schema(defs_xy)).key == \
        parse_response_format(json_schema(defs_yx)).key
    assert parse_response_format({"type": "json_object"}).key != \
        parse_response_format(json_schema({"type": "object"})).key


# ---------------------------------------------------------------- schema support, without a tokenizer

SUPPORTED = [
    PERSON,
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "minItems": 1, "maxItems": 3}}},
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
    {"type": "string", "format": "date-time"},
    {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}},
     "anyOf": [{"$ref": "#/$defs/p"}, {"type": "null"}]},
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "x-made-up-annotation": 1},
]


@pytest.mark.parametrize("schema", SUPPORTED)
def test_supported_schemas_pass(schema):
    assert check_response_format(json_schema(schema)).schema == schema


UNSUPPORTED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 5}}, "contains"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
     "if"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "(unclosed"}, "unclosed"),
    ({"type": "strin"}, "strin"),
    # a schema's own llguidance options cannot switch on "ignore what you cannot enforce"
    ({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}, "uniqueItems"),
]


@pytest.mark.parametrize("schema,word", UNSUPPORTED, ids=[w for _, w in UNSUPPORTED])
def test_unsupported_schema_features_are_refused(schema, word):
    with pytest.raises(UnsupportedSchemaError) as caught:
        check_response_format(json_schema(schema))
    message = str(caught.value)
    assert message.startswith("response_format.json_schema.schema cannot be enforced: ")
    assert word in message and "\n" not in message
    assert isinstance(caught.value, ResponseFormatError) and isinstance(caught.value, ValueError)
    assert caught.value.param == "response_format"
