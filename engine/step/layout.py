"""Where everything of one step sits in its flattened batch, worked out once per step.

Input building reads the logits rows from it, the rejection sampler the drafts and sampling tensors,
commit and the proposers each request's rows. Drafts travel as typed objects: a proposer returns a
`DraftProposal` per request, the engine hands them to the scheduler as one `DraftTokens`, and the
scheduler puts what fits the step into its `ScheduledRequest`s.

    one step: A mid-prefill (4 prompt tokens), B verifying k = 2 drafts, C decoding with k = 0
    token rows   | 0  1  2  3  | 4  5   6   | 7  |   token_starts [0, 4, 7, 8]
                 | A  A  A  A  | Bt Bx1 Bx2 | Ct |   (t: the last known token, x: a draft)
    logits rows                | 0  1   2   | 3  |   logits_indices [4, 5, 6, 7], logits_starts [0, 3]
    drafts [Bx1, Bx2], cu_num_draft_tokens [2, 2]

A request verifying a TREE of drafts (engine/draft_tree.py) has the same rows, one per draft in the
proposal's depth-first order; `draft_parents` says which row each draft follows, and the accepted
path's rows (`kept_rows`) need not be the first ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.draft_tree import chain_parents, check_parents, is_chain, main_chain_length
from engine.sample.metadata import SamplingMetadata
from engine.sample.transfer import to_device
from engine.step.types import ScheduledRequest


@dataclass
class DraftProposal:
    # the draft tokens, in order; may be empty (no guess for this request this step)
    token_ids: list[int]
    # [len(token_ids), vocab] float32 draft distribution q at each position, or None when the draft
    # is deterministic (n-gram, suffix): the rejection sampler then treats q as one-hot
    probs: torch.Tensor | None = None
    # a tree of drafts (engine/draft_tree.py): draft j's parent draft, -1 under the newest token;
    # None: a chain
    parents: list[int] | None = None

    def __post_init__(self) -> None:
        if self.parents is not None:
            if len(self.parents) != len(self.token_ids):
                raise ValueError("a draft tree needs one parent per draft token")
            check_parents(self.parents)
            if is_chain(self.parents):
                self.parents = None

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def first(self, k: int) -> DraftProposal:
        """The draft's first k tokens (a prefix of a draft, chain or depth-first tree, is a draft)."""
        if k >= len(self.token_ids):
            return self
        return DraftProposal(self.token_ids[:k], None if self.probs is None else self.probs[:k],
                             None if self.parents is None else self.parents[:k])

    def keep(self, drafts: list[int]) -> DraftProposal:
        """Only `drafts` (ascending indices, each with its parent): still a tree in order, since
        dropping whole subtrees from a depth-first listing leaves one."""
        position = {draft: i for i, draft in enumerate(drafts)}
        parents = None if self.parents is None else [
            -1 if self.parents[d] < 0 else position[self.parents[d]] for d in drafts]
        return DraftProposal([self.token_ids[d] for d in drafts],
                             None if self.probs is None else self.probs[drafts], parents)

    def main_chain(self) -> DraftProposal:
        """The first branch alone, a chain (for what only follows one path: grammars, penalties)."""
        return self.first(main_chain_length(self.parents, len(self.token_ids)))


@dataclass
class DraftTokens:
    """Drafts proposed at the end of a step for the next one: what the engine hands the scheduler
    (`Scheduler.update_draft_token_ids`). A request left out keeps the draft it had."""

    # request id -> its proposal (an empty one clears the request's draft)
    proposals: dict[str, DraftProposal]


