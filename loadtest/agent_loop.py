"""The agent-loop workload: concurrent multi-turn sessions in which the model calls tools and the
client runs them, the traffic of a coding agent rather than of independent prompts.

    python -m loadtest --workload agent-loop --sessions 4 --turns 3 --max-tokens 128
    python -m loadtest --workload agent-loop --compare none suffix --sessions 4 --turns 3

Each turn of a session:

    user question ──> "call" request   (tools, tool_choice="required": a tool call is guaranteed)
                      run its tools ──> assistant message with tool_calls + one tool message each
                  ┌─> "answer" request (tools, tool_choice="auto")
                  └── it called tools again: run them, ask again (at most --max-tool-calls
                      tool-calling responses a turn; the turn then ends on the tool results)
                      it answered: next question

A failed request ends its session (its conversation cannot go on); a "call" request answered
without a tool call is counted failed, and the session goes on from its text. At the time limit
every session still running is cancelled and its request in flight counted failed, so every sent
request is accounted for. Requests are streamed with usage, so each one is timed as in
loadtest/client.py and carries the server's per-request speculation extra.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from loadtest.agent_tools import SYSTEM_PROMPT, TOOLS, run_tool_call, session_questions
from loadtest.client import RequestOutcome, SamplingOptions, send_streaming
from loadtest.runner import CANCELLED_ERROR, load_client
from loadtest.target import Endpoint

REQUEST_KINDS = ("call", "answer")
NO_TOOL_CALL_ERROR = "no tool call despite tool_choice=required"


@dataclass(frozen=True)
class AgentLoopPlan:
    """The sessions to run and their bounds."""

    num_sessions: int
    num_turns: int                  # user questions per session
    max_tool_calls_per_turn: int    # tool-calling responses per turn at most
    sampling: SamplingOptions       # max_tokens bounds every request; greedy by default
    duration_s: float               # hard limit on the whole run
    max_concurrency: int | None     # sessions in flight at most; None = all at once
    seed: int = 0                   # which questions each session asks

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_turns", "max_tool_calls_per_turn"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.duration_s > 0:
            raise ValueError(f"the duration limit must be > 0 s, got {self.duration_s}")


@dataclass
class AgentRequest:
    """One request of a session and what it did."""

    kind: str                # "call" (tool_choice required) or "answer" (tool_choice auto)
    session: int
    turn: int
    outcome: RequestOutcome
    num_invalid_tool_calls: int = 0  # calls naming no tool or lacking arguments


@dataclass
class AgentLoopOutcome:
    """Every sent request in send order, each session's conversation, and the wall time."""

    requests: list[AgentRequest]
    conversations: list[list[dict[str, Any]]]  # per session: its messages at the end
    num_sessions_finished: int                 # sessions that asked every question
    duration: float                            # seconds from the start to the last end (or limit)


def run_agent_loop(endpoint: Endpoint, plan: AgentLoopPlan,
                   transport: httpx.AsyncBaseTransport | None = None) -> AgentLoopOutcome:
    """Run it from synchronous code. `transport` replaces the network (tests use a fake server)."""
    return asyncio.run(_run_agent_loop(endpoint, plan, transport))


def chat_body(endpoint: Endpoint, messages: list[dict[str, Any]], tool_choice: str,
              sampling: SamplingOptions) -> dict[str, Any]:
    """One streamed chat request offering every tool."""
    body: dict[str, Any] = {
        "model": endpoint.model, "messages": list(messages), "tools": TOOLS,
        "tool_choice": tool_choice, "max_tokens": sampling.max_tokens,
        # NOTE: one call a response: a small model allowed several repeats its call until
        # max_tokens, which would measure the repetition rather than the agent's traffic
        "parallel_tool_calls": False,
        "temperature": sampling.temperature, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    return body


class _Session:
    """One conversation; remembers its request in flight so a cancelled one is still counted."""

    def __init__(self, index: int, plan: AgentLoopPlan) -> None:
        self.index = index
        self.plan = plan
        self.questions = session_questions(index, plan.num_turns, plan.seed)
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        self.requests: list[AgentRequest] = []
        self.in_flight: tuple[str, int, float] | None = None  # kind, turn, start time
        self.is_finished = False

    async def run(self, client: httpx.AsyncClient, endpoint: Endpoint, run_start: float) -> None:
        for turn, question in enumerate(self.questions):
            self.messages.append({"role": "user", "content": question})
            if not await self._turn(client, endpoint, run_start, turn):
                return
        self.is_finished = True

    async def _turn(self, client: httpx.AsyncClient, endpoint: Endpoint, run_start: float,
                    turn: int) -> bool:
        """One question to its answer; False when a request failed and the session must end."""
        kind, num_tool_calling = "call", 0
        while True:
            body = chat_body(endpoint, self.messages,
                             "required" if kind == "call" else "auto", self.plan.sampling)
            self.in_flight = (kind, turn, time.perf_counter() - run_start)
            outcome = await send_streaming(client, endpoint, body, run_start)
            self.in_flight = None
            request = AgentRequest(kind, self.index, turn, outcome)
            self.requests.append(request)
            if not outcome.is_success:
                return False
            if not outcome.tool_calls:
                if kind == "call":
                    outcome.is_success, outcome.error = False, NO_TOOL_CALL_ERROR
                self.messages.append({"role": "assistant", "content": outcome.generated_text})
                return True
            self.messages.append({"role": "assistant", "content": outcome.generated_text or None,
                                  "tool_calls": outcome.tool_calls})
            for call in outcome.tool_calls:
                result, is_valid = run_tool_call(call)
                request.num_invalid_tool_calls += not is_valid
                self.messages.append({"role": "tool", "tool_call_id": call["id"],
                                      "content": result})
            num_tool_calling += 1
            if num_tool_calling >= self.plan.max_tool_calls_per_turn:
                return True
            kind = "answer"

    def cancelled_request(self) -> AgentRequest | None:
        """The request cut off at the time limit, as a failed one."""
        if self.in_flight is None:
            return None
        kind, turn, start_time = self.in_flight
        error = f"{CANCELLED_ERROR} ({self.plan.duration_s:g} s)"
        return AgentRequest(kind, self.index, turn,
                            RequestOutcome(is_success=False, start_time=start_time, error=error))


async def _run_agent_loop(endpoint: Endpoint, plan: AgentLoopPlan,
                          transport: httpx.AsyncBaseTransport | None) -> AgentLoopOutcome:
    sessions = [_Session(index, plan) for index in range(plan.num_sessions)]
    slots = asyncio.Semaphore(plan.max_concurrency or plan.num_sessions)
    async with load_client(transport) as client:
        start = time.perf_counter()

        async def run_when_free(session: _Session) -> None:
            async with slots:
                await session.run(client, endpoint, start)

        tasks = [asyncio.create_task(run_when_free(session)) for session in sessions]
        _, pending = await asyncio.wait(tasks, timeout=plan.duration_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    for task in tasks:  # NOTE: a session's own bug must not pass for a slow server
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
    requests = [request for session in sessions for request in session.requests]
    requests += [cut for session in sessions if (cut := session.cancelled_request())]
    requests.sort(key=lambda request: request.outcome.start_time)
    return AgentLoopOutcome(requests, [session.messages for session in sessions],
                            sum(session.is_finished for session in sessions), duration)
