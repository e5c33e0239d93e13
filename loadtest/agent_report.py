"""An agent-loop run's result, per request kind ("call", "answer") and overall: output tokens per
second of request time and of wall time, and τ from the server's per-request speculation extra.

τ (tokens per verification step) = Σ(num_spec_steps + num_accepted_draft_tokens) / Σ num_spec_steps
over the completed requests that carried the extra: each step emits its accepted drafts plus one
bonus (or recovered) token. None when no step verified a draft (no speculation, or no extra).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from loadtest.agent_loop import REQUEST_KINDS, AgentLoopOutcome, AgentLoopPlan, AgentRequest
from loadtest.report import error_kind
from loadtest.target import Endpoint

SUMMARY_NAMES = (*REQUEST_KINDS, "overall")


@dataclass(frozen=True)
class KindSummary:
    """Requests of one kind (or all of them) over one run; sums over completed requests."""

    num_sent: int
    num_completed: int
    num_output_tokens: int          # usage completion_tokens
    request_seconds: float          # Σ end-to-end latency
    ttft_seconds: float             # Σ time to the first output
    num_spec_steps: int             # verification steps that checked drafts
    num_accepted_draft_tokens: int
    num_draft_tokens: int

    @classmethod
    def of(cls, requests: list[AgentRequest]) -> KindSummary:
        done = [request.outcome for request in requests if request.outcome.is_success]
        specs = [outcome.spec_decoding or {} for outcome in done]
        return cls(
            num_sent=len(requests), num_completed=len(done),
            num_output_tokens=sum(outcome.output_len for outcome in done),
            request_seconds=sum(outcome.latency for outcome in done),
            ttft_seconds=sum(outcome.ttft for outcome in done),
            num_spec_steps=sum(int(spec.get("num_spec_steps") or 0) for spec in specs),
            num_accepted_draft_tokens=sum(int(spec.get("num_accepted_draft_tokens") or 0)
                                          for spec in specs),
            num_draft_tokens=sum(int(spec.get("num_draft_tokens") or 0) for spec in specs))

    @property
    def num_failed(self) -> int:
        return self.num_sent - self.num_completed

    @property
    def tokens_per_request_second(self) -> float | None:
        """Output tokens / summed request latency: the speed one request sees."""
        return self.num_output_tokens / self.request_seconds if self.request_seconds > 0 else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """τ: tokens emitted per verification step."""
        if self.num_spec_steps == 0:
            return None
        return (self.num_spec_steps + self.num_accepted_draft_tokens) / self.num_spec_steps

    @property
    def acceptance_rate(self) -> float | None:
        """α: accepted / proposed draft tokens."""
        return (self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens
                else None)

    def as_dict(self, duration: float) -> dict[str, Any]:
        def mean_ms(total_s: float) -> float | None:
            return total_s / self.num_completed * 1000.0 if self.num_completed else None

        return {
            "sent": self.num_sent, "completed": self.num_completed, "failed": self.num_failed,
            "output_tokens": self.num_output_tokens, "request_seconds": self.request_seconds,
            "tokens_per_request_second": self.tokens_per_request_second,
            # wall-clock throughput: this kind's tokens per second of the whole run
            "output_throughput": self.num_output_tokens / duration if duration > 0 else 0.0,
            "mean_ttft_ms": mean_ms(self.ttft_seconds),
            "mean_e2el_ms": mean_ms(self.request_seconds),
            "num_spec_steps": self.num_spec_steps,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


def build_agent_result(label: str, endpoint: Endpoint, plan: AgentLoopPlan,
                       speculative_config: dict[str, Any] | None,
                       outcome: AgentLoopOutcome) -> dict[str, Any]:
    """Everything about one agent-loop run, as written to the result file."""
    failed = [request.outcome for request in outcome.requests if not request.outcome.is_success]
    by_kind = {kind: [request for request in outcome.requests if request.kind == kind]
               for kind in REQUEST_KINDS}
    by_kind["overall"] = outcome.requests
    return {
        "workload": "agent-loop", "label": label, "base_url": endpoint.base_url,
        "model": endpoint.model, "speculative_config": speculative_config,
        "num_sessions": plan.num_sessions, "num_turns": plan.num_turns,
        "max_tool_calls_per_turn": plan.max_tool_calls_per_turn,
        "max_concurrency": plan.max_concurrency, "max_tokens": plan.sampling.max_tokens,
        "temperature": plan.sampling.temperature, "duration_limit_s": plan.duration_s,
        "seed": plan.seed,
        "duration": outcome.duration, "sessions_finished": outcome.num_sessions_finished,
        "tool_calls": sum(len(request.outcome.tool_calls) for request in outcome.requests),
        "invalid_tool_calls": sum(request.num_invalid_tool_calls
                                  for request in outcome.requests),
        "kinds": {name: KindSummary.of(requests).as_dict(outcome.duration)
                  for name, requests in by_kind.items()},
        "error_counts": dict(Counter(error_kind(failure.error) for failure in failed)),
        "errors": [failure.error for failure in failed],
        "requests": [_request_row(request) for request in outcome.requests],
    }


def _request_row(request: AgentRequest) -> dict[str, Any]:
    outcome = request.outcome
    return {"kind": request.kind, "session": request.session, "turn": request.turn,
            "is_success": outcome.is_success, "start_time": outcome.start_time,
            "input_len": outcome.input_len, "output_len": outcome.output_len,
            "ttft": outcome.ttft, "latency": outcome.latency,
            "finish_reason": outcome.finish_reason, "num_tool_calls": len(outcome.tool_calls),
            "spec_decoding": outcome.spec_decoding, "error": outcome.error}


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_agent_result(result: dict[str, Any]) -> str:
    """One run: a line of totals, then a row per request kind and overall."""
    errors = ", ".join(f"{kind} x{n}" for kind, n in result["error_counts"].items()) or "none"
    lines = [f" {result['label']}: agent loop ".center(78, "="),
             f"sessions finished {result['sessions_finished']}/{result['num_sessions']}, "
             f"{result['num_turns']} turns each, duration {result['duration']:.2f} s, "
             f"tool calls {result['tool_calls']} ({result['invalid_tool_calls']} invalid)",
             f"failures: {errors}",
             f"{'kind':<8}{'ok/sent':>9}{'out tok':>9}{'tok/s req':>11}{'tok/s wall':>11}"
             f"{'TTFT ms':>9}{'E2E ms':>9}{'α':>7}{'τ':>7}"]
    for name in SUMMARY_NAMES:
        kind = result["kinds"][name]
        lines.append(f"{name:<8}{kind['completed']:>4}/{kind['sent']:<4}{kind['output_tokens']:>9}"
                     f"{_number(kind['tokens_per_request_second']):>11}"
                     f"{_number(kind['output_throughput']):>11}{_number(kind['mean_ttft_ms'], 0):>9}"
                     f"{_number(kind['mean_e2el_ms'], 0):>9}{_number(kind['acceptance_rate'], 3):>7}"
                     f"{_number(kind['mean_acceptance_length'], 2):>7}")
    return "\n".join([*lines, "=" * 78])


def format_agent_comparison(results: list[dict[str, Any]]) -> str:
    """One row per configuration, with its tok/s against the first configuration's."""
    def overall(result: dict[str, Any]) -> dict[str, Any]:
        return result["kinds"]["overall"]

    base = overall(results[0])
    header = (f"{'label':<12}{'ok/sent':>9}{'tok/s req':>11}{'tok/s wall':>11}{'τ call':>8}"
              f"{'τ answer':>10}{'τ':>7}{'x req':>7}{'x wall':>8}")
    rows = [header, "-" * len(header)]
    for result in results:
        kinds, total = result["kinds"], overall(result)
        per_request = total["tokens_per_request_second"]
        per_wall = total["output_throughput"]
        rows.append(
            f"{str(result['label'])[:12]:<12}{total['completed']:>4}/{total['sent']:<4}"
            f"{_number(per_request):>11}{_number(per_wall):>11}"
            f"{_number(kinds['call']['mean_acceptance_length'], 2):>8}"
            f"{_number(kinds['answer']['mean_acceptance_length'], 2):>10}"
            f"{_number(total['mean_acceptance_length'], 2):>7}"
            f"{_number(ratio(per_request, base['tokens_per_request_second']), 2):>7}"
            f"{_number(ratio(per_wall, base['output_throughput']), 2):>8}")
    return "\n".join(rows)


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None
