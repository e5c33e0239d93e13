"""The one sampling path: every sampling request verifies its k drafts, and plain decoding is
verification with k = 0 (the bonus token is then the sampled token).

Per step, over all rows at once: min_tokens bans, logit_bias and penalties (each row counting the
drafts before it as output, as if decoding one token at a time), each row's argmax (a greedy
request's token, and the token of a random row left without probability mass), then, when any
request is random, p (temperature, min_p, top-k, top-p with per-row tensors) and the uniforms; then
kernels/ runs acceptance and the inverse-CDF draws of recovered and bonus tokens. Draft q comes from
its proposer already transformed the same way. The vocabulary (accepted, recovered and bonus
tokens, α, τ) is defined in kernels/rejection_reference.py. A step where some request verifies a
tree of drafts walks every request's drafts as a tree (a chain is a tree with one branch, and the
tree sampler gives it the chain sampler's tokens): kernels/tree_rejection_reference.py.

Seeded requests with one-hot drafts (n-gram, suffix, EAGLE trees, or none) are decided like greedy
ones: the token at each row is fixed in advance as the inverse CDF of p there at the row's keyed
sample uniform (seed, output position; engine/sample/keyed_random.py), which is exactly the token
plain decoding draws at that position; a draft is accepted iff it equals that token, with
probability p(x), as rejection sampling. So the text depends only on the seed and the target's
distributions, not on draft lengths, batch mates or cache state. (Any draw that is a function of
(p, the position's numbers) with law p would do, Gumbel-max included; the inverse CDF needs one
uniform per position instead of one per token, and is the kernels' own exact fixed-point draw.)
Seeded requests with soft drafts (q from a sampling drafter) keep rejection sampling, with keyed
uniforms: reproducible run to run, and their text depends on the drafts. Unseeded random requests
keep one batched draw on the device: they promise no reproducibility, and it costs no host work.

A request with NaN or +inf among its raw logits cannot be sampled: it gets SampledTokens.error and
no tokens, and the others get exactly the tokens they would have had (every request is decided
from its own rows and numbers).
"""

from __future__ import annotations

import torch

from engine.sample.grammar import mask_verification_logits
from engine.sample.logprobs import compute_logprobs
from engine.sample.sampler import draw_tokens, draw_uniforms, process_logits, target_probs
from engine.step.layout import StepLayout
from engine.step.types import SampledTokens
from kernels import PLACEHOLDER_TOKEN_ID, rejection_sample, tree_rejection_sample

