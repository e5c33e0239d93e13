"""Anthropic Messages requests, validated and translated into chat requests without a server: each
block and field becomes its chat counterpart, and each refusal names Anthropic's field."""

from __future__ import annotations

import json

import pytest

from server.errors import ApiError
from server.messages_api import MessagesCountTokensRequest, MessagesRequest

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
ASK = {"role": "user", "content": "What's the weather in Paris?"}
CALL = {"role": "assistant", "content": [
    {"type": "thinking", "thinking": "the user wants weather", "signature": "sig"},
    {"type": "text", "text": "Let me look."},
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}
RESULT = {"role": "user", "content": [
    {"type": "text", "text": "Thanks."},
    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
        {"type": "text", "text": "sunny"}, {"type": "text", "text": "21 C"}]}]}


def body(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 16, "messages": [ASK], **fields}


def chat_of(**fields):
    return MessagesRequest.parse(body(**fields)).to_chat_request()


def test_a_conversation_becomes_chat_messages() -> None:
    chat = chat_of(system=[{"type": "text", "text": "Be brief.",
                            "cache_control": {"type": "ephemeral"}},
                           {"type": "text", "text": "Be kind."}],
                   messages=[ASK, CALL, RESULT], tools=[WEATHER])
    system, user, assistant, tool, thanks = chat.messages
    assert (system.role, system.content) == ("system", "Be brief.\nBe kind.")
    assert (user.role, user.content) == ("user", ASK["content"])
    # thinking is dropped; the call's input goes as JSON arguments
    assert (assistant.role, assistant.content) == ("assistant", "Let me look.")
    (call,) = assistant.tool_calls
    assert (call.id, call.function.name) == ("toolu_1", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # a tool result comes before the text of its user turn
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "toolu_1", "sunny\n21 C")
    assert (thanks.role, thanks.content) == ("user", "Thanks.")


def test_a_turn_of_results_only_has_no_empty_user_message() -> None:
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": "boom", "is_error": True}]}
    chat = chat_of(messages=[ASK, CALL, result], tools=[WEATHER])
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[-1].content == "Error: boom"


def test_an_assistant_turn_of_calls_only_has_null_content() -> None:
    call = {"role": "assistant", "content": [CALL["content"][2]]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}
    chat = chat_of(messages=[ASK, call, result], tools=[WEATHER])
    assert chat.messages[1].content is None and chat.messages[2].content == ""


@pytest.mark.parametrize("tool_choice, mode, function_name, parallel", [
    (None, "auto", None, True),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", None, False),
    ({"type": "any"}, "required", None, True),
    ({"type": "tool", "name": "get_weather"}, "named", "get_weather", True),
    ({"type": "none"}, "none", None, True),
])
def test_tool_choice_maps_to_chat_modes(tool_choice, mode, function_name, parallel) -> None:
    fields = {"tools": [WEATHER]} | ({"tool_choice": tool_choice} if tool_choice else {})
    chat = chat_of(**fields)
    assert (chat.tool_choice.mode, chat.tool_choice.function_name) == (mode, function_name)
    assert chat.parallel_tool_calls is parallel
    (function,) = chat.tools
    assert function.name == "get_weather" and function.parameters["properties"] == {
        "city": {"type": "string"}}


def test_counting_forces_no_call_but_shows_the_same_tools() -> None:
    """tool_choice any is "auto" when counting: the same prompt, no grammar to compile."""
    request = MessagesCountTokensRequest.parse(
        {"model": MODEL, "messages": [ASK], "tools": [WEATHER], "tool_choice": {"type": "any"}})
    chat = request.to_chat_request()
    assert chat.tool_choice.mode == "auto" and len(chat.tools) == 1


def test_a_system_message_in_the_conversation_joins_the_system_prompt() -> None:
    """Claude Code appends its environment as a system message after the user's: it joins the
    system prompt, so the turn the model answers is the user's, and a tool_result still answers
    the call before it across one."""
    call = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}
    environment = {"role": "system", "content": [
        {"type": "text", "text": "# Environment"}, {"type": "text", "text": "Platform: linux"}]}
    chat = chat_of(system="Be brief.", tools=[WEATHER],
                   messages=[ASK, environment, call, environment, result])
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief.\n# Environment\nPlatform: linux\n# Environment\nPlatform: linux"),
        ("user", ASK["content"]), ("assistant", None), ("tool", "sunny")]


def test_server_tools_and_deferred_tools_are_not_offered() -> None:
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
             {"type": "bash_20250124", "name": "bash"},
             {**WEATHER, "name": "later", "defer_loading": True}, {**WEATHER, "type": "custom"}]
    chat = chat_of(tools=tools)
    assert [f.name for f in chat.tools] == ["get_weather"]
    assert chat_of(tools=tools[:3]).tools is None
    with pytest.raises(ApiError, match="tool_choice.name: 'later' is not a tool"):
        chat_of(tools=tools, tool_choice={"type": "tool", "name": "later"})


def test_sampling_fields_and_extras_carry_over() -> None:
    chat = chat_of(max_tokens=32000, stop_sequences=["\n\n", "END"], temperature=0.5, top_p=0.9,
                   top_k=20, stream=True, speculative_decoding={"enabled": False})
    assert (chat.requested_max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k) \
        == (32000, ["\n\n", "END"], 0.5, 0.9, 20)
    assert chat.stream and chat.speculative_decoding.num_speculative_tokens_cap == 0


def test_claude_code_fields_are_accepted_and_ignored() -> None:
    chat = chat_of(thinking={"type": "enabled", "budget_tokens": 1024},
                   context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
                   output_config={"effort": "high"}, metadata={"user_id": "u-1"},
                   messages=[{"role": "user", "content": [
                       {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}])
    assert chat.messages[0].content == "hi"


@pytest.mark.parametrize("fields, param, words", [
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": None}, "max_tokens", "valid integer"),
    ({"temperature": 1.5}, "temperature", "less than or equal to 1"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "'user', 'assistant' or"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "string or a list"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages.0.content.0",
     "string 'type'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image", "source": {}}]}]},
     "messages.0.content.1.type", "image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages.0.content.0.text", "valid string"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                  "input": {}}]}]},
     "messages.0.content.0.type", "belong in assistant messages"),
    ({"messages": [ASK, CALL, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9"}]}], "tools": [WEATHER]},
     "messages.2.content.0.tool_use_id", "answers no tool_use"),
    ({"messages": [ASK, {"role": "assistant", "content": "The answer is"}]}, "messages.1.role",
     "prefill"),
    ({"messages": [ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "bad name", "input": {}}]}, ASK]},
     "messages.1.content.0.name", "pattern"),
    ({"system": [{"type": "document"}]}, "system.0.type", "not supported"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema", "Field required"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0", "custom tool"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"},
                {"name": "f", "input_schema": {"type": "array"}}]},
     "tools.1.input_schema", "must be 'object'"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice.type", "needs tools"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice.name",
     "not a tool"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type", "'auto'"),
    ({"stop_sequences": [""]}, "stop_sequences.0", "at least 1 character"),
    ({"speculative_decoding": {"enabeld": False}}, "speculative_decoding.enabeld", "Extra"),
])
def test_bad_requests_name_the_anthropic_field(fields, param, words) -> None:
    with pytest.raises(ApiError) as caught:
        MessagesRequest.parse(body(**fields))
    assert caught.value.status == 400
    assert caught.value.param == param and words in caught.value.message, caught.value.message
    assert caught.value.message.startswith(param)
