"""Verification: turn the target's 1 + k rows per request into the tokens speculation keeps.

Temperature, top-k and top-p are applied to the target p here, exactly as the plain sampler applies them
(draft q comes from its proposer already transformed the same way), then kernels/ runs the rejection
test. Greedy requests see p as one-hot at argmax(logits), so they keep precisely the tokens plain greedy
decoding would pick. Every random number is drawn here, from the request's own generator when it is
seeded, in a fixed order: the bonus draw (the same draw plain sampling makes), then the uniforms, then
the recovery noise.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sample.sampler import (
    Sampler,
    compute_logprobs,
    exponential_race,
    mask_banned_tokens,
    target_probs,
)
from engine.scheduler import SampledTokens, ScheduledRequest
from kernels import rejection_sample


class RejectionSampler:
    def __init__(self) -> None:
        self.plain = Sampler()

    def __call__(self, logits: torch.Tensor, items: list[ScheduledRequest]) -> list[SampledTokens]:
        """logits: [sum(1 + k_i), vocab], request after request; returns the kept tokens of each."""
        if not any(item.num_draft_tokens for item in items):
            return self.plain(logits, [item.request for item in items])
        num_rows, vocab = logits.shape
        rows_of: list[range] = []
        row_owner: list[tuple[int, Request, int]] = []
        start = 0
        for item in items:
            rows = range(start, start + item.num_draft_tokens + 1)
            rows_of.append(rows)
            row_owner += [(row, item.request, item.request.num_output_tokens + j)
                          for j, row in enumerate(rows)]
            start = rows.stop
        masked = mask_banned_tokens(logits, row_owner)

        # ---- p for every row, the draft tokens and q, and the random numbers ----
        probs = torch.empty(num_rows, vocab, dtype=torch.float32, device=logits.device)
        draft_ids: list[int] = []
        draft_q: list[torch.Tensor | None] = []
        bonus_ids, uniforms, noises = [], [], []
        for item, rows in zip(items, rows_of):
            request, k = item.request, item.num_draft_tokens
            rows_logits = masked[rows.start:rows.stop]  # [k + 1, vocab]
            if request.params.is_greedy:
                best = rows_logits.argmax(dim=-1)
                probs[rows.start:rows.stop] = torch.nn.functional.one_hot(best, vocab).float()
                bonus_ids.append(int(best[-1]))
            else:
                probs[rows.start:rows.stop] = target_probs(rows_logits, request.params)
                bonus_ids.append(exponential_race(probs[rows.stop - 1], request.generator))
            draft_ids += request.draft_token_ids[:k]
            draft_q.append(None if request.draft_probs is None else request.draft_probs[:k])
            if request.params.is_greedy:  # greedy acceptance and recovery use no random numbers
                uniforms.append(torch.zeros(k))
                noises.append(torch.ones(k, vocab))
                continue
            uniforms.append(torch.rand(k, generator=request.generator))
            noise = torch.empty(k, vocab).exponential_(generator=request.generator)
            noises.append(noise.clamp_min_(torch.finfo(noise.dtype).tiny))  # kernels need > 0

        device = logits.device
        num_drafts = torch.tensor([i.num_draft_tokens for i in items], dtype=torch.int64)
        output = rejection_sample(
            draft_token_ids=torch.tensor(draft_ids, dtype=torch.int64, device=device),
            cu_num_draft_tokens=num_drafts.cumsum(0).to(device),
            draft_probs=_stack_draft_probs(draft_q, items, draft_ids, vocab, device),
            target_probs=probs,
            bonus_token_ids=torch.tensor(bonus_ids, dtype=torch.int64, device=device),
            is_greedy=torch.tensor([i.request.params.is_greedy for i in items], device=device),
            # NOTE: drawn on the CPU, so a seeded request gets the same numbers on every device
            uniform_samples=torch.cat(uniforms).to(device),
            recovery_noise=torch.cat(noises).to(device),
            max_spec_len=int(num_drafts.max()),
        )  # [batch, max_k + 1], -1 padded
        return [self._kept(logits, row_ids.tolist(), item, rows)
                for row_ids, item, rows in zip(output.cpu(), items, rows_of)]

    @staticmethod
    def _kept(logits: torch.Tensor, row_ids: list[int], item: ScheduledRequest,
              rows: range) -> SampledTokens:
        token_ids = [t for t in row_ids if t >= 0]
        num_top = item.request.params.logprobs
        if num_top is None:
            return SampledTokens(token_ids)
        # NOTE: logprobs of emitted tokens come from the target at their own positions
        emitted_rows = logits[rows.start:rows.start + len(token_ids)]
        return SampledTokens(token_ids, compute_logprobs(emitted_rows, token_ids,
                                                         [num_top] * len(token_ids)))


def _stack_draft_probs(draft_q: list[torch.Tensor | None], items: list[ScheduledRequest],
                       draft_ids: list[int], vocab: int, device: torch.device
                       ) -> torch.Tensor | None:
    """[num_draft_tokens, vocab] q, one-hot where a proposer gave none; None if no proposer gave q."""
    if all(q is None for q in draft_q):
        return None
    parts = []
    start = 0
    for q, item in zip(draft_q, items):
        k = item.num_draft_tokens
        if q is None:
            ids = torch.tensor(draft_ids[start:start + k], dtype=torch.int64, device=device)
            q = torch.nn.functional.one_hot(ids, vocab).float()
        parts.append(q.to(device=device, dtype=torch.float32))
        start += k
    return torch.cat(parts)
