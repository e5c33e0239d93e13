"""Draft tokens and their q for every row of a drafting pass at once, by the target's own law.

A drafter's row i chooses the token after requests[i]'s output and then drafts[i], the drafts of
this proposal so far: exactly where the target's verification row after those drafts will choose.
So the row is transformed as that target row will be (grammar mask, min_tokens bans, logit_bias,
penalties counting the output then the drafts, temperature, min_p, top-k, top-p), by the same
functions over the same per-row metadata (SamplingMetadata.for_draft_rows): q and p are compared
like with like, and a new sampling parameter reaches drafters without a line here.

A greedy request's draft is the argmax of its row. A random request's is one inverse-CDF draw from
q at a uniform of the request's own generator (seeded requests: their drafts depend on nothing
else in the batch), over the rejection sampler's exact fixed-point CDF (draw_tokens). One host
transfer per pass, whatever the number of rows.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sample.grammar import mask_draft_logits
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import draft_probs, draw_tokens, process_logits


def draft_logits(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]
                 ) -> tuple[torch.Tensor, SamplingMetadata]:
    """logits [rows, vocab] as the target's rows after the same drafts will be, before
    temperature; and the rows' metadata (for draft_probs)."""
    device = logits.device
    metadata = SamplingMetadata.for_draft_rows(requests, drafts, device)
    draft_token_ids = torch.tensor([token for draft in drafts for token in draft],
                                   dtype=torch.int64, device=device)
    processed = process_logits(mask_draft_logits(logits, requests, drafts), metadata,
                               draft_token_ids)
    return processed, metadata


def sample_drafts(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]
                  ) -> tuple[list[int], torch.Tensor | None]:
    """Each row's next draft token, and q [rows, vocab] (the distribution each random request's
    token was drawn from; greedy requests' rows are not) or None when every request is greedy."""
    processed, metadata = draft_logits(logits, requests, drafts)
    tokens = processed.argmax(dim=-1)  # [rows] greedy requests' drafts
    if metadata.is_all_greedy:
        return tokens.tolist(), None
    q = draft_probs(processed, metadata)  # [rows, vocab]
    random_rows = [i for i, request in enumerate(requests) if not request.params.is_greedy]
    # NOTE: one uniform per drafted token from the request's own generator (CPU), in row order
    uniforms = torch.cat([torch.rand(1, dtype=torch.float64, generator=requests[i].generator)
                          for i in random_rows]).to(logits.device)
    rows = torch.tensor(random_rows, dtype=torch.int64, device=logits.device)
    tokens[rows] = draw_tokens(q[rows], uniforms, tokens[rows])
    return tokens.tolist(), q
