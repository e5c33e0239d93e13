"""Logits -> the distribution each row samples from, and the uniforms the draws use: the one law of
the target's p and every drafter's q (engine/sample/drafting.py builds a drafting pass's metadata
and calls the same functions), so p and q are compared like with like, and a new sampling
parameter is added here once.

In vLLM's order: min_tokens bans and logit_bias, then the penalties (engine/sample/penalties.py),
then argmax for greedy requests or, for random ones, temperature, min_p, top-k and top-p, with
per-row parameters applied to all rows at once (sampling metadata). Every draw is an inverse CDF at
one uniform. An unseeded request's uniforms come from one batched draw on the device; a seeded
request's are keyed by (seed, output position, stream) (engine/sample/keyed_random.py), computed on
the host, so its tokens depend on neither the batch, the device, nor how many numbers earlier steps
used (draft lengths, cache hits).

Numerics: a row whose processed logits leave no probability (every logit -inf, or a NaN or +inf
after temperature) gets p = 0 everywhere, never NaN; the samplers then emit the argmax of its
processed logits (target_argmax). A q without mass becomes one-hot at its argmax.
"""

from __future__ import annotations

import torch

from engine.sample.keyed_random import keyed_uniforms
from engine.sample.metadata import SamplingMetadata
from engine.sample.penalties import apply_penalties
from kernels.rejection_reference import to_fixed_point


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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens less likely than min_p times each row's most likely token (vLLM),
    compared in log space: logit - max < log(min_p). logits: [rows, vocab], tempered; min_p:
    [rows], 0 = all."""
    top = logits.amax(dim=-1, keepdim=True)  # [rows, 1]
    return logits.masked_fill(logits - top < min_p.to(logits.dtype).log()[:, None], float("-inf"))


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """p for every row: [num_rows, vocab] float32. Greedy rows come out untruncated at temperature 1;
    the rejection sampler never reads them."""
    rows = metadata.request_of_row  # [num_rows]
    logits = logits.float() / metadata.temperature[rows, None]
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p[rows])
    if metadata.max_top_k:
        logits = apply_top_k(logits, metadata.top_k[rows], metadata.max_top_k)
    if metadata.has_top_p:
        logits = apply_top_p(logits, metadata.top_p[rows])
    # NOTE: a row whose largest logit is NaN or +inf, or that is all -inf, comes out of softmax all
    # NaN (its denominator is NaN); zeros say "no mass" to the samplers, at a fraction of the cost
    # of a masked fill
    return logits.softmax(dim=-1).nan_to_num_(nan=0.0)  # [num_rows, vocab]


def draft_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """q for a drafting pass's rows (SamplingMetadata.for_draft_rows), by target_probs's law; a row
    without mass becomes one-hot at the argmax of its logits (NaN counting as -inf): still a
    distribution the draft is drawn from, so verification stays lossless. logits: [rows, vocab],
    processed (process_logits); returns [rows, vocab] float32."""
    probs = target_probs(logits, metadata)
    no_mass = (~(probs.amax(dim=-1) > 0)).nonzero()[:, 0]  # [rows without mass], almost always none
    if len(no_mass):
        rows = torch.nan_to_num(logits[no_mass].float(), nan=float("-inf"))
        probs[no_mass] = torch.zeros_like(rows).scatter_(-1, rows.argmax(dim=-1, keepdim=True), 1.0)
    return probs


# vocabulary block of the two-level inverse CDF (draw_tokens)
DRAW_BLOCK = 1024


def draw_tokens(probs: torch.Tensor, uniforms: torch.Tensor,
                fallback_token_ids: torch.Tensor) -> torch.Tensor:
    """kernels.rejection_reference.inverse_cdf(to_fixed_point(probs), ...) token for token, in two
    levels: a sum per DRAW_BLOCK tokens finds the block holding the draw, one block's cumsum the
    token (exact integer sums, so the same first token whose CDF passes the threshold), at a
    fraction of a full-row int64 cumsum's cost on the CPU. probs: [rows, vocab] float32 >= 0;
    uniforms: [rows] float64; fallback_token_ids: [rows], the token of a row without mass."""
    rows, vocab = probs.shape
    fixed = to_fixed_point(probs)  # [rows, vocab] int64
    if vocab % DRAW_BLOCK:
        fixed = torch.nn.functional.pad(fixed, (0, -vocab % DRAW_BLOCK))
    blocks = fixed.view(rows, -1, DRAW_BLOCK)  # [rows, num_blocks, DRAW_BLOCK]
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [rows, num_blocks] exact
    total = block_cdf[:, -1:]  # [rows, 1]
    threshold = torch.minimum((uniforms[:, None].double() * total.double()).to(torch.int64),
                              total - 1)  # [rows, 1] as inverse_cdf's
    block = torch.searchsorted(block_cdf, threshold, right=True)  # [rows, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0)  # [rows, 1]
    inner_cdf = before + blocks[torch.arange(rows, device=probs.device), block[:, 0]].cumsum(-1)
    inner = torch.searchsorted(inner_cdf, threshold, right=True)  # [rows, 1]
    return torch.where(total[:, 0] > 0, (block * DRAW_BLOCK + inner)[:, 0], fallback_token_ids)


def draw_uniforms(metadata: SamplingMetadata, num_draft_tokens: int, num_rows: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's random numbers: ([num_draft_tokens] acceptance uniforms, [num_rows] sample uniforms),
    float64. One batched draw on the device; seeded requests' entries are then replaced by their
    keyed uniforms (one vectorised Philox pass on the host over all of them, one copy)."""
    uniforms = torch.rand(num_draft_tokens + num_rows, dtype=torch.float64, device=device)
    if metadata.seeded:
        own = torch.from_numpy(keyed_uniforms(*metadata.seeded_uniform_keys))  # [sum(2k + 1)]
        uniforms.index_copy_(0, metadata.seeded_uniform_index, own.to(device))
    return uniforms[:num_draft_tokens], uniforms[num_draft_tokens:]


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata,
                   draft_token_ids: torch.Tensor) -> torch.Tensor:
    """What every row's token choice starts from: min_tokens bans and logit_bias, then the
    penalties, each row seeing the output so far up to its own position (its request's committed
    output, then the drafts before the row). logits: [num_rows, vocab]; draft_token_ids:
    [num_draft_tokens], the step's drafts. A step that uses none of these returns `logits` itself."""
    logits = mask_banned_tokens(logits, metadata)
    if metadata.logit_bias is None and metadata.penalties is None:
        return logits
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # NOTE: a bias or penalty must not be lost to half precision
    if metadata.logit_bias is not None:
        rows, token_ids, values = metadata.logit_bias
        logits = logits.index_put((rows, token_ids), values.to(logits.dtype), accumulate=True)
    if metadata.penalties is not None:
        logits = apply_penalties(logits, metadata.penalties, draft_token_ids)
    return logits


def mask_banned_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Before min_tokens is reached, EOS and stop tokens cannot be chosen (a copy when any is banned)."""
    if metadata.banned is None:
        return logits
    rows, token_ids = metadata.banned
    return logits.index_put((rows, token_ids), logits.new_tensor(float("-inf")))
