"""The agent loop's pieces without a server: streamed tool calls put back together from pieces cut
anywhere, and the fake tools (deterministic, real text, errors instead of arbitrary imports)."""

from __future__ import annotations

import json

from loadtest.agent_tools import (
    MAX_RESULT_CHARS,
    QUESTIONS,
    TOOLS,
    run_tool_call,
    session_questions,
)
from loadtest.tool_calls import ToolCallAssembler, parse_arguments


def call(name: str, arguments: dict | str, call_id: str = "call_0") -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def test_pieces_of_two_parallel_calls_are_reassembled_in_index_order():
    first = json.dumps({"query": 'a "quoted" \\ word'})
    second = json.dumps({"city": "Zürich"}, ensure_ascii=False)
    assembler = ToolCallAssembler()
    assembler.add([{"index": 1, "id": "call_b", "type": "function",
                    "function": {"name": "get_weather", "arguments": ""}}])
    assembler.add([{"index": 0, "id": "call_a", "type": "function",
                    "function": {"name": "search_docs", "arguments": first[:13]}}])
    for start in range(0, len(second), 2):  # cut inside strings and escapes alike
        assembler.add([{"index": 1, "function": {"arguments": second[start:start + 2]}}])
    # one chunk may carry pieces of several calls; a repeated name or id is not doubled
    assembler.add([{"index": 0, "id": "call_a", "function": {"name": "search_docs",
                                                              "arguments": first[13:]}}])
    assert assembler.tool_calls() == [call("search_docs", first, "call_a"),
                                      call("get_weather", second, "call_b")]
    assert parse_arguments(assembler.tool_calls()[1]) == {"city": "Zürich"}


def test_arguments_that_are_no_json_object_parse_to_none():
    assert parse_arguments(call("get_weather", '{"city": "Par')) is None
    assert parse_arguments(call("get_weather", "[1, 2]")) is None
    assert parse_arguments(call("get_weather", "")) == {}


def test_each_tool_answers_with_real_text_the_same_every_time():
    source, is_valid = run_tool_call(call("read_source", {"module": "textwrap",
                                                          "function": "dedent"}))
    assert is_valid and source.startswith("def dedent(")
    weather = run_tool_call(call("get_weather", {"city": "Oslo"}))
    assert weather == run_tool_call(call("get_weather", {"city": "Oslo"}))
    assert json.loads(weather[0])["city"] == "Oslo"
    docs, is_valid = run_tool_call(call("search_docs", {"query": "split a shell command line"}))
    assert is_valid and docs.startswith("shlex.split\n")
    long_source, _ = run_tool_call(call("read_source", {"module": "json",
                                                        "function": "JSONDecoder"}))
    assert len(long_source) <= MAX_RESULT_CHARS + len("\n... (cut)")


def test_bad_calls_get_an_error_result_and_count_as_invalid():
    for bad in (call("launch_rockets", {}), call("get_weather", {"town": "Oslo"}),
                call("get_weather", "{not json")):
        result, is_valid = run_tool_call(bad)
        assert "error" in json.loads(result) and not is_valid
    # a well-formed call for something it may not read: an error, but a valid call
    for module, function in (("os", "system"), ("json", "_default_decoder")):
        result, is_valid = run_tool_call(call("read_source", {"module": module,
                                                              "function": function}))
        assert "error" in json.loads(result) and is_valid


def test_tools_and_questions_are_fixed():
    assert [tool["function"]["name"] for tool in TOOLS] == ["read_source", "get_weather",
                                                            "search_docs"]
    assert session_questions(0, 2, seed=0) == list(QUESTIONS[:2])
    assert session_questions(1, 2, seed=0) == list(QUESTIONS[2:4])
    assert len(session_questions(0, 3 * len(QUESTIONS), seed=5)) == 3 * len(QUESTIONS)
