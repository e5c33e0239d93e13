"""IBM's MLP speculators as published (ibm-ai-platform/llama3-8b-accelerator, ibm-fms/llama-13b-accelerator,
ibm-granite/*-accelerator), read for `"method": "mlp_speculator"`.

Unlike specserve's own speculator (mlp_speculator.py), IBM's has its own per-stage embeddings and
heads, and a latent width (inner_dim) of its own. Stage i, from the state before it (the target's
final-norm hidden state for stage 0) and the token just proposed:

    [stage 0, scale_input only]  state = rms(state) / sqrt(2)
    z     = emb_i(token) * emb_weight * sqrt(inner_dim / 2)
    state = gelu(ln_i(proj_i(state) * state_weight + z))          logits_i = head_i(state)

with state_weight = 0.5 ** (0.5 / n_predict), emb_weight = sqrt(1 - state_weight²), ln_i an RMS norm
(no mean taken, eps 1e-6) with a scale and a shift, and the exact GELU (fms-extras' MLPSpeculator).

The folder holds config.json (`"architectures": ["MLPSpeculatorPreTrainedModel"]`, `"model_type":
"mlp_speculator"`, emb_dim, inner_dim (0: emb_dim), n_predict, vocab_size, top_k_tokens_per_head,
n_candidates, optionally scale_input and tie_weights) and model.safetensors or pytorch_model.bin with
`emb.{i}.weight` [vocab, inner], `proj.{i}.weight` ([inner, emb_dim] for i = 0, else [inner, inner]),
`head.{i}.weight` [vocab, inner], `ln.{i}.weight` and `ln.{i}.bias` [inner], possibly prefixed
`speculator.`. With tie_weights every stage shares emb.0, head.0 and ln.0, and stages after the first
share proj.1 (a file may then hold only those). top_k_tokens_per_head and n_candidates shape IBM's
candidate trees; specserve drafts one chain, each stage's token drawn from its own logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.models.arch import DecoderArch
from engine.proposers.head_weights import read_json_config, read_weights
from engine.proposers.speculator_folder import check_made_for, check_published_method


@dataclass(frozen=True)
class PublishedMLPSpeculatorConfig:
    emb_dim: int  # the target's hidden size
    inner_dim: int
    vocab_size: int
    n_predict: int
    scale_input: bool = False
    tie_weights: bool = False

    @property
    def num_stages(self) -> int:
        return self.n_predict

    @classmethod
    def read(cls, folder: str) -> PublishedMLPSpeculatorConfig:
        data: dict[str, Any] | None = read_json_config(folder)
        if data is None:
            raise FileNotFoundError(f"no config.json in {folder}: not an MLP speculator folder")
        check_published_method(folder, data, "mlp_speculator")
        emb_dim = int(data["emb_dim"])
        config = cls(emb_dim=emb_dim, inner_dim=int(data.get("inner_dim") or emb_dim),
                     vocab_size=int(data["vocab_size"]), n_predict=int(data["n_predict"]),
                     scale_input=bool(data.get("scale_input", False)),
                     tie_weights=bool(data.get("tie_weights", False)))
        if config.n_predict < 1 or (config.tie_weights and config.n_predict < 2):
            raise ValueError(f"{folder}/config.json: n_predict {config.n_predict} "
                             f"{'with tie_weights ' if config.tie_weights else ''}is too few")
        return config

    def check_fits(self, target: DecoderArch, folder: str) -> None:
        check_made_for(target, "the speculator was", folder, self.emb_dim, self.vocab_size)


class ScaledRMSNorm(nn.Module):
    """fms' LayerNormParameterized as IBM's speculators use it: x / rms(x), then an optional
    elementwise scale and shift (no mean is taken; eps 1e-6)."""

    def __init__(self, size: int, elementwise: bool, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if elementwise else None
        self.bias = nn.Parameter(torch.zeros(size)) if elementwise else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight + self.bias


class PublishedMLPSpeculator(nn.Module):
    def __init__(self, config: PublishedMLPSpeculatorConfig) -> None:
        super().__init__()
        self.config = config
        n, inner, vocab = config.n_predict, config.inner_dim, config.vocab_size

        def stages(make, tied_from: int | None = None) -> nn.ModuleList:
            """One module per stage; tied: those from `tied_from` on share one."""
            if not config.tie_weights or tied_from is None:
                return nn.ModuleList(make(i) for i in range(n))
            shared = make(tied_from)
            return nn.ModuleList([make(i) for i in range(tied_from)] + [shared] * (n - tied_from))

        self.emb = stages(lambda i: nn.Embedding(vocab, inner), tied_from=0)
        self.proj = stages(lambda i: nn.Linear(config.emb_dim if i == 0 else inner, inner,
                                               bias=False), tied_from=1)
        self.head = stages(lambda i: nn.Linear(inner, vocab, bias=False), tied_from=0)
        self.ln = stages(lambda i: ScaledRMSNorm(inner, elementwise=True), tied_from=0)
        self.ln0 = ScaledRMSNorm(config.emb_dim, elementwise=False) if config.scale_input else None
        # NOTE: state_weight² + emb_weight² = 1: by the last stage the target's state is half
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_scale = math.sqrt(1.0 - self.state_weight ** 2) * math.sqrt(inner / 2)

    def stage(self, index: int, state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """state [rows, emb_dim] (the target's, for stage 0) or [rows, inner_dim]; token_ids [rows]:
        the state after stage `index`, [rows, inner_dim]."""
        if index == 0 and self.ln0 is not None:
            state = self.ln0(state) / math.sqrt(2.0)
        mixed = self.proj[index](state) * self.state_weight + self.emb[index](token_ids) \
            * self.emb_scale
        return nn.functional.gelu(self.ln[index](mixed))

    def logits(self, index: int, state: torch.Tensor) -> torch.Tensor:
        """Stage `index`'s logits over the vocabulary: [rows, vocab]."""
        return self.head[index](state)

    @classmethod
    def load(cls, folder: str, target: DecoderArch, dtype: torch.dtype,
             device: torch.device) -> PublishedMLPSpeculator:
        """The speculator in `folder`; one made for another model, or whose tensors do not fit its
        config, fails here naming the folder."""
        config = PublishedMLPSpeculatorConfig.read(folder)
        config.check_fits(target, folder)
        model = cls(config)
        weights = {name.removeprefix("speculator."): tensor
                   for name, tensor in read_weights(folder).items()}
        model._load_weights(weights, folder)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def _load_weights(self, weights: dict[str, torch.Tensor], folder: str) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        unplaced = sorted(set(weights) - set(params))
        if unplaced:
            raise ValueError(f"{folder}: {', '.join(unplaced[:6])} has no place in an MLP "
                             f"speculator of {self.config.n_predict} stages")
        missing = []
        with torch.no_grad():
            for name, param in params.items():
                tensor = weights.get(name)
                if tensor is None and self.config.tie_weights:
                    tensor = weights.get(self._tied_source(name))
                if tensor is None:
                    missing.append(name)
                elif tensor.shape != param.shape:
                    raise ValueError(f"{folder}: {name} is {list(tensor.shape)}, the config "
                                     f"(emb_dim {self.config.emb_dim}, inner_dim "
                                     f"{self.config.inner_dim}, vocab_size "
                                     f"{self.config.vocab_size}) needs {list(param.shape)}")
                else:
                    param.copy_(tensor)
        if missing:
            raise ValueError(f"{folder}: the MLP speculator lacks {', '.join(missing[:6])}")

    @staticmethod
    def _tied_source(name: str) -> str:
        """The tensor a tied stage's parameter shares: emb/head/ln of stage 0, proj of stage 1 (the
        first proj reads the target's width and is never tied)."""
        kind, index, rest = name.split(".", 2)
        if kind == "proj":
            return name if index == "0" else f"proj.1.{rest}"
        return f"{kind}.0.{rest}"
