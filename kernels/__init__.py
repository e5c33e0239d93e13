"""specserve kernels: each a torch reference (the specification) plus a Triton kernel that must agree.

`rejection_sample` (a chain of drafts per request) and `tree_rejection_sample` (a tree) run the
Triton kernel on CUDA tensors when Triton is installed, else the reference; Triton is imported only
then, so CPU-only processes never pay for it.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

from kernels.rejection_reference import PLACEHOLDER_TOKEN_ID
from kernels.rejection_reference import rejection_sample as rejection_sample_reference
from kernels.tree_rejection import tree_rejection_sample_reference

__all__ = ["PLACEHOLDER_TOKEN_ID", "rejection_sample", "rejection_sample_reference",
           "tree_rejection_sample", "tree_rejection_sample_reference", "triton_is_usable"]


@functools.cache
def triton_is_usable() -> bool:
    """Triton can launch here: it is installed and a CUDA device is present."""
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def rejection_sample(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: Tensor,  # [batch] int64
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab_size] float32, or None: one-hot drafts
    target_probs: Tensor | None,  # [num_draft_tokens + batch, vocab_size] float32, None: all greedy
    target_argmax: Tensor,  # [num_draft_tokens + batch] int64
    is_greedy: Tensor,  # [batch] bool
    acceptance_uniforms: Tensor | None,  # [num_draft_tokens] float32 or float64
    sample_uniforms: Tensor | None,  # [num_draft_tokens + batch] float32 or float64
    max_spec_len: int,
) -> Tensor:  # [batch, max_spec_len + 1] int64
    """Dispatch to Triton or the reference; the contract is in `kernels.rejection_reference`."""
    if target_argmax.is_cuda and triton_is_usable():
        from kernels.rejection_triton import rejection_sample as implementation
    else:
        implementation = rejection_sample_reference
    return implementation(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs,
                          target_argmax, is_greedy, acceptance_uniforms, sample_uniforms,
                          max_spec_len)


def tree_rejection_sample(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64
    draft_parents: Tensor,  # [num_draft_tokens] int64, parent draft within the request, -1 = root
    cu_num_draft_tokens: Tensor,  # [batch] int64
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab_size] float32, or None: one-hot drafts
    target_probs: Tensor | None,  # [num_draft_tokens + batch, vocab_size] float32, None: all greedy
    target_argmax: Tensor,  # [num_draft_tokens + batch] int64
    is_greedy: Tensor,  # [batch] bool
    acceptance_uniforms: Tensor | None,  # [num_draft_tokens] float32 or float64
    sample_uniforms: Tensor | None,  # [num_draft_tokens + batch] float32 or float64
    max_spec_len: int,
) -> tuple[Tensor, Tensor]:  # [batch, max_spec_len + 1], [batch, max_spec_len] int64
    """Dispatch to Triton or the reference; the contract is in `kernels.tree_rejection`:
    output_token_ids, then accepted_drafts (the accepted path's draft indices in the request)."""
    if target_argmax.is_cuda and triton_is_usable():
        from kernels.tree_rejection_triton import tree_rejection_sample as implementation
    else:
        implementation = tree_rejection_sample_reference
    return implementation(draft_token_ids, draft_parents, cu_num_draft_tokens, draft_probs,
                          target_probs, target_argmax, is_greedy, acceptance_uniforms,
                          sample_uniforms, max_spec_len)
