"""The per-request knobs that reshape a row's distribution once the logits are processed
(temperature, min_p, top-k, top-p), each declared once in ROW_LAWS: the value a request gives it,
the value that changes nothing, and what it does to a row. The sampling metadata builds a
per-request tensor for each law some request in the step uses (engine/sample/metadata.py), and
every row's probabilities, the target's p and every drafter's q alike, come from applying them in
this order (engine/sample/sampler.py).

A new knob of this kind (typical_p, an epsilon cutoff…) is its SamplingParams field, which the
HTTP APIs read (server/api_requests.py), and one RowLaw here, plus its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens less likely than min_p times each row's most likely token (vLLM),
    compared in log space: logit - max < log(min_p). logits: [rows, vocab], tempered; min_p:
    [rows], 0 = all."""
    top = logits.amax(dim=-1, keepdim=True)  # [rows, 1]
    return logits.masked_fill(logits - top < min_p.to(logits.dtype).log()[:, None], float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Mask (to -inf) all but each row's top_k logits; ties with the k-th are kept.
    logits: [rows, vocab]; top_k: [rows] int64, 0 = all; max_top_k: top_k's largest value."""
    max_top_k = min(max_top_k, logits.shape[-1])
    if max_top_k == 0:
        return logits
    top_values = torch.topk(logits, max_top_k, dim=-1).values  # [rows, max_top_k]
    kth = top_values.gather(-1, (top_k.clamp(1, max_top_k) - 1)[:, None])  # [rows, 1]
    kth = torch.where(top_k[:, None] > 0, kth, float("-inf"))  # a row without top-k keeps all
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what lies outside each row's nucleus: a token goes when the mass of the tokens
    before it already reaches top_p, so the top token always stays. logits: [rows, vocab]; top_p:
    [rows], 1 = all."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [rows, vocab]
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [rows, vocab]
    # NOTE: a row with top_p = 1 drops nothing, though its rounded mass may pass 1; the top token's
    # mass before is exactly 0, so a limit above 0 keeps it even where a tiny top_p (1e-50) rounds
    # to 0 in float32, which would drop every token
    smallest = torch.finfo(torch.float32).tiny
    limit = torch.where(top_p < 1.0, top_p.clamp_min(smallest), float("inf"))[:, None]  # [rows, 1]
    drop = torch.zeros_like(order, dtype=torch.bool).scatter(-1, order, mass_before >= limit)
    return logits.masked_fill(drop, float("-inf"))


# (logits [rows, vocab] float32, the law's value at each row [rows], the per-request values of the
# step as host numbers) -> logits
RowTransform = Callable[[torch.Tensor, torch.Tensor, list], torch.Tensor]


@dataclass(frozen=True)
class RowLaw:
    # the SamplingParams field it reads, and the name the sampling metadata keeps its tensor under
    name: str
    # the value that leaves a row as it is: a greedy request's, and what a step where no request
    # uses the law skips (so skipping changes no bit)
    neutral: float | int
    dtype: torch.dtype
    apply: RowTransform
    # a random request's value, when it is not simply the field's
    value_of: Callable[[SamplingParams], float | int] | None = None

    def value(self, params: SamplingParams) -> float | int:
        """The request's value for this law; greedy requests take the neutral one (their rows are
        only ever argmaxed, at temperature 1)."""
        if params.is_greedy:
            return self.neutral
        return self.value_of(params) if self.value_of else getattr(params, self.name)


# in the order they apply (vLLM's): temperature, then the cuts, min_p first
ROW_LAWS = (
    RowLaw("temperature", 1.0, torch.float32,
           lambda logits, temperature, _: logits / temperature[:, None]),
    RowLaw("min_p", 0.0, torch.float32, lambda logits, min_p, _: apply_min_p(logits, min_p)),
    # top_k < 0 means all, as 0 does
    RowLaw("top_k", 0, torch.int64, lambda logits, top_k, ks: apply_top_k(logits, top_k, max(ks)),
           value_of=lambda params: max(params.top_k, 0)),
    RowLaw("top_p", 1.0, torch.float32, lambda logits, top_p, _: apply_top_p(logits, top_p)),
)
