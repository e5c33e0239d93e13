"""The agent loop against a fake OpenAI server that streams tool calls in pieces (no model): the
conversation it builds, the bound on tool calls per turn, the time limit, and the CLI around it."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest

import loadtest.cli
from loadtest.agent_loop import NO_TOOL_CALL_ERROR, AgentLoopPlan, run_agent_loop
from loadtest.client import SamplingOptions
from loadtest.runner import CANCELLED_ERROR
from loadtest.target import Endpoint

ENDPOINT = Endpoint("http://127.0.0.1:9", "tiny", "chat", None)
SPEC = {"num_spec_steps": 2, "num_accepted_draft_tokens": 3, "num_draft_tokens": 4,
        "mean_acceptance_length": 2.5}


def sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
    return sse({"object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})


class FakeToolServer:
    """OpenAI's streaming shape for tools. `mode`: "agent" calls a tool when it must and answers
    after tool results; "always" calls a tool every time; "ignores-required" never calls one;
    "hang" calls tools as "agent" does but never finishes an answer. Like OpenAI, it refuses (400)
    a history in which an assistant's tool calls are not followed by one tool message per call id
    it issued."""

    def __init__(self, mode: str = "agent") -> None:
        self.mode = mode
        self.issued_ids: list[str] = []
        self.tool_choices: list[str] = []
        self._ids = itertools.count()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert {tool["function"]["name"] for tool in body["tools"]} == \
            {"read_source", "get_weather", "search_docs"}
        problem = self.history_problem(body["messages"])
        if problem:
            return httpx.Response(400, json={"error": {"message": problem}})
        self.tool_choices.append(body["tool_choice"])
        calls_tool = self.mode == "always" or (self.mode in ("agent", "hang") and (
            body["tool_choice"] == "required" or body["messages"][-1]["role"] != "tool"))
        stream = (self.tool_call_stream(body["messages"][-1]) if calls_tool
                  else self.answer_stream(hang=self.mode == "hang"))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)

    def history_problem(self, messages: list[dict]) -> str:
        for position, message in enumerate(messages):
            if message["role"] != "assistant" or not message.get("tool_calls"):
                continue
            ids = [call["id"] for call in message["tool_calls"]]
            if any(call_id not in self.issued_ids for call_id in ids):
                return f"unknown tool call id in {ids}"
            answers = [m.get("tool_call_id") for m in messages[position + 1:position + 1 + len(ids)]]
            if answers != ids:
                return f"tool calls {ids} answered by {answers}"
        return ""

    def tool_call_stream(self, last: dict):
        question = last.get("content") or ""
        cities = [city for city in ("Oslo", "Lisbon", "Paris") if city in question] or ["Rome"]
        calls = [("get_weather", {"city": city}) for city in cities]
        if "source" in question:
            calls = [("read_source", {"module": "json", "function": "dumps"})]
        return self._stream_calls(calls)

    async def _stream_calls(self, calls: list[tuple[str, dict]]):
        yield chunk({"role": "assistant", "content": None})
        for index, (name, arguments) in enumerate(calls):
            call_id = f"call_{next(self._ids)}"
            self.issued_ids.append(call_id)
            yield chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                         "function": {"name": name, "arguments": ""}}]})
            text = json.dumps(arguments)
            for start in range(0, len(text), 3):  # pieces cut anywhere, even inside a string
                await asyncio.sleep(0)
                yield chunk({"tool_calls": [{"index": index,
                                             "function": {"arguments": text[start:start + 3]}}]})
        yield chunk({}, finish_reason="tool_calls")
        yield sse({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 10},
                   "metrics": {"speculative_decoding": SPEC}})
        yield b"data: [DONE]\n\n"

    async def answer_stream(self, hang: bool):
        yield chunk({"role": "assistant", "content": ""})
        for word in ("It", " is", " sunny."):
            if hang:
                await asyncio.sleep(3600)
            yield chunk({"content": word})
        yield chunk({}, finish_reason="stop")
        yield sse({"choices": [], "usage": {"prompt_tokens": 80, "completion_tokens": 4},
                   "metrics": {"speculative_decoding": SPEC}})
        yield b"data: [DONE]\n\n"


def kinds(result, session: int | None = None) -> list[str]:
    return [request.kind for request in result.requests
            if session is None or request.session == session]


def run(server: FakeToolServer, num_sessions: int = 2, num_turns: int = 2,
        max_tool_calls: int = 3, duration_s: float = 30.0, seed: int = 0):
    plan = AgentLoopPlan(num_sessions=num_sessions, num_turns=num_turns,
                         max_tool_calls_per_turn=max_tool_calls,
                         sampling=SamplingOptions(max_tokens=32), duration_s=duration_s,
                         max_concurrency=None, seed=seed)
    return run_agent_loop(ENDPOINT, plan, transport=httpx.MockTransport(server.handle))


def test_a_session_calls_a_tool_then_answers_each_question():
    server = FakeToolServer()
    # seed 3: the first session asks about the source of textwrap.dedent, then Oslo and Lisbon
    result = run(server, num_sessions=2, num_turns=2, seed=3)
    assert result.num_sessions_finished == 2
    assert kinds(result, session=0) == kinds(result, session=1) == ["call", "answer"] * 2
    assert all(request.outcome.is_success for request in result.requests)
    conversation = result.conversations[0]
    assert [message["role"] for message in conversation] == [
        "system", "user", "assistant", "tool", "assistant",
        "user", "assistant", "tool", "tool", "assistant"]
    for position, message in enumerate(conversation):
        if message.get("tool_calls"):
            ids = [call["id"] for call in message["tool_calls"]]
            assert set(ids) <= set(server.issued_ids)
            assert [m["tool_call_id"] for m in conversation[position + 1:position + 1 + len(ids)]] \
                == ids
    source_call, source_result = conversation[2]["tool_calls"][0], conversation[3]["content"]
    assert json.loads(source_call["function"]["arguments"]) == {"module": "json",
                                                                "function": "dumps"}
    assert "def dumps(" in source_result
    both_cities = [json.loads(call["function"]["arguments"])["city"]
                   for call in conversation[6]["tool_calls"]]
    assert both_cities == ["Oslo", "Lisbon"]
    assert conversation[-1] == {"role": "assistant", "content": "It is sunny."}


def test_the_requests_carry_timing_usage_and_the_speculation_extra():
    result = run(FakeToolServer(), num_sessions=1, num_turns=1)
    call, answer = (request.outcome for request in result.requests)
    assert call.finish_reason == "tool_calls" and answer.finish_reason == "stop"
    assert (call.output_len, answer.output_len) == (10, 4)
    assert call.spec_decoding == SPEC
    assert 0 < call.ttft <= call.latency and call.itls  # tool-call pieces count as output


def test_a_server_that_always_calls_tools_stops_at_the_max_calls_per_turn():
    server = FakeToolServer("always")
    result = run(server, num_sessions=1, num_turns=2, max_tool_calls=3)
    assert kinds(result) == ["call", "answer", "answer"] * 2
    assert server.tool_choices == ["required", "auto", "auto"] * 2
    assert all(request.outcome.is_success for request in result.requests)
    assert result.num_sessions_finished == 1  # and its history stayed valid to the end
    assert result.conversations[0][-1]["role"] == "tool"


def test_a_hanging_server_ends_at_the_time_limit_with_its_requests_failed():
    result = run(FakeToolServer("hang"), num_sessions=3, num_turns=2, duration_s=0.5)
    assert result.duration < 5
    assert result.num_sessions_finished == 0
    for session in range(3):
        call, answer = (request for request in result.requests if request.session == session)
        assert (call.kind, answer.kind) == ("call", "answer")
        assert call.outcome.is_success
        assert not answer.outcome.is_success
        assert answer.outcome.error.startswith(CANCELLED_ERROR)


def test_a_call_request_answered_without_a_tool_call_is_a_failure_and_the_session_goes_on():
    result = run(FakeToolServer("ignores-required"), num_sessions=1, num_turns=2)
    assert kinds(result) == ["call", "call"]
    assert [request.outcome.error for request in result.requests] == [NO_TOOL_CALL_ERROR] * 2
    assert result.num_sessions_finished == 1


def test_a_refused_request_ends_its_session():
    server = FakeToolServer()
    server.history_problem = lambda messages: "refused" if messages[-1]["role"] == "tool" else ""
    result = run(server, num_sessions=1, num_turns=3)
    assert kinds(result) == ["call", "answer"]
    assert result.requests[-1].outcome.status_code == 400
    assert result.num_sessions_finished == 0


def test_the_plan_rejects_empty_bounds():
    with pytest.raises(ValueError, match="num_turns"):
        AgentLoopPlan(1, 0, 1, SamplingOptions(8), 10.0, None)
    with pytest.raises(ValueError, match="duration"):
        AgentLoopPlan(1, 1, 1, SamplingOptions(8), 0.0, None)


class StandInServer:
    """Compare mode's LaunchedServer without a process: the agent loop goes to the fake server."""

    def __init__(self, config, serve_args) -> None:
        self.base_url = "http://127.0.0.1:9"

    def __enter__(self) -> StandInServer:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_the_cli_compares_configurations_with_the_agent_loop(monkeypatch, tmp_path, capsys):
    def run_on_fake(endpoint, plan):
        return run_agent_loop(endpoint, plan, transport=httpx.MockTransport(
            FakeToolServer().handle))

    monkeypatch.setattr(loadtest.cli, "run_agent_loop", run_on_fake)
    monkeypatch.setattr(loadtest.cli, "LaunchedServer", StandInServer)
    result_path = tmp_path / "agent.json"
    code = loadtest.cli.main(["--workload", "agent-loop", "--compare", "none", "suffix",
                              "--model", "tiny", "--sessions", "2", "--turns", "1",
                              "--result-json", str(result_path)])
    assert code == 0
    runs = json.loads(result_path.read_text())["runs"]
    assert [run["label"] for run in runs] == ["none", "suffix"]
    assert runs[1]["speculative_config"]["method"] == "suffix"
    assert runs[0]["kinds"]["overall"]["completed"] == 4
    assert "τ answer" in capsys.readouterr().out


def test_the_cli_refuses_flags_the_agent_loop_cannot_use():
    for flags in (["--endpoint", "completions"], ["--plot-dir", "plots"]):
        with pytest.raises(SystemExit):
            loadtest.cli.main(["--workload", "agent-loop", *flags])