@dataclass
class StepLayout:
    # ---- every scheduled request, in batch order ----
    # [num_scheduled + 1] host: request i's tokens are rows token_starts[i] .. token_starts[i+1]-1
    token_starts: list[int]
    # ---- the sampling requests, in batch order (each has 1 + k_i rows of logits) ----
    sampling: list[ScheduledRequest]
    # [batch] host: each sampling request's first logits row; its rows are start .. start + k_i
    logits_starts: list[int]
    # [num_rows] int64: rows of the flattened batch whose logits are needed, request after request
    # (its last known token's row, then one per draft token); num_rows = num_draft_tokens + batch
    logits_indices: torch.Tensor
    # the same rows on the host (what the target pass's input carries to every rank)
    logits_rows: list[int]
    # [num_draft_tokens] int64: the drafts verified this step, request after request
    draft_token_ids: torch.Tensor
    # [batch] int64: request i owns drafts [cu[i-1], cu[i])
    cu_num_draft_tokens: torch.Tensor
    # [num_draft_tokens, vocab] float32 q, or None when every draft is one-hot; rows of greedy
    # requests are never read (left unset)
    draft_probs: torch.Tensor | None
    # the largest k in the batch
    max_num_draft_tokens: int
    # [num_draft_tokens] int64: each draft's parent draft within its request (-1: under the newest
    # token), when some request verifies a tree; None when every draft is a chain
    draft_parents: torch.Tensor | None
    # per-request temperature, top-k, top-p, seeds and the rest, as tensors
    sampling_metadata: SamplingMetadata

    @property
    def num_rows(self) -> int:
        return len(self.logits_indices)

    @classmethod
    def build(cls, scheduled: list[ScheduledRequest], device: torch.device) -> StepLayout:
        token_starts = [0]
        sampling: list[ScheduledRequest] = []
        logits_starts: list[int] = []
        logits_indices: list[int] = []
        draft_token_ids: list[int] = []
        draft_parents: list[int] = []
        num_drafts: list[int] = []
        for item in scheduled:
            end = token_starts[-1] + item.num_new_tokens
            token_starts.append(end)
            if not item.is_sampling:
                continue
            k = item.num_draft_tokens
            sampling.append(item)
            logits_starts.append(len(logits_indices))
            logits_indices += range(end - 1 - k, end)
            draft_token_ids += item.draft_token_ids
            draft_parents += item.draft_parents or chain_parents(k)
            num_drafts.append(k)
        has_tree = any(item.draft_parents is not None for item in sampling)
        logits_indices_t, draft_token_ids_t, cu_num_draft_tokens, *draft_parents_t = to_device(
            [logits_indices, draft_token_ids, list(accumulate(num_drafts))]
            + ([draft_parents] if has_tree else []), torch.int64, device)
        return cls(
            token_starts=token_starts,
            sampling=sampling,
            logits_starts=logits_starts,
            logits_indices=logits_indices_t,
            logits_rows=logits_indices,
            draft_token_ids=draft_token_ids_t,
            cu_num_draft_tokens=cu_num_draft_tokens,
            draft_probs=_draft_probs(sampling, len(draft_token_ids), device),
            max_num_draft_tokens=max(num_drafts, default=0),
            draft_parents=draft_parents_t[0] if has_tree else None,
            sampling_metadata=SamplingMetadata.build(
                [item.request for item in sampling], num_drafts, logits_starts, device,
                [item.draft_parents for item in sampling]),
        )

    def rows_of(self, index: int) -> range:
        """Logits rows of sampling request `index`: its 1 + k rows."""
        start = self.logits_starts[index]
        return range(start, start + self.sampling[index].num_draft_tokens + 1)

    def kept_rows(self, index: int, kept_drafts: list[int]) -> list[int]:
        """Logits rows of the tokens sampling request `index` kept: the row after its newest token,
        then the row after each accepted draft (a tree's path need not be its first rows)."""
        start = self.logits_starts[index]
        return [start] + [start + 1 + draft for draft in kept_drafts]


def _draft_probs(items: list[ScheduledRequest], num_draft_tokens: int,
                 device: torch.device) -> torch.Tensor | None:
    """[num_draft_tokens, vocab] q of every draft, or None when no proposer gave one."""
    given = [item.draft_probs for item in items if item.draft_probs is not None]
    if not given:
        return None
    probs = torch.empty(num_draft_tokens, given[0].shape[-1], dtype=torch.float32, device=device)
    start = 0
    for item in items:
        k = item.num_draft_tokens
        if item.draft_probs is not None:
            probs[start:start + k] = item.draft_probs
        elif k and not item.request.params.is_greedy:
            # NOTE: a random request without q beside requests with one (no proposer mixes them)
            rows = probs[start:start + k].zero_()
            rows[torch.arange(k), torch.tensor(item.draft_token_ids, dtype=torch.int64)] = 1.0
        start += k
    return probs
