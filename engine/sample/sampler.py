"""Logits -> next tokens for the requests that sample this step.

Greedy rows take the argmax. Random rows apply temperature, then top-k, then top-p, and draw with the
exponential race (argmax of p / E, E ~ Exp(1)), which samples exactly from p; a seeded request draws its E
from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from engine.request import Request, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import SampledTokens


def apply_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude; logits: [vocab] or [rows, vocab], already tempered."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # NOTE: drop a token when the mass before it already reaches top_p; the top token always stays
        drop_sorted = (cum_probs - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a random request samples from: [vocab] or [rows, vocab], float32."""
    logits = logits.float() / params.temperature
    return apply_top_k_top_p(logits, params.top_k_or_none, params.top_p).softmax(dim=-1)


def exponential_race(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from `probs` [vocab]: argmax(p / E) with E ~ Exp(1) i.i.d. picks i with probability p_i.

    A seeded request's generator lives on the CPU, so its draws are the same on every device.
    """
    if generator is not None and generator.device != probs.device:
        noise = torch.empty(probs.shape, dtype=probs.dtype).exponential_(generator=generator)
        noise = noise.to(probs.device)
    else:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # 0/0 would make a masked token win
    return int(torch.argmax(probs / noise))


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """Log-probabilities of the raw target distribution (before temperature), as OpenAI reports them."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    chosen = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen_lp = logprobs.gather(1, chosen[:, None])  # [rows, 1]
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1  # [rows]
    max_top = max(num_top)
    top_lp, top_ids = torch.topk(logprobs, max_top, dim=-1) if max_top else (None, None)
    out = []
    for row, token_id in enumerate(token_ids):
        top = [] if not num_top[row] else list(zip(top_ids[row, :num_top[row]].tolist(),
                                                   top_lp[row, :num_top[row]].tolist()))
        out.append(TokenLogprobs(token_id, float(chosen_lp[row]), int(ranks[row]), top))
    return out


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledTokens]:
        """logits: [num_requests, vocab], row i for requests[i]; returns one token per request."""
        raw_logits = logits
        logits = mask_banned_tokens(logits, [(row, r, r.num_output_tokens)
                                             for row, r in enumerate(requests)])
        token_ids = torch.argmax(logits, dim=-1).tolist()  # greedy answer for every row
        for row, request in enumerate(requests):
            if request.params.is_greedy:
                continue
            probs = target_probs(logits[row], request.params)
            token_ids[row] = exponential_race(probs, request.generator)  # NOTE: as RejectionSampler
        want = [r.params.logprobs for r in requests]
        if all(n is None for n in want):
            return [SampledTokens([t]) for t in token_ids]
        rows = [i for i, n in enumerate(want) if n is not None]
        lps = compute_logprobs(raw_logits[rows], [token_ids[i] for i in rows], [want[i] for i in rows])
        by_row = dict(zip(rows, lps))
        return [SampledTokens([t], None if i not in by_row else [by_row[i]])
                for i, t in enumerate(token_ids)]


def mask_banned_tokens(logits: torch.Tensor,
                       rows: list[tuple[int, Request, int]]) -> torch.Tensor:
    """Before min_tokens is reached, EOS and stop tokens cannot be chosen.

    rows: (logits row, its request, index of the output token that row picks).
    """
    banned = [(row, r) for row, r, index in rows if index < r.params.min_tokens]
    if not banned:
        return logits
    logits = logits.clone()
    for row, request in banned:
        logits[row, list(request.eos_token_ids | set(request.params.stop_token_ids))] = float("-inf")
    return logits
