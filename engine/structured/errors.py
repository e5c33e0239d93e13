"""What structured output raises: a request's `response_format` the server answers with a 400, and a
grammar that broke mid-request (the engine ends that request with an error)."""

from __future__ import annotations


class ResponseFormatError(ValueError):
    """A `response_format` this server will not run; the server answers 400 with `param`."""

    param = "response_format"


class InvalidResponseFormatError(ResponseFormatError):
    """The shape of `response_format` itself is wrong: `type` missing or unknown, `json_schema`
    without a `schema`, a schema that is not a JSON object, ..."""


class UnsupportedSchemaError(ResponseFormatError):
    """A well-formed JSON schema that the grammar cannot enforce exactly (`uniqueItems`, `not`,
    `if`/`then`, an unknown `format`, ...) or that is not a valid schema (a bad `$ref`, a bad
    regex). Refused rather than half-enforced: the promise is that the output matches the schema."""


class GrammarStateError(RuntimeError):
    """A request's grammar was asked to take a token it does not allow (a caller bug: tokens must be
    sampled under the mask), or the grammar library failed (a resource limit hit mid-request)."""
