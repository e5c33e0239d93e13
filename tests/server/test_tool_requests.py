"""`tools`, `tool_choice` and the tool parts of `messages`: refused with the field named, and the
conversation as the chat template gets it, for a template that knows tools and for one that does
not (the embedded SmolLM2's)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import ValidationError
from tool_call_outputs import SMOLLM2_AUTO_CALL

from server.api_requests import ChatCompletionRequest
from server.tools.conventions import ToolConvention, tool_convention
from server.tools.conversation import template_inputs
from server.tools.forced_calls import (
    UnenforceableToolError,
    check_enforceable,
    forced_call_format,
)
from server.tools.hermes import HermesParser
from server.tools.llama3_json import Llama3JsonParser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [USER], **fields})


def refusal(**fields: Any) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as caught:
        chat(**fields)
    error = caught.value.errors()[0]
    return error["loc"], error["msg"]


def test_tool_choice_defaults_as_openais() -> None:
    assert chat(tools=[WEATHER]).tool_choice.mode == "auto"
    assert chat().tool_choice.mode == "none"
    assert chat(tools=[WEATHER], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}).tool_choice.function_name == "get_weather"


@pytest.mark.parametrize("fields, loc, words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     ("tool_choice",), "'nope', which is not in tools (get_weather)"),
    ({"tool_choice": "required"}, ("tool_choice",), "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, ("tool_choice",), "'sometimes'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, ("tools",),
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, ("tools",), "'get_weather' twice"),
    ({"tools": [{"type": "retrieval"}]}, ("tools",), "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameter": {}}}]}, ("tools",),
     "unknown field(s) parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, ("tools",), "tools[0].function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "description": "x" * 90_000}}} for i in range(3)]}, ("tools",),
     "at most 256000"),
    ({"functions": [{"name": "f"}]}, ("functions",), "use tools"),
    ({"function_call": {"name": "f"}}, ("function_call",), "use tool_choice"),
    ({"messages": [USER, RESULT]}, ("messages",), "messages[1].tool_call_id 'call_1' answers no "
                                                  "call"),
    ({"messages": [USER, CALL, {**RESULT, "tool_call_id": "call_2"}]}, ("messages",),
     "'call_2'"),
    ({"messages": [USER, {"role": "tool", "content": "x"}]}, ("messages", 1), "tool_call_id"),
    ({"messages": [{**USER, "tool_calls": CALL["tool_calls"]}]}, ("messages", 0),
     "only an assistant message"),
])
def test_bad_tool_fields_are_refused_naming_the_field(fields, loc, words) -> None:
    got_loc, message = refusal(**fields)
    assert got_loc == loc and words in message


def test_a_function_without_parameters_takes_an_empty_object() -> None:
    request = chat(tools=[{"type": "function", "function": {"name": "now"}}])
    assert request.tools[0].parameters == {"type": "object", "properties": {},
                                           "additionalProperties": False}


def test_unenforceable_schema_is_named_only_where_a_grammar_enforces_it() -> None:
    odd = {"type": "function", "function": {"name": "tags", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    request = chat(tools=[WEATHER, odd], tool_choice="required")
    parser = HermesParser()
    fmt = forced_call_format(request.tools, request.tool_choice, True, parser)
    with pytest.raises(UnenforceableToolError, match="uniqueItems") as caught:
        check_enforceable(request.tools, request.tool_choice, fmt)
    assert caught.value.param == "tools[1].function.parameters"
    named = chat(tools=[WEATHER, odd],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    check_enforceable(named.tools, named.tool_choice,
                      forced_call_format(named.tools, named.tool_choice, True, parser))


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
def test_forced_grammar_accepts_a_call_and_nothing_else(parser) -> None:
    import llguidance

    request = chat(tools=[WEATHER], tool_choice="required")
    fmt = forced_call_format(request.tools, request.tool_choice, False, parser)
    grammar = llguidance.grammar_from("lark", fmt.grammar)
    call = parser.write_calls([("get_weather", '{"city": "Paris"}')])
    for text, accepted in [(call, True), (call.replace('"Paris"', "1"), False),
                           (call.replace("get_weather", "get_time"), False)]:
        matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
        ok = matcher.try_consume_tokens(list(text.encode())) == len(text.encode())
        assert (ok and matcher.is_accepting()) == accepted, text


def _byte_tokenizer():
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes, plus an end token."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]

    def __call__(self, text):
        return list(text.encode())


# ---------------------------------------------------------------- the conversation rendered
def test_template_that_knows_tools_gets_openais_shapes() -> None:
    request = chat(messages=[{"role": "developer", "content": "be brief"}, USER, CALL, RESULT],
                   tools=[WEATHER])
    messages, tools = template_inputs(request.messages, request.tools, request.tool_choice,
                                      ToolConvention(HermesParser(), template_knows_tools=True))
    assert tools == [WEATHER]
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[3] == {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": "call_1",
                           "name": "get_weather"}


def test_tool_choice_none_shows_no_tools() -> None:
    request = chat(tools=[WEATHER], tool_choice="none")
    convention = ToolConvention(HermesParser(), template_knows_tools=True)
    assert template_inputs(request.messages, request.tools, request.tool_choice,
                           convention)[1] is None
    assert template_inputs(request.messages, request.tools, request.tool_choice,
                           ToolConvention(HermesParser()))[0] == [USER]


def test_embedded_template_gets_tools_written_out(embedded_tokenizer) -> None:
    convention = tool_convention(embedded_tokenizer)
    assert convention.parser.name == "hermes" and not convention.template_knows_tools
    assert convention.template_renders_tool_role  # ChatML renders any role
    request = chat(messages=[{"role": "system", "content": "be brief"}, USER, CALL, RESULT],
                   tools=[WEATHER])
    messages, tools = template_inputs(request.messages, request.tools, request.tool_choice,
                                      convention)
    text = embedded_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nbe brief\n\nYou may call")
    assert json.dumps(WEATHER) in text
    assert f"<|im_start|>assistant\n{SMOLLM2_AUTO_CALL}<|im_end|>" in text
    assert '<|im_start|>tool\n{"sky": "sunny"}<|im_end|>' in text


def test_template_without_a_tool_role_gets_results_as_one_user_turn() -> None:
    request = chat(messages=[USER, {**CALL, "tool_calls": CALL["tool_calls"] * 2},
                             RESULT, RESULT], tools=[WEATHER])
    messages, _ = template_inputs(request.messages, request.tools, request.tool_choice,
                                  ToolConvention(HermesParser()))
    assert messages[-1] == {"role": "user", "content": "<tool_response>\n{\"sky\": \"sunny\"}\n"
                                                       "</tool_response>\n<tool_response>\n"
                                                       "{\"sky\": \"sunny\"}\n</tool_response>"}


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from embedded_tokenizer import load_embedded_tokenizer

    return load_embedded_tokenizer()


def test_template_that_knows_tools_renders_them_itself(embedded_tokenizer) -> None:
    from tool_templates import HERMES_STYLE

    tokenizer = copy.copy(embedded_tokenizer)
    tokenizer.chat_template = HERMES_STYLE
    convention = tool_convention(tokenizer)
    assert convention.template_knows_tools and convention.parser.name == "hermes"
    request = chat(messages=[USER, CALL, RESULT], tools=[WEATHER])
    messages, tools = template_inputs(request.messages, request.tools, request.tool_choice,
                                      convention)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert json.dumps(WEATHER) in text
    # the template wrote the earlier call in the form the parser reads back
    assert SMOLLM2_AUTO_CALL in text
    assert '<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response>' in text


def test_llama31_style_template_is_read_as_llama3_json(embedded_tokenizer) -> None:
    from tool_templates import LLAMA31_STYLE

    tokenizer = copy.copy(embedded_tokenizer)
    tokenizer.chat_template = LLAMA31_STYLE
    convention = tool_convention(tokenizer)
    assert convention.template_knows_tools and convention.parser.name == "llama3_json"
    assert tool_convention(tokenizer, "hermes").parser.name == "hermes"  # the flag wins
    request = chat(messages=[USER, CALL, RESULT], tools=[WEATHER])
    messages, tools = template_inputs(request.messages, request.tools, request.tool_choice,
                                      convention)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"sky": "sunny"}' in text


def test_unknown_parser_name_is_refused(embedded_tokenizer) -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'"):
        tool_convention(embedded_tokenizer, "mistral")
