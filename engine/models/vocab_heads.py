"""The target's embedding and LM head whole, for drafters beside a target split by vocabulary.

Under tensor parallelism each rank holds a slice of the vocabulary, and a lookup or a logits pass
needs every rank. Drafters run on rank 0 alone (EAGLE reads the target's embedding and LM head
at every draft token), so rank 0 keeps these two tables whole for them: packed as the file holds
them where the target runs packed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from engine.models.cpu_linear import QuantizedEmbedding, QuantizedLinear
from kernels.packed_weight import PackedWeight

EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")
LM_HEAD_NAME = "lm_head.weight"


class VocabHeads(nn.Module):
    def __init__(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head


def vocab_weight_names() -> tuple[str, ...]:
    """Every name the embedding and the LM head may have in a checkpoint."""
    return (*EMBEDDING_NAMES, LM_HEAD_NAME)


def vocab_weights(weights: Mapping[str, torch.Tensor | PackedWeight]
                  ) -> dict[str, torch.Tensor | PackedWeight]:
    """The checkpoint's embedding (and untied LM head) tensors, under their names."""
    return {name: weights[name] for name in vocab_weight_names() if name in weights}


def build_vocab_heads(weights: Mapping[str, torch.Tensor | PackedWeight], dtype: torch.dtype,
                      device: torch.device) -> VocabHeads:
    """The two tables from `vocab_weights`' output; a missing LM head reuses the embedding."""
    table = next(weights[name] for name in EMBEDDING_NAMES if name in weights)
    head = weights.get(LM_HEAD_NAME)
    if isinstance(table, PackedWeight):
        embed_tokens = QuantizedEmbedding(table)
        tied_head = embed_tokens.as_linear()
    else:
        embed_tokens = nn.Embedding.from_pretrained(table.to(dtype=dtype, device=device))
        tied_head = _linear(embed_tokens.weight)
    if head is None:
        lm_head = tied_head
    elif isinstance(head, PackedWeight):
        lm_head = QuantizedLinear.from_packed([head])
    else:
        lm_head = _linear(head.to(dtype=dtype, device=device))
    return VocabHeads(embed_tokens, lm_head).eval()


def _linear(weight: torch.Tensor) -> nn.Linear:
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear
