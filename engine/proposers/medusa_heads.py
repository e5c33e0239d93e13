"""Medusa heads (Cai et al. 2024, FasterDecoding/Medusa): small heads on the target's last hidden state,
head i guessing the token i + 1 places after the one that state produced.

    h_t (the target's final-norm hidden state; its LM head gave token t + 1)
    head i:  x = h_t;  x = x + silu(W_ij x + b_ij) for each of its residual blocks j
             logits_i = P_i x                        a guess at token t + 2 + i

P_i is the head's own vocabulary projection, one projection every head shares, or the target's own
LM head (frozen): specserve's trainer shares the target's, so a head costs only its blocks and all
heads are scored by one pass over the LM head. With a draft vocabulary (vLLM's truncated_vocab_size
and token_map) the projections score those tokens only; the rest get -inf.

The parameter names are vLLM's (`blocks.{i}.layers.{j}.weight` / `.bias`, `lm_heads.{i}.weight`,
`lm_head.weight` when shared): specserve's own folder (medusa_config.json + model.safetensors,
written by `specserve train-speculator --method medusa`) holds this module's state dict, and the
published layouts are renamed into it (published_medusa.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from engine.models.arch import DecoderArch
from engine.proposers.speculator_folder import (
    WEIGHTS_FILE,
    check_made_for,
    read_config,
    write_config,
)

CONFIG_FILE = "medusa_config.json"
# where a head's states become logits: its own projection, one projection in the folder that every
# head shares (vLLM's original_lm_head), or the target's LM head
VOCAB_PROJECTIONS = ("per_head", "shared", "target")


@dataclass(frozen=True)
class MedusaConfig:
    # the target's hidden size and vocabulary: heads only fit the model they were trained on
    hidden_size: int
    vocab_size: int
    # heads = the most draft tokens a chain can hold (head i drafts position i + 1)
    num_heads: int
    # residual blocks per head
    num_layers: int
    has_block_bias: bool = True
    vocab_projection: str = "target"
    # tokens the projections score (the folder's token_map), None: the whole vocabulary
    draft_vocab_size: int | None = None
    # what it was trained on, in words (shown in logs)
    trained_for: str = ""

    def __post_init__(self) -> None:
        if self.vocab_projection not in VOCAB_PROJECTIONS:
            raise ValueError(f"vocab_projection must be one of {', '.join(VOCAB_PROJECTIONS)}, "
                             f"got {self.vocab_projection!r}")
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"Medusa needs at least one head and no negative block count, got "
                             f"{self.num_heads} heads of {self.num_layers} blocks")
        if self.draft_vocab_size is not None and self.vocab_projection == "target":
            raise ValueError("a draft vocabulary needs the heads' own projection: the target's LM "
                             "head scores the whole vocabulary")

    @property
    def projection_width(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    def check_fits(self, target: DecoderArch, folder: str) -> None:
        check_made_for(target, "the Medusa heads were", folder, self.hidden_size, self.vocab_size)

    def save(self, folder: str) -> None:
        write_config(folder, CONFIG_FILE, "medusa", self)

    @classmethod
    def load(cls, folder: str) -> MedusaConfig:
        return cls(**read_config(folder, CONFIG_FILE, "medusa", "a Medusa head"))


class ResidualBlocks(nn.Module):
    """One head's blocks: x + silu(W x + b), in turn (with no blocks, the hidden state itself)."""

    def __init__(self, size: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(size, size, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        size, width = config.hidden_size, config.projection_width
        self.blocks = nn.ModuleList(ResidualBlocks(size, config.num_layers, config.has_block_bias)
                                    for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(size, width, bias=False)
                                      for _ in range(config.num_heads)) \
            if config.vocab_projection == "per_head" else None
        self.lm_head = nn.Linear(size, width, bias=False) \
            if config.vocab_projection == "shared" else None
        self.register_buffer("draft_token_ids", torch.arange(width, dtype=torch.int64)
                             if config.draft_vocab_size else None)

    def states(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """The first num_heads heads' states: [num_heads, rows, hidden] from hidden [rows, hidden]."""
        return torch.stack([block(hidden) for block in self.blocks[:num_heads]])

    def logits(self, hidden: torch.Tensor, num_heads: int,
               target_lm_head: nn.Module | None = None) -> torch.Tensor:
        """The first num_heads heads' logits over the whole vocabulary: [num_heads, rows, vocab]
        from the target's hidden states [rows, hidden]. `target_lm_head`: the target's, for heads
        that score with it (one pass for every head's rows)."""
        states = self.states(hidden, num_heads)  # [heads, rows, hidden]
        if self.lm_heads is not None:
            scores = torch.stack([head(state) for head, state in zip(self.lm_heads, states)])
        else:
            head = self.lm_head if self.lm_head is not None else target_lm_head
            if head is None:
                raise ValueError("these Medusa heads score with the target's LM head; none given")
            scores = head(states.flatten(0, 1)).unflatten(0, states.shape[:2])
        if self.draft_token_ids is None:
            return scores  # [heads, rows, vocab]
        full = scores.new_full((*scores.shape[:2], self.config.vocab_size), float("-inf"))
        return full.index_copy_(2, self.draft_token_ids, scores)

    def save(self, folder: str) -> None:
        """specserve's own folder: medusa_config.json and model.safetensors."""
        os.makedirs(folder, exist_ok=True)
        self.config.save(folder)
        save_file({name: t.detach().contiguous() for name, t in self.state_dict().items()},
                  os.path.join(folder, WEIGHTS_FILE))

    @classmethod
    def read(cls, folder: str) -> MedusaHeads:
        """specserve's own folder, on the CPU in its saved dtype."""
        config = MedusaConfig.load(folder)
        return cls.from_weights(config, load_file(os.path.join(folder, WEIGHTS_FILE)), folder)

    @classmethod
    def from_weights(cls, config: MedusaConfig, weights: dict[str, torch.Tensor],
                     folder: str) -> MedusaHeads:
        """Heads of `config` holding `weights` (this module's names); a tensor missing, left over
        or of the wrong shape fails naming the folder."""
        heads = cls(config)
        expected = heads.state_dict()
        unplaced = sorted(set(weights) - set(expected))
        if unplaced:
            raise ValueError(f"{folder}: {', '.join(unplaced[:6])} has no place in Medusa heads of "
                             f"{config.num_heads} heads x {config.num_layers} blocks")
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise ValueError(f"{folder}: the Medusa heads lack {', '.join(missing[:6])}")
        for name, tensor in weights.items():
            if tensor.shape != expected[name].shape:
                raise ValueError(f"{folder}: {name} is {list(tensor.shape)}; heads of hidden size "
                                 f"{config.hidden_size} scoring {config.projection_width} tokens "
                                 f"need {list(expected[name].shape)}")
        heads.load_state_dict(weights)  # NOTE: copied into float32 parameters (or the int64 ids)
        return heads
