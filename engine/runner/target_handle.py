"""What the worker hands drafters of its target (engine/proposers/ read it; the runner builds it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.arch import DecoderArch
from engine.models.llama import ScaledEmbedding


@dataclass(frozen=True)
class TargetHandle:
    """What a drafter may use of the target: its shape, dtype and device, its model (drafters read
    its embedding and LM head, never change them), and its KV pool's sizing (drafters size theirs
    alike, so a request that fits the target fits the drafter)."""

    arch: DecoderArch
    # the target, or under tensor parallelism its whole embedding and LM head (engine/models/
    # vocab_heads.py), None there when the engine was told no drafter reads them
    model: nn.Module | None
    dtype: torch.dtype
    device: torch.device
    num_blocks: int
    block_size: int
    # the target keeps its file's packed weights (engine/config.py's keep_weights_packed); a draft
    # model loads the same way
    weights_packed: bool = False
    # what --model named (a Hugging Face folder or a .gguf file; None: the embedded GGUF): MTP
    # reads its layers from the target's own checkpoint (engine/proposers/mtp_head.py)
    checkpoint: str | None = None

    @property
    def embed_tokens(self) -> nn.Module:
        """ids -> the target's input embeddings as its forward embeds them (Gemma's scale
        included), as drafters' trainers read them (transformers' get_input_embeddings())."""
        if self.arch.embedding_scale is None:
            return self.model.embed_tokens
        return ScaledEmbedding(self.model.embed_tokens, self.arch.embedding_scale)

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head
