"""The Responses API (/v1/responses) with the real `openai` SDK against a live `specserve serve` on the
embedded model: text whole and streamed, a tool loop through stored responses, structured output,
the same greedy text with and without speculation and as chat gives it, and the 4xx that name
their field. Greedy (temperature 0) wherever text is compared; outputs kept short."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from live_server import LiveServer

MODEL = "SmolLM2-135M-Instruct"
# greedy SmolLM2 answers these in a few tokens, well inside MAX_TOKENS
CAPITAL = "What is the capital of France?"
WEATHER_QUESTION = "What's the weather in Paris?"
MAX_TOKENS = 40
# a function's output; with tool_choice "none" greedy SmolLM2 answers from it in words
SUNNY = json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {**WEATHER, "name": "get_time", "description": "Current local time in a city"}
# tool types the server cannot run: skipped, not refused
UNRUNNABLE = [{"type": "web_search"}, {"type": "custom", "name": "apply_patch"},
              {"type": "local_shell"}]
NO_SPECULATION = {"speculative_decoding": {"enabled": False}}
CAPITAL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "country": {"type": "string"}},
                  "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(embedded_server: LiveServer):
    """`specserve serve` as README starts it, shared with the other modules that need it."""
    return openai.OpenAI(base_url=embedded_server.api, api_key="unused", max_retries=0,
                         timeout=120)


def create(client, **kw):
    kw.setdefault("input", CAPITAL)
    kw.setdefault("max_output_tokens", MAX_TOKENS)
    return client.responses.create(model=MODEL, temperature=0, **kw)


def streamed(client, **kw):
    """(events, final response) of `client.responses.stream`, which puts the events together."""
    kw.setdefault("input", CAPITAL)
    kw.setdefault("max_output_tokens", MAX_TOKENS)
    with client.responses.stream(model=MODEL, temperature=0, **kw) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def outputs(response) -> list[tuple]:
    """What a response said, without its ids."""
    return [(item.type, item.content[0].text) if item.type == "message"
            else (item.type, item.name, item.arguments) for item in response.output]


@pytest.mark.promise("api-contract-sdk")
def test_a_text_response_is_stored_and_retrieved(client) -> None:
    response = create(client)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    assert "Paris" in response.output_text
    message, = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()


@pytest.mark.promise("api-contract-sdk")
def test_a_stream_adds_up_to_the_same_response(client) -> None:
    events, final = streamed(client)
    whole = create(client)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                            "response.output_item.added",
                                            "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done",
                                             "response.content_part.done",
                                             "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == whole.output_text
    assert outputs(final) == outputs(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text


@pytest.mark.promise("api-contract-sdk")
def test_a_tool_loop_calls_gets_the_output_and_answers(client) -> None:
    first = create(client, input=WEATHER_QUESTION, tools=[*UNRUNNABLE, WEATHER],
                   tool_choice="required", parallel_tool_calls=False)
    call, = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert [tool.name for tool in first.tools] == ["get_weather"]
    answer = create(client, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                    input=[{"type": "function_call_output", "call_id": call.call_id,
                            "output": SUNNY}])
    assert answer.status == "completed" and answer.previous_response_id == first.id
    assert "sunny" in answer.output_text
    assert [item.type for item in answer.output] == ["message"]


@pytest.mark.promise("api-contract-sdk")
@pytest.mark.parametrize("kw, status, param, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0.type", "not supported"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, 400,
     "input.1.call_id", "answers no function_call"),
    ({"background": True}, 400, "background", "not supported"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id", "no stored response"),
    ({"tools": [WEATHER, {"type": "function", "name": "bad name"}]}, 400, "tools.1.name", "match"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, 400, "tool_choice",
     "needs a function tool"),
    ({"tools": [{"type": "web_search"}, {**WEATHER, "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}],
      "tool_choice": "required"}, 400, "tools.1.parameters", "cannot be enforced"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, 400,
     "text.format", "name is required"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER],
      "tool_choice": "required"}, 400, "text.format", "cannot be combined"),
    ({"top_p": 2}, 400, "top_p", "less than or equal to 1"),
    ({"input": "x" * 200_000}, 400, "input", "at most"),
])
def test_bad_requests_get_a_4xx_naming_the_field(client, kw, status, param, words) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        create(client, **kw)
    assert caught.value.status_code == status
    assert caught.value.body["param"] == param and words in caught.value.body["message"]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    {},
    {"input": WEATHER_QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required",
     "parallel_tool_calls": False},
])
def test_greedy_output_is_identical_without_speculation(client, kw) -> None:
    raw = client.responses.with_raw_response.create(model=MODEL, temperature=0, **{
        "input": CAPITAL, "max_output_tokens": MAX_TOKENS, **kw})
    plain = create(client, extra_body=NO_SPECULATION, **kw)
    assert outputs(raw.parse()) == outputs(plain)
    assert json.loads(raw.text)["metrics"]["speculative_decoding"]["num_spec_steps"] > 0


@pytest.mark.slow
def test_instructions_and_history_run_as_the_same_chat(client) -> None:
    first = create(client, instructions="Answer briefly.")
    assert first.instructions == "Answer briefly."
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=MAX_TOKENS,
                                          messages=[{"role": "system", "content": "Answer briefly."},
                                                    {"role": "user", "content": CAPITAL}])
    assert first.output_text == chat.choices[0].message.content
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    # a continued response gets the history, not the instructions (OpenAI's rule)
    second = create(client, previous_response_id=first.id, input="And of Italy?")
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=MAX_TOKENS,
                                          messages=[{"role": "user", "content": CAPITAL},
                                                    {"role": "assistant",
                                                     "content": first.output_text},
                                                    {"role": "user", "content": "And of Italy?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.instructions is None


@pytest.mark.slow
def test_a_named_call_streams_as_it_is_made_among_skipped_tools(client) -> None:
    kw = {"input": WEATHER_QUESTION, "tools": [*UNRUNNABLE, WEATHER, TIME],
          "tool_choice": {"type": "function", "name": "get_time"}}
    events, final = streamed(client, **kw)
    whole = create(client, **kw)
    assert outputs(final) == outputs(whole)
    (kind, name, arguments), = outputs(whole)
    assert (kind, name, json.loads(arguments)) == ("function_call", "get_time", {"city": "Paris"})
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == arguments
    done, = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments


@pytest.mark.slow
def test_a_loop_sent_back_whole_runs_as_the_stored_one(client) -> None:
    """Codex's way: store false, and every turn's items sent again."""
    kw = {"tools": [WEATHER]}
    first = create(client, input=WEATHER_QUESTION, tool_choice="required",
                   parallel_tool_calls=False, store=False, **kw)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": SUNNY}
    items = [{"role": "user", "content": WEATHER_QUESTION},
             call.model_dump(exclude_none=True), result]
    answer = create(client, input=items, tool_choice="none", store=False, **kw)
    stored = create(client, input=WEATHER_QUESTION, tool_choice="required",
                    parallel_tool_calls=False, **kw)
    result["call_id"] = stored.output[0].call_id
    continued = create(client, previous_response_id=stored.id, input=[result],
                       tool_choice="none", **kw)
    assert answer.status == "completed" and "sunny" in answer.output_text
    assert outputs(answer) == outputs(continued)
    assert answer.usage.input_tokens == continued.usage.input_tokens


@pytest.mark.slow
def test_json_schema_output_parses_and_validates(client) -> None:
    response = create(client, input=f"{CAPITAL} Answer in JSON.", text={"format": {
        "type": "json_schema", "name": "capital", "schema": CAPITAL_SCHEMA, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CAPITAL_SCHEMA)
    assert response.text.format.type == "json_schema"


@pytest.mark.slow
def test_a_length_stop_leaves_the_response_incomplete(client) -> None:
    response = create(client, input="Say hi.", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    events = list(client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=3,
                                          temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == response.output_text


@pytest.mark.slow
def test_a_deleted_response_is_gone(client) -> None:
    response = create(client, max_output_tokens=1)
    client.responses.delete(response.id)
    for call in (lambda: client.responses.retrieve(response.id),
                 lambda: client.responses.delete(response.id),
                 lambda: create(client, previous_response_id=response.id)):
        with pytest.raises(openai.NotFoundError):
            call()
