"""The agent loop's fake tools and the questions its users ask. Tools answer deterministically with
real text that ships with Python (standard-library sources and docstrings, a weather report made
from the city's name), so a session needs no download and no network, and repeats exactly.

NOTE: a tool reads only the modules listed here; a model naming any other module gets an error
result, never an import of its choosing.
"""

from __future__ import annotations

import calendar
import fnmatch
import html
import inspect
import json
import re
import shlex
import statistics
import string
import textwrap
import zlib
from types import ModuleType
from typing import Any

from loadtest.tool_calls import parse_arguments

SYSTEM_PROMPT = ("You are a Python assistant with tools. Call a tool to look things up before you "
                 "answer, then answer briefly from what the tool returned.")
MAX_RESULT_CHARS = 3000  # a tool result is cut here so that conversations stay within the context
READABLE_MODULES: dict[str, ModuleType] = {
    module.__name__: module
    for module in (calendar, fnmatch, html, json, shlex, statistics, string, textwrap)
}
DOCUMENTED = ("json.dumps", "json.loads", "textwrap.dedent", "textwrap.wrap", "shlex.split",
              "shlex.quote", "statistics.median", "statistics.mean", "fnmatch.fnmatch",
              "html.escape", "string.capwords", "calendar.monthrange")
# words too common to tell one docstring from another
STOP_WORDS = frozenset("a an and are as by do for from how i in into is it of on or the to with"
                       .split())
WEATHER_CONDITIONS = ("sunny", "cloudy", "light rain", "heavy rain", "windy", "snow", "fog")

# NOTE: closed schemas, as agent frameworks send them (OpenAI's strict mode requires it): with
# extra properties allowed, a small model keeps adding them until max_tokens
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_source",
        "description": "Return the Python source code of a standard-library function.",
        "parameters": {"type": "object", "properties": {
            "module": {"type": "string", "description": "module name, e.g. json"},
            "function": {"type": "string", "description": "function name, e.g. dumps"}},
            "required": ["module", "function"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Return the current weather in a city as JSON.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "city name, e.g. Paris"}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_docs",
        "description": "Search the Python standard-library documentation; returns the best "
                       "matching docstring.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for"}},
            "required": ["query"], "additionalProperties": False}}},
]

QUESTIONS = (
    "How is json.dumps implemented? Read its source and explain what the indent argument does.",
    "What is the weather like in Paris today? Should I take an umbrella?",
    "How do I split a shell command line into a list of arguments in Python? Search the docs.",
    "Read the source of textwrap.dedent and explain how it finds the common leading whitespace.",
    "Is it warmer in Oslo or in Lisbon right now?",
    "Search the docs for how to compute the median of a list of numbers, then give an example.",
    "Show me the source of shlex.quote and tell me when I should use it.",
    "What's the weather in Tokyo? Suggest something to do there today.",
)


def session_questions(session: int, num_turns: int, seed: int) -> list[str]:
    """The user messages of one session, one per turn: the same for every run with this seed."""
    first = seed + session * num_turns
    return [QUESTIONS[(first + turn) % len(QUESTIONS)] for turn in range(num_turns)]


def run_tool_call(call: dict[str, Any]) -> tuple[str, bool]:
    """The result text of one tool call and whether the call was valid (a known tool with the
    arguments it needs). An invalid call still gets a result, an error message, as a real agent
    would send back, so the conversation goes on."""
    name = call.get("function", {}).get("name", "")
    arguments = parse_arguments(call)
    if arguments is None:
        return _error(f"the arguments of {name!r} are not a JSON object"), False
    try:
        if name == "read_source":
            result = read_source(str(arguments["module"]), str(arguments["function"]))
        elif name == "get_weather":
            result = get_weather(str(arguments["city"]))
        elif name == "search_docs":
            result = search_docs(str(arguments["query"]))
        else:
            return _error(f"no tool named {name!r}"), False
    except KeyError as missing:
        return _error(f"{name} needs the argument {missing}"), False
    return _cut(result), True


def read_source(module: str, function: str) -> str:
    namespace = READABLE_MODULES.get(module)
    target = getattr(namespace, function, None) if not function.startswith("_") else None
    if target is None or not callable(target):
        return _error(f"no function {module}.{function} (modules: {sorted(READABLE_MODULES)})")
    try:
        return textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError):
        return _error(f"{module}.{function} is built in: it has no Python source")


def get_weather(city: str) -> str:
    """A made-up but fixed report: the city's name picks every number."""
    code = zlib.crc32(city.strip().lower().encode())
    return json.dumps({"city": city, "temperature_c": code % 36 - 5,
                       "conditions": WEATHER_CONDITIONS[code // 36 % len(WEATHER_CONDITIONS)],
                       "humidity_percent": 30 + code // 252 % 65})


def search_docs(query: str) -> str:
    """The docstring sharing the most words with the query, a word of its name counting twice
    (the first listed wins a tie)."""
    words = _words(query)
    best, best_score = None, 0
    for qualified_name in DOCUMENTED:
        module, function = qualified_name.split(".")
        doc = inspect.getdoc(getattr(READABLE_MODULES[module], function)) or ""
        score = 2 * len(words & _words(qualified_name)) + len(words & _words(doc))
        if score > best_score:
            best, best_score = f"{qualified_name}\n\n{doc}", score
    return best or _error(f"no documentation matches {query!r}")


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower())) - STOP_WORDS


def _error(message: str) -> str:
    return json.dumps({"error": message})


def _cut(result: str) -> str:
    if len(result) <= MAX_RESULT_CHARS:
        return result
    return result[:MAX_RESULT_CHARS] + "\n... (cut)"
