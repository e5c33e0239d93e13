"""MLP speculator (IBM-style): small per-position MLP stages that read the target's last hidden state
and the embedding of the token just emitted, and predict the next k tokens one stage at a time.

Each stage mixes the running state with the new token's embedding, through a norm and a GELU:
    state_i = gelu(norm_i(W_state_i · state_{i-1} · a + W_emb_i · embed(token_i) · b)).
Its logits come from the target's own LM head, frozen and shared, so a stage costs two hidden×hidden
matmuls plus one head pass. On the embedded SmolLM2 that is 0.66M parameters per stage against the
target's 134M. The target's embedding table is shared the same way.

A speculator folder holds `speculator_config.json` and `model.safetensors`, written by
`specserve train-speculator` (engine/training/train_speculator.py). IBM's published speculators
(config.json, own embeddings and heads per stage) load under the same method:
published_mlp_speculator.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.proposers.base import DraftProposal, Proposer
from engine.proposers.chain import draft_chains
from engine.proposers.published_mlp_speculator import PublishedMLPSpeculator
from engine.proposers.speculator_folder import (
    WEIGHTS_FILE,
    is_published,
    read_config,
    write_config,
)
from engine.request import Request
from engine.runner.target_handle import TargetHandle

CONFIG_FILE = "speculator_config.json"


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    # the target's hidden size and vocabulary: a speculator only fits the model it was trained on
    hidden_size: int
    vocab_size: int
    # stages = the most draft tokens it can propose in one step
    num_stages: int
    # what it was trained on, in words (shown in logs)
    trained_for: str = ""

    def save(self, folder: str) -> None:
        write_config(folder, CONFIG_FILE, "mlp_speculator", self)

    @classmethod
    def load(cls, folder: str) -> MLPSpeculatorConfig:
        return cls(**read_config(folder, CONFIG_FILE, "mlp_speculator", "an MLP speculator"))


class MLPSpeculator(nn.Module):
    def __init__(self, config: MLPSpeculatorConfig) -> None:
        super().__init__()
        self.config = config
        size = config.hidden_size
        self.state_proj = nn.ModuleList(nn.Linear(size, size, bias=False)
                                        for _ in range(config.num_stages))
        self.embed_proj = nn.ModuleList(nn.Linear(size, size, bias=False)
                                        for _ in range(config.num_stages))
        self.norms = nn.ModuleList(nn.LayerNorm(size) for _ in range(config.num_stages))
        # NOTE: a² + b² = 1 keeps the mix's scale steady from stage to stage (IBM's weighting)
        self.state_weight = 0.5 ** (0.5 / config.num_stages)
        self.embed_weight = math.sqrt(1.0 - self.state_weight ** 2)

    def stage(self, index: int, state: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """state [rows, hidden] (the target's, for stage 0), token_embedding [rows, hidden]."""
        mixed = (self.state_proj[index](state) * self.state_weight
                 + self.embed_proj[index](token_embedding) * self.embed_weight)
        return nn.functional.gelu(self.norms[index](mixed))

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.config.save(folder)
        save_file({name: t.detach().contiguous() for name, t in self.state_dict().items()},
                  os.path.join(folder, WEIGHTS_FILE))

    @classmethod
    def load(cls, folder: str, dtype: torch.dtype, device: torch.device) -> MLPSpeculator:
        model = cls(MLPSpeculatorConfig.load(folder))
        model.load_state_dict(load_file(os.path.join(folder, WEIGHTS_FILE)))
        return model.to(device=device, dtype=dtype).eval()


class MLPSpeculatorProposer(Proposer):
    """Drafts from the target's hidden state at the row that produced each request's newest token,
    through specserve's own speculator (the target's embedding and LM head) or IBM's published one
    (its own per stage)."""

    def __init__(self, folder: str, target: TargetHandle) -> None:
        self.device = target.device
        if is_published(folder, CONFIG_FILE):
            published = PublishedMLPSpeculator.load(folder, target.arch, target.dtype,
                                                    target.device)
            self.speculator: nn.Module = published
            self.num_stages = published.config.num_stages
            # (stage, state, token ids) -> state; (stage, state) -> logits [rows, vocab]
            self._stage = published.stage
            self._logits = published.logits
            return
        speculator = MLPSpeculator.load(folder, target.dtype, target.device)
        config = speculator.config
        hidden_size, vocab_size = target.arch.hidden_size, target.arch.vocab_size
        if (config.hidden_size, config.vocab_size) != (hidden_size, vocab_size):
            raise ValueError(
                f"the speculator in {folder} was trained for hidden size {config.hidden_size} and "
                f"vocabulary {config.vocab_size}; the target has {hidden_size} and {vocab_size}")
        self.speculator = speculator
        self.num_stages = config.num_stages
        # the target's own modules, read-only
        embed_tokens, lm_head = target.embed_tokens, target.lm_head
        self._stage = lambda index, state, token_ids: speculator.stage(
            index, state, embed_tokens(token_ids))
        self._logits = lambda index, state: lm_head(state)

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        if target_hidden is None:
            return [DraftProposal([], None) for _ in requests]
        caps = [min(cap, self.num_stages) for cap in max_num_tokens]
        # each drafting request's running state, row by row of `state_rows`
        state_rows = [i for i, cap in enumerate(caps) if cap > 0]
        state = target_hidden[state_rows]  # [rows, hidden]

        def advance(stage: int, rows: list[int],
                    drafts: dict[int, list[int]]) -> tuple[list[int], torch.Tensor]:
            nonlocal state, state_rows
            tokens = [drafts[i][-1] if drafts[i] else
                      (requests[i].output_token_ids or requests[i].prompt_token_ids)[-1]
                      for i in rows]
            kept = state[[state_rows.index(i) for i in rows]]
            state = self._stage(stage, kept, torch.tensor(tokens, device=self.device))
            state_rows = rows
            return rows, self._logits(stage, state)  # [rows, vocab]

        return draft_chains(requests, caps, advance)
