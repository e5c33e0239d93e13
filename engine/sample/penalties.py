"""Presence, frequency and repetition penalties at every logits row, as if decoding one token at a time.

Row j of a request's 1 + k rows predicts the token after drafts d_1..d_j, so its "output so far" is
the committed output followed by d_1..d_j (DESIGN.md). Per step, for the requests that use
penalties: token counts of each request's committed output (one scatter on the device), copied to
each of its rows, plus each row's draft prefix (one more scatter over the (row, earlier draft)
pairs). A step where no request uses penalties builds none of this (SamplingMetadata.penalties is
None). Order and formulas follow vLLM: repetition first, then frequency and presence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.sample.transfer import to_device


@dataclass
class PenaltyMetadata:
    """The penalised requests of one step (a subset of the sampling requests), as tensors."""

    # [num_penalty_rows] int64: logits rows of the penalised requests, request after request
    rows: torch.Tensor
    # [num_penalty_rows] int64: each of those rows' request, numbered among the penalised ones
    request_of_row: torch.Tensor
    # [num_penalty_requests] float64 each: the coefficients of each penalised request
    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    # the committed output tokens: ([num_output] request, [num_output] token id) int64
    output: tuple[torch.Tensor, torch.Tensor]
    # the prompt tokens, only when some request has a repetition penalty: (request, token id)
    prompt: tuple[torch.Tensor, torch.Tensor] | None
    # each row's earlier drafts: ([num_pairs] index into `rows`, [num_pairs] index into the step's
    # draft tokens); None when no penalised request verifies drafts
    draft_pairs: tuple[torch.Tensor, torch.Tensor] | None
    num_requests: int

    @classmethod
    def build(cls, requests: list[Request], logits_starts: list[int], draft_starts: list[int],
              row_drafts: list[list[list[int]]], device: torch.device) -> PenaltyMetadata:
        """The penalised requests with their first logits row, first index in the step's drafts,
        and the drafts (indices into the request's) each of their rows has seen, row by row."""
        rows: list[int] = []
        request_of_row: list[int] = []
        owners: list[int] = []
        output_ids: list[int] = []
        prompt_owners: list[int] = []
        prompt_ids: list[int] = []
        pair_rows: list[int] = []
        pair_drafts: list[int] = []
        has_repetition = any(r.params.repetition_penalty != 1.0 for r in requests)
        for index, (request, row, draft_start, paths) in enumerate(
                zip(requests, logits_starts, draft_starts, row_drafts)):
            first = len(rows)
            rows += range(row, row + len(paths))
            request_of_row += [index] * len(paths)
            owners += [index] * request.num_output_tokens
            output_ids += request.output_token_ids
            if has_repetition and request.params.repetition_penalty != 1.0:
                prompt_owners += [index] * request.num_prompt_tokens
                prompt_ids += request.prompt_token_ids
            # NOTE: a row has seen the drafts on its path (of a chain, row j the first j: k(k+1)/2
            # pairs per request)
            for j, path in enumerate(paths):
                pair_rows += [first + j] * len(path)
                pair_drafts += [draft_start + draft for draft in path]
        (rows_t, request_of_row_t, owners_t, output_t, prompt_owners_t, prompt_t, pair_rows_t,
         pair_drafts_t) = to_device([rows, request_of_row, owners, output_ids, prompt_owners,
                                     prompt_ids, pair_rows, pair_drafts], torch.int64, device)
        frequency, presence, repetition = to_device(
            [[r.params.frequency_penalty for r in requests],
             [r.params.presence_penalty for r in requests],
             [r.params.repetition_penalty for r in requests]], torch.float64, device)
        return cls(rows=rows_t, request_of_row=request_of_row_t, frequency=frequency,
                   presence=presence, repetition=repetition, output=(owners_t, output_t),
                   prompt=(prompt_owners_t, prompt_t) if has_repetition else None,
                   draft_pairs=(pair_rows_t, pair_drafts_t) if pair_rows else None,
                   num_requests=len(requests))


def row_token_counts(penalties: PenaltyMetadata, draft_token_ids: torch.Tensor, vocab_size: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """[num_penalty_rows, vocab]: how often each token occurs in the output before each row (the
    committed output, then the row's earlier drafts). draft_token_ids: [num_draft_tokens], the
    step's drafts."""
    owners, token_ids = penalties.output
    one = torch.ones((), dtype=dtype, device=token_ids.device)
    counts = torch.zeros(penalties.num_requests, vocab_size, dtype=dtype, device=token_ids.device)
    counts.index_put_((owners, token_ids), one, accumulate=True)  # [num_requests, vocab]
    counts = counts[penalties.request_of_row]  # [num_penalty_rows, vocab]
    if penalties.draft_pairs is not None:
        pair_rows, pair_drafts = penalties.draft_pairs
        counts.index_put_((pair_rows, draft_token_ids[pair_drafts]), one, accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata,
                    draft_token_ids: torch.Tensor) -> torch.Tensor:
    """Penalised copy of logits [num_rows, vocab]; rows of requests without penalties unchanged."""
    rows = logits[penalties.rows]  # [num_penalty_rows, vocab]
    counts = row_token_counts(penalties, draft_token_ids, logits.shape[-1], logits.dtype)
    in_prompt = None
    if penalties.prompt is not None:
        owners, token_ids = penalties.prompt
        seen = torch.zeros(penalties.num_requests, logits.shape[-1], dtype=torch.bool,
                           device=logits.device)
        seen[owners, token_ids] = True
        in_prompt = seen[penalties.request_of_row]  # [num_penalty_rows, vocab]
    of_row = penalties.request_of_row
    dtype = logits.dtype
    rows = penalize(rows, counts, in_prompt, penalties.frequency[of_row].to(dtype),
                    penalties.presence[of_row].to(dtype), penalties.repetition[of_row].to(dtype))
    return logits.index_copy(0, penalties.rows, rows)


def penalize(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor | None,
             frequency: torch.Tensor, presence: torch.Tensor,
             repetition: torch.Tensor) -> torch.Tensor:
    """The penalties on rows whose history is known. logits, counts: [rows, vocab] (counts of each
    token in the output so far); in_prompt: [rows, vocab] bool, or None when no row has a
    repetition penalty; frequency, presence, repetition: [rows]. Neutral coefficients (0, 0, 1)
    leave a row exactly as it was."""
    in_output = counts > 0  # [rows, vocab]
    if in_prompt is not None:
        penalty = repetition[:, None]  # [rows, 1]
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(in_prompt | in_output, scaled, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * in_output