NON_FINITE_LOGITS = ("the model produced non-finite logits (NaN or +inf) for this request; it "
                     "cannot be sampled")


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, layout: StepLayout) -> list[SampledTokens]:
        """logits: [num_rows, vocab], the step layout's rows; returns the kept tokens of each sampling
        request, in batch order. No device sync until the one transfer of the output at the end (and
        one more for logprobs, when a request wants them)."""
        if not layout.sampling:
            return []
        metadata = layout.sampling_metadata
        # NOTE: grammar masks first, on a copy: logprobs come from the raw logits
        masked = process_logits(
            mask_verification_logits(logits, [item.request for item in layout.sampling],
                                     [item.draft_token_ids for item in layout.sampling],
                                     layout.logits_starts),
            metadata, layout.draft_token_ids)  # [num_rows, vocab]
        # [num_rows] NaN or +inf among the raw logits (amax propagates NaN)
        is_broken_row = ~(logits.amax(dim=-1) < float("inf"))
        # greedy's token, and the token of a random row of p without mass (never token 0). NOTE: on
        # the CPU, argmax costs about a softmax: a step without greedy rows takes it only at the
        # rows without mass (a host sync is free there); on CUDA it is cheap and needs no sync
        is_lazy = not (metadata.has_greedy or logits.is_cuda)
        target_argmax = (torch.zeros(layout.num_rows, dtype=torch.int64, device=logits.device)
                         if is_lazy else masked.argmax(dim=-1))  # [num_rows]
        is_greedy = metadata.is_greedy  # [batch]
        probs = acceptance_uniforms = sample_uniforms = None
        if not metadata.is_all_greedy:
            probs = target_probs(masked, metadata)  # [num_rows, vocab]
            if is_lazy:
                no_mass = (~(probs.amax(dim=-1) > 0)).nonzero()[:, 0]  # [num_no_mass]
                target_argmax[no_mass] = masked[no_mass].argmax(dim=-1)
            acceptance_uniforms, sample_uniforms = draw_uniforms(
                metadata, len(layout.draft_token_ids), layout.num_rows, logits.device)
            decided = [i for i in metadata.seeded_batch_indices
                       if layout.sampling[i].draft_probs is None]
            if decided:
                # NOTE: p and the uniforms still go to the kernels (which read neither for a greedy
                # request), as for any step with random requests
                is_greedy = self._decide_seeded(layout, decided, probs, sample_uniforms,
                                                target_argmax)
        # NOTE: by keyword, as kernels/ documents them (and as the tests' broken samplers take them)
        arguments = {
            "draft_token_ids": layout.draft_token_ids,
            "cu_num_draft_tokens": layout.cu_num_draft_tokens,
            "draft_probs": None if probs is None else layout.draft_probs,
            "target_probs": probs,
            "target_argmax": target_argmax,
            "is_greedy": is_greedy,
            "acceptance_uniforms": acceptance_uniforms,
            "sample_uniforms": sample_uniforms,
            "max_spec_len": layout.max_num_draft_tokens,
        }
        is_broken = torch.zeros(len(layout.sampling), dtype=torch.int64, device=logits.device)
        is_broken.index_add_(0, metadata.request_of_row, is_broken_row.long())  # [batch]
        if layout.draft_parents is None:
            output = rejection_sample(**arguments)  # [batch, max_k + 1], -1 padded
            paths = [None] * len(layout.sampling)
        else:
            # [batch, max_k + 1] and the accepted drafts' indices [batch, max_k], -1 padded
            output, accepted = tree_rejection_sample(draft_parents=layout.draft_parents,
                                                     **arguments)
            paths = [[d for d in row if d >= 0] if item.draft_parents is not None else None
                     for item, row in zip(layout.sampling, accepted.tolist())]
        # NOTE: one transfer: the output rows with each request's broken flag as a last column
        rows = torch.cat([output, is_broken[:, None]], dim=1).tolist()
        kept = [[t for t in row[:-1] if t != PLACEHOLDER_TOKEN_ID] for row in rows]
        sampled = [SampledTokens([], error=NON_FINITE_LOGITS) if row[-1]
                   else SampledTokens(token_ids, accepted_drafts=path)
                   for token_ids, path, row in zip(kept, paths, rows)]
        if any(sampled[index].error is None for index in metadata.logprobs_requests):
            self._add_logprobs(logits, layout, kept, sampled)
        return sampled

    @staticmethod
    def _decide_seeded(layout: StepLayout, decided: list[int], probs: torch.Tensor,
                       sample_uniforms: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
        """Fix the token of every row of the seeded one-hot-draft requests `decided` (batch indices)
        to the inverse CDF of p at the row's keyed sample uniform (the kernels' fixed-point draw), written into target_argmax
        [num_rows] (a row without mass keeps its argmax); returns is_greedy [batch] with those
        requests marked greedy, so the kernels accept a draft iff it equals that token."""
        if len(decided) == len(layout.sampling):  # NOTE: every row: no gather of p needed
            target_argmax[:] = draw_tokens(probs, sample_uniforms, target_argmax)
        else:
            rows = torch.tensor([row for i in decided for row in layout.rows_of(i)],
                                device=probs.device)  # [num_decided_rows]
            target_argmax[rows] = draw_tokens(probs[rows], sample_uniforms[rows],
                                              target_argmax[rows])
        is_greedy = layout.sampling_metadata.is_greedy.clone()  # [batch]
        is_greedy[torch.tensor(decided, device=is_greedy.device)] = True
        return is_greedy

    @staticmethod
    def _add_logprobs(logits: torch.Tensor, layout: StepLayout, kept: list[list[int]],
                      sampled: list[SampledTokens]) -> None:
        """Logprobs of the emitted tokens of the requests that want them, all in one computation.
        NOTE: from the raw target logits at each token's own row (never the draft's)."""
        metadata = layout.sampling_metadata
        rows: list[int] = []
        token_ids: list[int] = []
        wanted = [(index, num_top) for index, num_top
                  in zip(metadata.logprobs_requests, metadata.num_top_logprobs)
                  if sampled[index].error is None]
        for index, _ in wanted:
            rows += layout.kept_rows(index, sampled[index].kept_drafts)
            token_ids += kept[index]
        device = logits.device
        logprobs = compute_logprobs(logits[torch.tensor(rows, device=device)],
                                    torch.tensor(token_ids, device=device),
                                    max(num_top for _, num_top in wanted))
        first_row = 0
        for index, num_top in wanted:
            sampled[index].logprobs = logprobs.token_logprobs(first_row, kept[index], num_top)
            first_row += len(kept[index])
