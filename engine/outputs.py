"""What the offline API returns: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import TokenLogprobs
from engine.request_report import ReportCarrier, RequestReport
from engine.spec_stats import SpecStats


@dataclass
class CompletionOutput(ReportCarrier):
    # which of the request's n completions this is
    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort" or "error" (the engine could not serve it: see `error`); None while
    # running
    finish_reason: str | None = None
    # the stop token id or stop string that ended it, if one did
    stop_reason: int | str | None = None
    # per generated token when SamplingParams.logprobs is set
    logprobs: list[TokenLogprobs] | None = None
    # what the engine reported of it once it ended (engine/request_report.py)
    report: RequestReport | None = None
    # why the engine ended it, with finish_reason "error" (the other requests went on)
    error: str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # speculation over all n completions (zero drafts when speculation is off)
    spec_stats: SpecStats | None = None
    # prompt tokens whose K/V came from the prefix cache (vLLM's RequestOutput.num_cached_tokens)
    num_cached_tokens: int = 0
