"""A request that fails fails alone.

The step's per-request work runs batched (sampling with its grammar masks and penalties, drafting).
When a batched call raises, the engine cannot tell whose fault it was, so it runs the same work
request by request: the requests that raise again are ended with an error (FinishReason.ERROR), and
every other request gets exactly what the batched call computes for it (sampling and drafting are
batch-invariant: greedy and seeded tokens do not depend on batch mates). Only failures of shared
state (the target's forward, the KV pool, scheduling) still stop the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.failures import describe
from engine.request import Request
from engine.step.layout import DraftProposal, StepLayout
from engine.step.types import SampledTokens

logger = logging.getLogger(__name__)

SampleFn = Callable[[torch.Tensor, StepLayout], list[SampledTokens]]
ProposeFn = Callable[[list[Request], list[int], torch.Tensor], list[DraftProposal]]


def sample_isolated(sample: SampleFn, logits: torch.Tensor,
                    layout: StepLayout) -> list[SampledTokens]:
    """`sample(logits, layout)`; after a failure, each sampling request alone over its own rows
    (logits: [num_rows, vocab]), a request that raises again getting SampledTokens.error."""
    try:
        return sample(logits, layout)
    except Exception as error:  # NOTE: a batched failure; whose it is, the retry below finds out
        logger.warning("sampling a batch of %d failed (%s); sampling its requests one by one",
                       len(layout.sampling), describe(error))
    sampled = []
    for index, item in enumerate(layout.sampling):
        rows = layout.rows_of(index)
        try:
            [kept] = sample(logits[rows.start:rows.stop], StepLayout.build([item], logits.device))
        except Exception as error:
            logger.exception("request %s failed in sampling", item.request.request_id)
            kept = SampledTokens([], error=f"sampling failed: {describe(error)}")
        sampled.append(kept)
    return sampled


def propose_isolated(propose: ProposeFn, requests: list[Request], caps: list[int],
                     target_hidden: torch.Tensor,
                     ) -> tuple[list[DraftProposal], dict[str, str]]:
    """`propose(requests, caps, target_hidden)` (target_hidden: [len(requests), hidden]); after a
    failure, each request alone. Returns the proposals (empty for a request that failed) and
    {request_id: why} for the requests whose drafting raised on their own."""
    try:
        return propose(requests, caps, target_hidden), {}
    except Exception as error:
        logger.warning("drafting for %d requests failed (%s); drafting for each alone",
                       len(requests), describe(error))
    proposals: list[DraftProposal] = []
    failures: dict[str, str] = {}
    for index, (request, cap) in enumerate(zip(requests, caps)):
        try:
            [proposal] = propose([request], [cap], target_hidden[index:index + 1])
        except Exception as error:
            logger.exception("request %s failed in drafting", request.request_id)
            failures[request.request_id] = f"drafting failed: {describe(error)}"
            proposal = DraftProposal([])
        proposals.append(proposal)
    return proposals, failures
