"""The one sampling path: every sampling request verifies its k drafts, and plain decoding is
verification with k = 0 (the bonus token is then the sampled token).

Per step, over all rows at once: min_tokens bans, logit_bias and penalties (each row counting the
drafts before it as output, as if decoding one token at a time), argmax when any request is greedy
(all a greedy request needs: no probabilities, no random numbers), then, when any is random, p
(temperature, min_p, top-k, top-p with per-row tensors) and the uniforms; then kernels/ runs acceptance and the inverse-CDF draws of
recovered and bonus tokens. Draft q
comes from its proposer already transformed the same way. The vocabulary (accepted, recovered and bonus
tokens, α, τ) is defined in kernels/rejection_reference.py. A step where some request verifies a
tree of drafts walks every request's drafts as a tree (a chain is a tree with one branch, and the
tree sampler gives it the chain sampler's tokens): kernels/tree_rejection_reference.py.
"""

from __future__ import annotations

import torch

from engine.sample.grammar import mask_step_logits
from engine.sample.logprobs import compute_logprobs
from engine.sample.sampler import draw_uniforms, process_logits, target_probs
from engine.scheduler import SampledTokens
from engine.step_layout import StepLayout
from kernels import PLACEHOLDER_TOKEN_ID, rejection_sample, tree_rejection_sample


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, layout: StepLayout) -> list[SampledTokens]:
        """logits: [num_rows, vocab], the step layout's rows; returns the kept tokens of each sampling
        request, in batch order. No device sync until the one transfer of the output at the end (and
        one more for logprobs, when a request wants them)."""
        if not layout.sampling:
            return []
        metadata = layout.sampling_metadata
        # NOTE: grammar masks first, on a copy: logprobs come from the raw logits
        masked = process_logits(mask_step_logits(logits, layout), metadata,
                                layout.draft_token_ids)  # [num_rows, vocab]
        if metadata.has_greedy:
            target_argmax = masked.argmax(dim=-1)  # [num_rows]
        else:  # NOTE: random requests read it only at a row of p without mass (never after softmax)
            target_argmax = torch.zeros(layout.num_rows, dtype=torch.int64, device=logits.device)
        probs = acceptance_uniforms = sample_uniforms = None
        if not metadata.is_all_greedy:
            probs = target_probs(masked, metadata)  # [num_rows, vocab]
            acceptance_uniforms, sample_uniforms = draw_uniforms(
                metadata, len(layout.draft_token_ids), layout.num_rows, logits.device)
        # NOTE: by keyword, as kernels/ documents them (and as the tests' broken samplers take them)
        arguments = {
            "draft_token_ids": layout.draft_token_ids,
            "cu_num_draft_tokens": layout.cu_num_draft_tokens,
            "draft_probs": None if probs is None else layout.draft_probs,
            "target_probs": probs,
            "target_argmax": target_argmax,
            "is_greedy": metadata.is_greedy,
            "acceptance_uniforms": acceptance_uniforms,
            "sample_uniforms": sample_uniforms,
            "max_spec_len": layout.max_num_draft_tokens,
        }
        if layout.draft_parents is None:
            output = rejection_sample(**arguments)  # [batch, max_k + 1], -1 padded
            paths = [None] * len(layout.sampling)
        else:
            # [batch, max_k + 1] and the accepted drafts' indices [batch, max_k], -1 padded
            output, accepted = tree_rejection_sample(draft_parents=layout.draft_parents,
                                                     **arguments)
            paths = [[d for d in row if d >= 0] if item.draft_parents is not None else None
                     for item, row in zip(layout.sampling, accepted.tolist())]
        kept = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in output.tolist()]
        sampled = [SampledTokens(token_ids, accepted_drafts=path)
                   for token_ids, path in zip(kept, paths)]
        if metadata.logprobs_requests:
            self._add_logprobs(logits, layout, kept, sampled)
        return sampled

    @staticmethod
    def _add_logprobs(logits: torch.Tensor, layout: StepLayout, kept: list[list[int]],
                      sampled: list[SampledTokens]) -> None:
        """Logprobs of the emitted tokens of the requests that want them, all in one computation.
        NOTE: from the raw target logits at each token's own row (never the draft's)."""
        metadata = layout.sampling_metadata
        rows: list[int] = []
        token_ids: list[int] = []
        for index in metadata.logprobs_requests:
            rows += layout.kept_rows(index, sampled[index].kept_drafts)
            token_ids += kept[index]
        device = logits.device
        logprobs = compute_logprobs(logits[torch.tensor(rows, device=device)],
                                    torch.tensor(token_ids, device=device),
                                    max(metadata.num_top_logprobs))
        first_row = 0
        for index, num_top in zip(metadata.logprobs_requests, metadata.num_top_logprobs):
            sampled[index].logprobs = logprobs.token_logprobs(first_row, kept[index], num_top)
            first_row += len(kept[index])
