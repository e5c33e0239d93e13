"""The EAGLE draft head: one decoder layer that extrapolates the target's own features.

At position p it reads the embedding of token x_p and the target's final-norm hidden state f_{p-1}
(the feature that produced x_p), mixes them through one linear layer, and runs one Llama decoder
layer with its own KV cache over everything before:

    h_p = layer(fc([embed(x_p); f_{p-1}]))        h_p ≈ f_p,   logits(x_{p+1}) = lm_head(h_p)

Past the tokens the target has verified, the head feeds its own h back in place of f, so drafting k
tokens costs k passes of one layer. The target's embedding and LM head are shared, frozen; the head
only scores a draft vocabulary (the tokens the target says most often, as EAGLE-3 does), which
keeps the per-token LM-head pass small on the CPU.

A head folder holds `eagle_config.json` and `model.safetensors`, written by
`specserve train-speculator --method eagle` (engine/training/train_eagle.py). A folder published by
the EAGLE authors (config.json + pytorch_model.bin) loads too (published_eagle.py): the same head
with fc's bias, no norm before attention, and the whole vocabulary as its draft vocabulary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.models.arch import DecoderArch
from engine.models.attention import AttentionMetadata
from engine.models.llama import DecoderLayer, RotaryEmbedding
from engine.proposers.speculator_folder import (
    WEIGHTS_FILE,
    check_made_for,
    read_config,
    write_config,
)

CONFIG_FILE = "eagle_config.json"


@dataclass(frozen=True)
class EagleConfig:
    # the target's hidden size and vocabulary: a head only fits the model it was trained on
    hidden_size: int
    vocab_size: int
    # the head's own decoder layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    # tokens the head can propose (the first draft_vocab_size of model.safetensors' draft_token_ids)
    draft_vocab_size: int
    # what it was trained on, in words (shown in logs)
    trained_for: str = ""
    # where the EAGLE authors' heads differ (published_eagle.py): fc has a bias, the layer has no
    # norm before attention, q/k/v may have biases (Qwen2-style), and the layer's rotary frequencies
    # come from the head's own config (None: the target's)
    fc_bias: bool = False
    input_norm: bool = True
    qkv_bias: bool = False
    rope_inv_freq: tuple[float, ...] | None = None
    rope_attention_scaling: float = 1.0

    @classmethod
    def for_target(cls, arch: DecoderArch, draft_vocab_size: int, trained_for: str = "") -> EagleConfig:
        """A head shaped like one layer of the target."""
        return cls(hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
                   num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                   head_dim=arch.head_dim, intermediate_size=arch.intermediate_size,
                   rms_norm_eps=arch.rms_norm_eps, draft_vocab_size=draft_vocab_size,
                   trained_for=trained_for)

    def layer_arch(self, target: DecoderArch) -> DecoderArch:
        """The head's layer takes the target's context length, and its rotary frequencies unless
        the head names its own."""
        arch = target.plain_layers(1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   head_dim=self.head_dim,
                                   intermediate_size=self.intermediate_size,
                                   rms_norm_eps=self.rms_norm_eps, qkv_bias=self.qkv_bias)
        if self.rope_inv_freq is not None:
            arch = replace(arch, rope_inv_freq=tuple(self.rope_inv_freq),
                           rope_attention_scaling=self.rope_attention_scaling)
        return arch

    def check_fits(self, target: DecoderArch, folder: str) -> None:
        check_made_for(target, "the EAGLE head was", folder, self.hidden_size, self.vocab_size)

    def save(self, folder: str) -> None:
        write_config(folder, CONFIG_FILE, "eagle", self)

    @classmethod
    def load(cls, folder: str) -> EagleConfig:
        return cls(**read_config(folder, CONFIG_FILE, "eagle", "an EAGLE head"))


class EagleHead(nn.Module):
    # the layer as one native call on the CPU (engine/models/native_pass.py), where the
    # proposer built one; None = the layer's modules
    native_pass = None

    def __init__(self, config: EagleConfig, target: DecoderArch) -> None:
        super().__init__()
        self.config = config
        arch = config.layer_arch(target)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layer = DecoderLayer(arch)
        if not config.input_norm:
            # the EAGLE authors' first layer: fc's output enters attention as it is
            self.layer.input_layernorm = nn.Identity()
        self.rotary = RotaryEmbedding(arch.rope_inv_freq, arch.rope_attention_scaling)
        # target token id of each draft-vocabulary entry
        self.register_buffer("draft_token_ids",
                             torch.zeros(config.draft_vocab_size, dtype=torch.int64))

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """token_embeds, features: [T, hidden] (x_p's embedding, f_{p-1}); kv_caches: the one
        layer's cache, in a list as a model's; returns h [T, hidden]."""
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        if self.native_pass is not None and self.native_pass.runs(meta):
            return self.native_pass(x, cos[:, 0], sin[:, 0], meta, kv_caches, ())[0]
        return self.layer(x, cos, sin, meta, kv_caches[0])

    def draft_head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The target's LM-head rows of the draft vocabulary: [draft_vocab, hidden] (the weight
        itself when the draft vocabulary is the whole vocabulary in order, as for the authors'
        heads: no copy of a large LM head)."""
        ids = self.draft_token_ids
        if len(ids) == len(lm_head_weight) and bool(
                (ids == torch.arange(len(ids), device=ids.device)).all()):
            return lm_head_weight
        return lm_head_weight.index_select(0, ids)

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.config.save(folder)
        save_file({name: t.detach().contiguous() for name, t in self.state_dict().items()},
                  os.path.join(folder, WEIGHTS_FILE))

    @classmethod
    def read(cls, folder: str, target: DecoderArch) -> EagleHead:
        """specserve's own head folder (engine/proposers/published_eagle.py's load_eagle_head also
        reads the EAGLE authors'); a head for another model fails here."""
        config = EagleConfig.load(folder)
        config.check_fits(target, folder)
        head = cls(config, target)
        head.load_state_dict(load_file(os.path.join(folder, WEIGHTS_FILE)))
        ids = head.draft_token_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
            raise ValueError(f"the draft vocabulary in {folder} has token ids outside the "
                             f"target's")
        return head

    def placed(self, target: DecoderArch, dtype: torch.dtype, device: torch.device) -> EagleHead:
        """The head in `dtype` on `device`, for inference."""
        head = self.to(device=device, dtype=dtype).eval()
        # NOTE: rotary frequencies stay float32 whatever the weights' dtype, as in the target
        head.rotary.inv_freq = torch.tensor(head.config.layer_arch(target).rope_inv_freq,
                                            dtype=torch.float32, device=device)
        return head
