"""/v1/responses without an engine: a Responses request as the chat request it runs as, the errors
that name Responses fields, the events a stream sends, and the store's bounds and tenants."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from engine.messages import EngineReady
from engine.spec_stats import SpecStats
from server.api_key import key_tenant
from server.api_responses import FunctionCallDelta, ToolCallDelta
from server.app import ServerState, build_app
from server.errors import ApiError
from server.metrics import ServerMetrics
from server.openai_serving import OpenAIServing
from server.response_store import ResponseStore, StoredResponse
from server.responses_api import InputItem, ResponsesRequest
from server.responses_formatter import ResponseEventStream, ResponsesFormatter
from server.responses_to_chat import to_chat

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "Hi", **fields})


def chat_messages(**fields) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in to_chat(request(**fields)).chat.messages]


def call(call_id: str, name: str = "get_weather", arguments: str = '{"city": "Paris"}') -> dict:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def output(call_id: str, text: str = "sunny") -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def test_a_string_is_one_user_message_after_the_instructions() -> None:
    assert chat_messages(instructions="Be brief.") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_items_become_a_chat_tool_loop() -> None:
    messages = chat_messages(input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "…"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        call("c1"), call("c2", arguments='{"city": "Rome"}'),
        output("c1"), output("c2", [{"type": "input_text", "text": "rainy"}]),
        call("c3"), output("c3"),
    ])
    assert messages == [
        {"role": "developer", "content": "Rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rainy", "tool_call_id": "c2"},
        {"role": "assistant", "tool_calls": [
            {"id": "c3", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c3"},
    ]


def test_history_comes_first_and_settings_reach_the_chat_request() -> None:
    history = [InputItem.model_validate({"role": "user", "content": "Earlier"}),
               InputItem.model_validate(call("c0"))]
    chat = to_chat(request(
        input=[output("c0")], instructions="Sys", max_output_tokens=7, temperature=0, top_p=0.5,
        seed=3, stop="END", top_k=5, speculative_decoding={"enabled": False},
        tools=[{"type": "web_search"}, WEATHER], tool_choice={"type": "function",
                                                             "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"},
                         "strict": True}}), history).chat
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert (chat.requested_max_tokens, chat.temperature, chat.top_p, chat.seed, chat.stop,
            chat.top_k) == (7, 0, 0.5, 3, ["END"], 5)
    assert chat.speculative_decoding.num_speculative_tokens_cap == 0
    assert [f.name for f in chat.tools] == ["get_weather"]
    assert (chat.tool_choice.mode, chat.tool_choice.function_name) == ("named", "get_weather")
    assert chat.parallel_tool_calls is False
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.schema == {"type": "object"}


def test_tools_the_server_cannot_run_are_skipped() -> None:
    tools = [{"type": "web_search_preview"}, {"type": "custom", "name": "apply_patch"},
             {"type": "namespace", "name": "mcp", "tools": []}, {"type": "local_shell"}]
    chat = to_chat(request(tools=tools, tool_choice="auto")).chat
    assert chat.tools is None and chat.tool_choice.mode == "none"
    assert to_chat(request(tools=[*tools, WEATHER])).chat.tool_choice.mode == "auto"


@pytest.mark.parametrize("fields, loc, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     ("input", 0, "content", 0, "type"), "'input_image' parts are not supported"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     ("input", 0, "arguments"), "required"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, ("input", 0, "type"), "Input should be"),
    ({"input": [{"role": "wizard", "content": "x"}]}, ("input", 0, "role"), "Input should be"),
    ({"input": 5}, ("input",), "a string or a list"),
    ({"background": True}, ("background",), "not supported"),
    ({"conversation": "conv_1"}, ("conversation",), "not supported"),
    ({"tools": [{"type": "web_search"}, {"type": "function", "name": "bad name"}]},
     ("tools", 1, "name"), "pattern"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     ("tools", 0, "parameters"), "must be 'object'"),
    ({"tools": [WEATHER, WEATHER]}, ("tools",), "twice"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, ("tool_choice",),
     "needs a function tool"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, ("tool_choice",),
     "not among the function tools"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, ("tool_choice",), "function tools"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     ("text", "format"), "text.format.name is required"),
    ({"text": {"format": {"type": "xml"}}}, ("text", "format"), "text.format.type"),
    ({"temperature": "0.5"}, ("temperature",), "valid number"),
    ({"max_output_tokens": 0}, ("max_output_tokens",), "greater than or equal to 1"),
])
def test_bad_requests_name_the_responses_field(fields, loc, words) -> None:
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    error = caught.value.errors()[0]
    assert error["loc"] == loc and words in error["msg"]


def test_an_output_that_answers_no_call_names_its_item() -> None:
    with pytest.raises(ApiError) as caught:
        to_chat(request(input=[{"role": "user", "content": "x"}, call("c1"), output("c2")]))
    assert caught.value.param == "input.2.call_id" and "'c2'" in caught.value.message


def test_chat_errors_are_renamed_to_responses_fields() -> None:
    names = to_chat(request(tools=[{"type": "web_search"}, WEATHER])).names
    error = names.error(ApiError(400, "tools[0].function.parameters cannot be enforced",
                                 param="tools[0].function.parameters"))
    assert (error.param, error.message) == ("tools.1.parameters", "tools.1.parameters cannot be "
                                                                  "enforced")
    assert names.param("messages") == "input"
    assert names.param("response_format") == "text.format"
    assert names.param("max_tokens") == "max_output_tokens"


# ---------------------------------------------------------------------- the stream's events
def finished_generation(finish_reason: str):
    tracker = SimpleNamespace(finish_reason=finish_reason)
    return SimpleNamespace(choices=[SimpleNamespace(tracker=tracker)], num_prompt_tokens=5,
                           num_completion_tokens=3, num_cached_tokens=0, num_spec_tokens=0,
                           spec_stats=SpecStats, reports=list)


def test_stream_events_open_and_close_each_item_in_order() -> None:
    events = ResponseEventStream(ResponsesFormatter("m", request()))
    sent = events.opening() + events.feed("Let me ") + events.feed("check.")
    sent += events.feed("", [ToolCallDelta(index=0, id="call_1", type="function",
                                           function=FunctionCallDelta(name="f", arguments=""))])
    sent += events.feed("", [ToolCallDelta(index=0, function=FunctionCallDelta(arguments="{}"))])
    closing, response = events.closing(finished_generation("stop"))
    sent += closing
    assert [e.type for e in sent] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in sent] == list(range(len(sent)))
    message, function_call = response.output
    assert message.content[0].text == "Let me check." and message.status == "completed"
    assert (function_call.call_id, function_call.arguments) == ("call_1", "{}")
    added = json.loads(sent[2].sse().split("data: ")[1])
    assert added["item"]["content"] == [] and added["item"]["status"] == "in_progress"


def test_a_length_stop_ends_the_stream_incomplete() -> None:
    events = ResponseEventStream(ResponsesFormatter("m", request()))
    events.opening()
    events.feed("Once upon")
    closing, response = events.closing(finished_generation("length"))
    assert closing[-1].type == "response.incomplete"
    assert response.status == "incomplete" and response.output[0].status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"


def test_a_failed_generation_ends_the_stream_failed() -> None:
    events = ResponseEventStream(ResponsesFormatter("m", request()))
    events.opening()
    events.feed("Once")
    failed = events.failed(ApiError(500, "the engine could not finish this request"))
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.message.startswith("the engine could not")


# ---------------------------------------------------------------------- the store
def stored(response_id: str) -> StoredResponse:
    response = ResponsesFormatter("m", request()).response("completed", [])
    return StoredResponse(response.model_copy(update={"id": response_id}), ())


def test_the_store_evicts_the_least_recently_used_response() -> None:
    store = ResponseStore(max_responses=2)
    for response_id in ("a", "b"):
        store.put(None, stored(response_id))
    assert store.get(None, "a") is not None  # a is now the most recently used
    store.put(None, stored("c"))
    assert [store.get(None, r) is not None for r in ("a", "b", "c")] == [True, False, True]
    assert store.delete(None, "a") and not store.delete(None, "a") and len(store) == 1


def test_tenants_never_see_nor_evict_each_other() -> None:
    store = ResponseStore(max_responses=1)
    store.put("key:1", stored("a"))
    store.put("key:2", stored("b"))
    assert store.get("key:2", "a") is None and store.get(None, "a") is None
    assert store.get("key:1", "a") is not None and not store.delete("key:2", "a")


def test_get_and_delete_by_id_are_per_api_key() -> None:
    ready = EngineReady("tiny", 128, 96, "float32", "cpu", 8, 16, None, 0)
    client = SimpleNamespace(is_alive=True, ready=ready)
    metrics = ServerMetrics("tiny", None, 0)
    state = ServerState(client, OpenAIServing(client, None, "tiny", metrics, 4), metrics,
                        api_keys=("key-a", "key-b"))
    state.responses.put(key_tenant("key-a"), stored("resp_1"))
    http = TestClient(build_app(state))

    def get(key: str, method: str = "GET"):
        return http.request(method, "/v1/responses/resp_1",
                            headers={"Authorization": f"Bearer {key}"})

    assert get("key-a").json()["id"] == "resp_1"
    assert get("key-b").status_code == 404 and get("key-b").json()["error"]["param"] == \
        "response_id"
    assert get("key-b", "DELETE").status_code == 404
    assert get("key-a", "DELETE").json() == {"id": "resp_1", "object": "response.deleted",
                                             "deleted": True}
    assert get("key-a").status_code == 404
