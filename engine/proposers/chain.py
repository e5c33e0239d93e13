"""The propose loop every model drafter shares: a chain of drafts, one position per pass, each request
until its own cap.

A drafter supplies only its pass, `advance(step, rows, drafts)`: the logits of the next position for
the requests at `rows` (indices into the batch), whose drafts so far are `drafts[row]`. It may drop
rows it cannot run (its KV pool is full), returning the rows it ran. All the rows of a pass are
sampled at once (engine/sample/drafting.py): the target's own transforms, one random draw per
drafted token from the request's own generator, so a seeded request's drafts do not depend on the
rest of the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.proposers.base import DraftProposal, model_draft_proposal
from engine.request import Request
from engine.sample.drafting import sample_drafts

# (step, rows, drafts) -> (rows that ran, their logits [len(rows), vocab])
Advance = Callable[[int, list[int], dict[int, list[int]]], tuple[list[int], torch.Tensor]]


def draft_chains(requests: list[Request], caps: list[int], advance: Advance) -> list[DraftProposal]:
    rows = [i for i, cap in enumerate(caps) if cap > 0]
    drafts: dict[int, list[int]] = {i: [] for i in rows}
    probs: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
    step = 0
    while rows:
        rows, logits = advance(step, rows, drafts)
        if not rows:
            break
        tokens, q = sample_drafts(logits, [requests[i] for i in rows], [drafts[i] for i in rows])
        for position, i in enumerate(rows):
            drafts[i].append(tokens[position])
            if q is not None:
                probs[i].append(q[position])
        step += 1
        rows = [i for i in rows if caps[i] > step]
    return [model_draft_proposal(request, drafts.get(i, []), probs.get(i, []))
            for i, request in enumerate(requests)]
