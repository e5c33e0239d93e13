"""Each sampling request's parameters as tensors, built once per step, so the sampler transforms every
row in one go instead of request by request."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.draft_tree import depths, row_paths, sibling_ranks
from engine.request import Request
from engine.sample.keyed_random import FIRST_ACCEPTANCE_STREAM, SAMPLE_STREAM
from engine.sample.penalties import PenaltyMetadata
from engine.sample.row_laws import ROW_LAWS, RowLaw
from engine.sample.transfer import to_device


@dataclass
class SamplingMetadata:
    # ---- per sampling request, in batch order ----
    # [batch] bool
    is_greedy: torch.Tensor
    # the row laws (engine/sample/row_laws.py) some request of the step uses, in their order, each
    # with its [batch] values (greedy requests' neutral) and the same as host numbers; a law no
    # request uses is left out, and the sampler skips it
    row_laws: list[tuple[RowLaw, torch.Tensor, list]]
    # ---- per logits row ----
    # [num_rows] int64: the sampling request each row belongs to
    request_of_row: torch.Tensor
    # ---- what the sampler may skip (host) ----
    is_all_greedy: bool
    has_greedy: bool
    # ---- seeded random requests: their uniforms are keyed by (seed, output position, stream) ----
    # (request, k) in batch order: each has 2k + 1 uniforms per step, acceptance ones first
    seeded: list[tuple[Request, int]]
    # the batch index of each of them
    seeded_batch_indices: list[int]
    # [sum(2k + 1)] int64: where those uniforms go in the step's uniforms (sampler.draw_uniforms)
    seeded_uniform_index: torch.Tensor | None
    # (seeds, output positions, streams), host int64 arrays [sum(2k + 1)]: each uniform's key
    # (engine/sample/keyed_random.py); in the order of seeded_uniform_index
    seeded_uniform_keys: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    # ---- min_tokens: (row, token id) pairs that cannot be chosen yet; None when there are none ----
    # ([num_banned] int64 rows, [num_banned] int64 token ids)
    banned: tuple[torch.Tensor, torch.Tensor] | None
    # ---- logprobs: batch indices of the requests that want them, and top-N for each ----
    logprobs_requests: list[int]
    num_top_logprobs: list[int]
    # ---- logits processing; each None when no request in the step uses it ----
    # logit_bias at every row of its request: ([n] int64 rows, [n] int64 token ids, [n] float64)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # presence / frequency / repetition penalties (engine/sample/penalties.py)
    penalties: PenaltyMetadata | None = None

    def law_values(self, name: str) -> torch.Tensor | None:
        """The [batch] values of the row law `name`; None when no request of the step uses it."""
        return next((values for law, values, _ in self.row_laws if law.name == name), None)

    def _law_values_or_neutral(self, name: str) -> torch.Tensor:
        values = self.law_values(name)
        if values is not None:
            return values
        law = next(law for law in ROW_LAWS if law.name == name)
        return torch.full(self.is_greedy.shape, law.neutral, dtype=law.dtype,
                          device=self.is_greedy.device)

    @property
    def temperature(self) -> torch.Tensor:
        """[batch] float32: the divisor of the logits (1 for greedy requests, which never use p)."""
        return self._law_values_or_neutral("temperature")

    @property
    def top_k(self) -> torch.Tensor:
        """[batch] int64: keep the top_k most likely tokens; 0 = all."""
        return self._law_values_or_neutral("top_k")

    @property
    def top_p(self) -> torch.Tensor:
        """[batch] float32: nucleus mass; 1 = all."""
        return self._law_values_or_neutral("top_p")

    @property
    def min_p(self) -> torch.Tensor | None:
        """[batch] float32: min_p of each request (0 = off); None when no request uses it."""
        return self.law_values("min_p")

    @property
    def max_top_k(self) -> int:
        """The largest top_k of a random request, 0 when none truncates."""
        return max(next((host for law, _, host in self.row_laws if law.name == "top_k"), [0]))

    @property
    def has_top_p(self) -> bool:
        return self.law_values("top_p") is not None

    @classmethod
    def build(cls, requests: list[Request], num_drafts: list[int], logits_starts: list[int],
              device: torch.device,
              draft_parents: list[list[int] | None] | None = None) -> SamplingMetadata:
        """A verification step's: requests in batch order with their k and first logits row (the
        step layout's), and the parents of those verifying a tree (engine/draft_tree.py; None:
        chains). Each request has 1 + k rows, row j after the drafts on its path."""
        if draft_parents is None:
            draft_parents = [None] * len(requests)
        return cls._build(requests, num_drafts, logits_starts, device,
                          [row_paths(parents, k) for parents, k in zip(draft_parents, num_drafts)],
                          draft_parents)

    @classmethod
    def for_draft_rows(cls, requests: list[Request], drafts: list[list[int]],
                       device: torch.device) -> SamplingMetadata:
        """A drafting pass's (engine/sample/drafting.py): row i chooses the token after
        requests[i]'s output and then drafts[i], this proposal's drafts so far. Its uniforms are
        the requests' own generators', not keyed ones: `seeded` stays empty."""
        return cls._build(requests, [len(d) for d in drafts], list(range(len(requests))), device,
                          [[list(range(len(d)))] for d in drafts], None)

    @classmethod
    def _build(cls, requests: list[Request], num_drafts: list[int], logits_starts: list[int],
               device: torch.device, row_drafts: list[list[list[int]]],
               draft_parents: list[list[int] | None] | None) -> SamplingMetadata:
        """row_drafts[i]: the drafts (indices into requests[i]'s) before each of its rows, one
        list per row; draft_parents: a verification's (keyed uniforms), None for drafting."""
        num_draft_tokens = sum(num_drafts)
        is_greedy: list[bool] = []
        request_of_row: list[int] = []
        law_values: list[list[float | int]] = [[] for _ in ROW_LAWS]
        seeded: list[tuple[Request, int]] = []
        seeded_batch_indices: list[int] = []
        seeded_index: list[int] = []
        seeded_keys: list[tuple[int, int, int]] = []
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        logprobs_requests, num_top = [], []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        penalised: list[int] = []
        draft_starts: list[int] = []
        draft_start = 0
        for index, (request, k, row) in enumerate(zip(requests, num_drafts, logits_starts)):
            params = request.params
            is_greedy.append(params.is_greedy)
            for law, values in zip(ROW_LAWS, law_values):
                values.append(law.value(params))
            paths = row_drafts[index]
            request_of_row += [index] * len(paths)
            if draft_parents is not None and params.seed is not None and not params.is_greedy:
                seeded.append((request, k))
                seeded_batch_indices.append(index)
                # NOTE: acceptance uniforms come first, then one per row (recovered or bonus draw)
                seeded_index += range(draft_start, draft_start + k)
                seeded_index += range(num_draft_tokens + row, num_draft_tokens + row + k + 1)
                seeded_keys += uniform_keys(params.seed, request.num_output_tokens,
                                            draft_parents[index], k)
            if params.min_tokens > request.num_output_tokens:
                ids = banned_token_ids(request, request.num_output_tokens)
                # NOTE: a row's output so far is the committed output and the drafts on its path
                for offset, path in enumerate(paths):
                    if request.num_output_tokens + len(path) < params.min_tokens:
                        banned_rows += [row + offset] * len(ids)
                        banned_ids += ids
            if params.logprobs is not None:
                logprobs_requests.append(index)
                num_top.append(params.logprobs)
            if params.logit_bias:
                ids, values = zip(*params.logit_bias)
                for offset in range(len(paths)):
                    bias_rows += [row + offset] * len(ids)
                    bias_ids += ids
                    bias_values += values
            if params.has_penalties:
                penalised.append(index)
            draft_starts.append(draft_start)
            draft_start += k
        greedy_ints, rows_t, seeded_t, banned_rows_t, banned_ids_t = to_device(
            [is_greedy, request_of_row, seeded_index, banned_rows, banned_ids], torch.int64,
            device)
        row_laws = _used_row_laws(law_values, device)
        logit_bias = None
        if bias_rows:
            bias_rows_t, bias_ids_t = to_device([bias_rows, bias_ids], torch.int64, device)
            [bias_values_t] = to_device([bias_values], torch.float64, device)
            logit_bias = (bias_rows_t, bias_ids_t, bias_values_t)
        penalties = None
        if penalised:
            penalties = PenaltyMetadata.build(
                [requests[i] for i in penalised], [logits_starts[i] for i in penalised],
                [draft_starts[i] for i in penalised], [row_drafts[i] for i in penalised], device)
        return cls(
            is_greedy=greedy_ints.bool(),
            row_laws=row_laws,
            request_of_row=rows_t,
            is_all_greedy=all(is_greedy),
            has_greedy=any(is_greedy),
            seeded=seeded,
            seeded_batch_indices=seeded_batch_indices,
            seeded_uniform_index=seeded_t if seeded else None,
            seeded_uniform_keys=(tuple(np.array(seeded_keys, dtype=np.int64).T) if seeded
                                 else None),
            banned=(banned_rows_t, banned_ids_t) if banned_rows else None,
            logprobs_requests=logprobs_requests,
            num_top_logprobs=num_top,
            logit_bias=logit_bias,
            penalties=penalties,
        )


def _used_row_laws(law_values: list[list[float | int]], device: torch.device
                   ) -> list[tuple[RowLaw, torch.Tensor, list]]:
    """The row laws some request moves from neutral, with their values on the device (one copy per
    dtype)."""
    used = [(law, values) for law, values in zip(ROW_LAWS, law_values)
            if any(value != law.neutral for value in values)]
    tensors: dict[str, torch.Tensor] = {}
    for dtype in dict.fromkeys(law.dtype for law, _ in used):
        group = [(law, values) for law, values in used if law.dtype == dtype]
        for (law, _), tensor in zip(group, to_device([v for _, v in group], dtype, device)):
            tensors[law.name] = tensor
    return [(law, tensors[law.name], values) for law, values in used]


def uniform_keys(seed: int, num_output_tokens: int, parents: list[int] | None,
                 num_drafts: int) -> list[tuple[int, int, int]]:
    """(seed, output position, stream) of a seeded request's 2k + 1 uniforms this step, in the order
    of seeded_uniform_index: each draft's acceptance uniform, then each row's sample uniform.

    Row 0 chooses output position num_output_tokens, and the row after a draft at depth d (1 under
    the newest token) position num_output_tokens + d: siblings share their position's numbers, so
    whichever path is accepted, the token at a position is decided by that position's numbers
    alone. A draft is tried at its parent's position; siblings get acceptance streams by rank."""
    if parents is None:
        parents = list(range(-1, num_drafts - 1))
    draft_depths = depths(parents)
    acceptance = [(seed, num_output_tokens + depth - 1, FIRST_ACCEPTANCE_STREAM + rank)
                  for depth, rank in zip(draft_depths, sibling_ranks(parents))]
    sample = [(seed, num_output_tokens + depth, SAMPLE_STREAM) for depth in [0] + draft_depths]
    return acceptance + sample


def banned_token_ids(request: Request, output_index: int) -> list[int]:
    """Tokens the request's output token number `output_index` cannot be (min_tokens)."""
    if output_index >= request.params.min_tokens:
        return []
    return sorted(request.eos_token_ids | set(request.params.stop_token_ids))
