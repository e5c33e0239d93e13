"""What a tool-call parser reads out of a model's text, and the JSON scanning its parsers share.

A parse must be prefix-stable, so that a stream can send its differences: for a text t and a longer
text t + u, the content and each call's arguments parsed from t are prefixes of those parsed from
t + u, and no call parsed from t disappears. Text that could still turn out either way (an open
`<tool_call>` block, a tag's first characters) is withheld until it is decided.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

# OpenAI's rule for a function's name; names are checked against it when a request arrives, so a
# name in the model's text needs no JSON escapes
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    # the JSON text of the arguments object as the model wrote it; a prefix of it while the call is
    # still being written (grammar-enforced calls stream their arguments piece by piece)
    arguments: str
    is_complete: bool = True


@dataclass(frozen=True)
class ParsedOutput:
    # the text outside any call, as written; a response strips it (tools/streaming.py)
    content: str
    calls: tuple[ParsedCall, ...] = ()


@functools.cache
def call_header(key: str) -> re.Pattern[str]:
    """`{"name": "f", "<key>": ` with free whitespace: where a call's arguments begin. A call written
    with its keys the other way round still parses, through json (see parse_call)."""
    return re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"' + key + r'"\s*:\s*')


@dataclass
class ValueScan:
    """How far json_value_end has read one value, so that a stream, whose text only grows, resumes
    there instead of reading the value again at every piece (a long argument made that quadratic:
    4 s of the event loop for a 34 kB call)."""

    position: int
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    end: int | None = None


# a stream's scans, by the offset at which each value opens
Scans = dict[int, ValueScan]


def json_value_end(text: str, start: int, scans: Scans | None = None) -> int | None:
    """Where the JSON object or array that opens at text[start] ends (the index after its closing
    bracket), or None if the text ends first. Strings and escapes are followed; nothing else is
    checked: callers json-parse what they keep, or a grammar made it valid. `scans`: a stream's
    earlier reads of this text's prefixes, resumed and updated."""
    scan = scans.setdefault(start, ValueScan(start)) if scans is not None else ValueScan(start)
    if scan.end is not None:
        return scan.end
    for index in range(scan.position, len(text)):
        char = text[index]
        if scan.in_string:
            if scan.escaped:
                scan.escaped = False
            elif char == "\\":
                scan.escaped = True
            elif char == '"':
                scan.in_string = False
        elif char == '"':
            scan.in_string = True
        elif char in "{[":
            scan.depth += 1
        elif char in "}]":
            scan.depth -= 1
            if scan.depth == 0:
                scan.end = index + 1
                return scan.end
    scan.position = len(text)
    return None


def parse_call(text: str, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    """One whole call written as a JSON object {"name": ..., <argument key>: {...}}, or None when it
    is not one. The arguments keep the model's own text where the keys come in the usual order."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in value), None)
    if key is None or set(value) != {"name", key} or not FUNCTION_NAME.match(value["name"]):
        return None
    arguments = value[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    header = call_header(key).match(text.strip())
    if header is not None:
        stripped = text.strip()
        end = json_value_end(stripped, header.end())
        if end is not None and stripped[header.end()] == "{":
            return ParsedCall(value["name"], stripped[header.end():end])
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


_SPACE = re.compile(r"\s*")
_CLOSING_BRACE = re.compile(r"\s*\}")


def streamed_call(text: str, start: int, header: re.Pattern[str], scans: Scans | None = None
                  ) -> tuple[ParsedCall | None, int | None]:
    """A grammar-enforced call being written at text[start] (after whitespace): the call so far
    (None until its name and argument key are out) and where the call's object ends (None while
    it is open)."""
    match = header.match(text, _SPACE.match(text, start).end())
    if match is None:
        return None, None
    end = json_value_end(text, match.end(), scans) if match.end() < len(text) else None
    arguments = text[match.end():end]
    if end is None:
        return ParsedCall(match.group(1), arguments, is_complete=False), None
    closing = _CLOSING_BRACE.match(text, end)
    return (ParsedCall(match.group(1), arguments, is_complete=closing is not None),
            closing.end() if closing else None)


def withheld_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
