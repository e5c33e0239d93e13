"""Logits -> the distribution each row samples from, and the uniforms the draws use: the one law of
the target's p and every drafter's q (engine/sample/drafting.py builds a drafting pass's metadata
and calls the same functions), so p and q are compared like with like, and a new sampling
parameter is added here once.

In vLLM's order: min_tokens bans and logit_bias, then the penalties (engine/sample/penalties.py),
then argmax for greedy requests or, for random ones, the row laws (engine/sample/row_laws.py:
temperature, min_p, top-k and top-p), with per-row parameters applied to all rows at once
(sampling metadata). Every draw is an inverse CDF at one uniform. An unseeded request's uniforms come from one batched draw on the device; a seeded
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


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """p for every row: [num_rows, vocab] float32. Greedy rows come out untruncated at temperature 1;
    the rejection sampler never reads them."""
    rows = metadata.request_of_row  # [num_rows]
    logits = logits.float()
    for law, values, step_values in metadata.row_laws:
        logits = law.apply(logits, values[rows], step_values)
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
