"""Sampling helpers for tests: top-k then top-p over rows that share one set of parameters (built on
engine/sample/sampler.py's per-row masks), and a drafter's q for one request's rows, computed by
the engine's own drafting path (engine/sample/drafting.py)."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sample.drafting import draft_logits
from engine.sample.row_laws import apply_top_k, apply_top_p
from engine.sample.sampler import draft_probs
from engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """One set of parameters for every row: [vocab] or [rows, vocab] logits, already tempered."""
    rows = logits.reshape(-1, logits.shape[-1])  # [rows, vocab]
    if top_k is not None and top_k < logits.shape[-1]:
        rows = apply_top_k(rows, rows.new_full((len(rows),), top_k, dtype=torch.int64), top_k)
    if top_p < 1.0:
        rows = apply_top_p(rows, rows.new_full((len(rows),), top_p, dtype=torch.float32))
    return rows.reshape(logits.shape)


def request_q(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A drafter's q at each row of `logits` ([vocab] or [rows, vocab]) for a request with `params`
    and no output yet: float32, the shape of `logits`."""
    rows = logits.reshape(-1, logits.shape[-1])
    request = Request("q", [1], params, frozenset())
    processed, metadata = draft_logits(rows, [request] * len(rows), [[] for _ in range(len(rows))])
    return draft_probs(processed, metadata).reshape(logits.shape)
