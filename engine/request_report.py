"""What the engine reports of a request once it ends, beside its tokens: one record, filled here from
the scheduler's Request, that crosses the engine queue, the completion tracker and the offline
LLM's CompletionOutput whole, and whose numbers the HTTP response shows (server/api_responses.py).

So a new per-request output is a field here and the line of `of` that fills it, plus its test.
Its fields are numbers (or SpecStats): the response sums them over a request's choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request
from engine.spec_stats import SpecStats


@dataclass
class RequestReport:
    # the request's speculation: drafts proposed and accepted, α, τ
    spec_stats: SpecStats = field(default_factory=SpecStats)
    # prompt tokens whose K/V came from the prefix cache (vLLM's RequestOutput.num_cached_tokens)
    num_cached_tokens: int = 0

    @classmethod
    def of(cls, request: Request) -> RequestReport:
        return cls(spec_stats=request.spec_stats, num_cached_tokens=request.num_cached_tokens)


class ReportCarrier:
    """What carries a request's report on its way to the client (RequestUpdate, the completion
    tracker, CompletionOutput): the report's numbers under the names they had before it."""

    report: RequestReport | None

    @property
    def spec_stats(self) -> SpecStats | None:
        """The request's speculation: drafts proposed and accepted, α, τ (None before it ends)."""
        return None if self.report is None else self.report.spec_stats

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose K/V the prefix cache held (0 until it ends)."""
        return 0 if self.report is None else self.report.num_cached_tokens
