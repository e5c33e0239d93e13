"""The data one engine step passes between its parts, in a module that depends on none of them.

The scheduler plans `ScheduledRequest`s and the `ForwardInput` of the target pass (plain data: the one
thing every tensor-parallel rank needs, broadcast as it is); the rejection sampler returns a
`SampledTokens` per sampling request; commit turns them into `RequestUpdate`s, and `EngineCore.step()`
returns those with the step's stats as one `StepResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.draft_tree import is_chain
from engine.request import FinishReason, Request, TokenLogprobs
from engine.request_report import ReportCarrier, RequestReport


@dataclass
class ScheduledRequest:
    request: Request
    # tokens whose K/V this step computes: a prefill chunk, or 1 + num_draft_tokens for a decode step
    num_new_tokens: int
    # NOTE: fixed when scheduled; the request itself moves on at commit
    is_sampling: bool = False
    # the request's draft tokens verified in this step (the tail of num_new_tokens); [] = plain decode
    draft_token_ids: list[int] = field(default_factory=list)
    # [num_draft_tokens, vocab] their draft distribution q, None for one-hot drafts
    draft_probs: torch.Tensor | None = None
    # a tree of drafts: each draft's parent draft, -1 under the newest token; None = a chain
    draft_parents: list[int] | None = None

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens of prompt + output computed this step (not drafts)."""
        return self.num_new_tokens - self.num_draft_tokens


@dataclass
class SampledTokens:
    """What verification kept for one request: accepted drafts, then one recovered or bonus token."""

    token_ids: list[int]
    # one per token when the request asked for logprobs
    logprobs: list[TokenLogprobs] | None = None
    # of a tree: the accepted drafts' indices (its path); None: the first len(token_ids) - 1 drafts
    accepted_drafts: list[int] | None = None
    # set when the request could not be sampled (non-finite logits, a broken grammar): no tokens,
    # and the engine ends the request with this message (FinishReason.ERROR)
    error: str | None = None

    @property
    def kept_drafts(self) -> list[int]:
        """Indices of the accepted drafts, in order."""
        if self.accepted_drafts is not None:
            return self.accepted_drafts
        return list(range(len(self.token_ids) - 1))


@dataclass
class RequestUpdate(ReportCarrier):
    """What one step did for one request: the tokens it emitted and, if it ended, why."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    # what the engine reports of the request, on its final update
    report: RequestReport | None = None
    # why the request failed, with finish_reason ERROR
    error: str | None = None


@dataclass
class StepStats:
    """One engine step, for the metrics the server owns (engine/core.py fills it).

    `is_step` False marks a snapshot sent after an abort, outside any step: only its gauges (running,
    waiting, KV-cache usage, preemptions) mean anything, so freed blocks show without waiting for work.
    """

    is_step: bool = True
    num_running: int = 0
    num_waiting: int = 0
    # fraction of KV blocks in use, 0..1
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    # prefix caching, running totals in tokens (vLLM's): prompt tokens looked up, and found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # speculation: drafts verified this step (one per request that had any), their tokens, accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose position i + 1 was accepted this step
    accepted_per_position: list[int] = field(default_factory=list)
    # per draft verified this step: how many of its tokens were accepted
    accepted_lengths: list[int] = field(default_factory=list)
    # seconds of this step in the target pass + verification, and in proposing the next drafts
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    # drafting for the next step: requests whose k was chosen, how many of them got k > 0, and the
    # sum of their k (fixed k: the configured k within each request's cap; adaptive: the choice)
    num_k_choices: int = 0
    num_speculating_choices: int = 0
    sum_chosen_k: int = 0


@dataclass
class StepResult:
    """What one `EngineCore.step()` did: every request's update, and the step's stats."""

    updates: list[RequestUpdate] = field(default_factory=list)
    # None when nothing was scheduled (no step ran)
    stats: StepStats | None = None


@dataclass
class SequenceRows:
    """One sequence's rows in a pass: its tokens in the slots of positions start .. start +
    len(token_ids) - 1 (and at those positions, unless `parents` makes them a tree)."""

    seq_id: str
    start: int
    token_ids: list[int]
    # over the rows: row r's parent row (-1 for row 0, earlier rows after it), at most
    # MAX_TREE_ROWS rows unless a chain; None = a chain (-1, 0, 1, ...), the ordinary causal rows
    parents: list[int] | None = None
    # the sequence's block table when the pass runs where its pool is not (a tensor-parallel rank
    # other than the scheduler's); None: the runner's own pool has it
    block_table: list[int] | None = None

    def tree_parents(self) -> list[int] | None:
        """The parents when the rows are a real tree, None when they are a chain."""
        return None if is_chain(self.parents) else self.parents


@dataclass
class ForwardInput:
    """The target pass of one step, as plain data: what every rank runs."""

    sequences: list[SequenceRows]
    # rows of the flattened batch whose logits (and hidden states) the step needs, in the step
    # layout's order (engine/step/layout.py's logits_indices, on the host)
    logits_rows: list[int]
