"""The EAGLE-3 draft head, loaded from the folders people publish.

EAGLE-3 reads the target's residual stream at three depths (low, middle, high), not only its last
features. At position p, with g_{p-1} = fc([a_{p-1}; b_{p-1}; c_{p-1}]) the three fused:

    e = input_layernorm(embed(x_p))          h = hidden_norm(g_{p-1})     residual = g_{p-1}
    s_p = residual + attn([e; h])            (q, k, v read 2 * hidden)
    s_p = s_p + mlp(post_attention_layernorm(s_p))
    logits(x_{p+1}) over the draft vocabulary = lm_head(norm(s_p));  target id = i + d2t[i]

Past the verified tokens the head feeds its own s back in place of g (no fc), so k drafts cost k
passes of one layer. With `norm_before_residual` the residual is h instead of g.

Two layouts are read, both as `"method": "eagle3"` with `"model": <folder>`:
- the EAGLE authors' (`LlamaForCausalLMEagle3`): config.json is the layer's Llama config plus
  `draft_vocab_size` (and optionally `target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`);
  the layer's tensors are named `midlayer.*`;
- vLLM's `speculators` (`"speculators_model_type": "eagle3"`): the layer's config sits in
  `transformer_layer_config`, the head's fields at the top, the layer's tensors named `layers.0.*`.
Both carry `fc`, `norm`, `lm_head`, `d2t`, `t2d`, and optionally their own `embed_tokens` (else the
target's is shared). Without named layers, EAGLE-3's default is used: 2, L // 2 and L - 3.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from engine.models.arch import DecoderArch
from engine.models.attention import AttentionMetadata
from engine.models.llama import MLP, Attention, RMSNorm, RotaryEmbedding
from engine.proposers.head_weights import read_json_config, read_weights
from engine.proposers.speculator_folder import check_made_for

AUTHORS_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# q/k/v and gate/up are fused in our layer: (fused name, shard)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def default_feature_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice: the residual stream entering layers 2, L // 2 and L - 3; a target too
    shallow for that (under 7 layers, where those collide) reads its first, middle and last."""
    published = (2, num_target_layers // 2, num_target_layers - 3)
    if published[0] < published[1] < published[2]:
        return published
    return (0, num_target_layers // 2, num_target_layers - 1)


@dataclass(frozen=True)
class Eagle3Config:
    layout: str  # "eagle3" (the authors') or "speculators"
    layer: dict[str, Any]  # the decoder layer's Llama config
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    # target layers whose entering residual stream is read; None = EAGLE-3's default
    feature_layers: tuple[int, ...] | None
    norm_before_residual: bool

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])

    @classmethod
    def for_target(cls, target: DecoderArch, draft_vocab_size: int,
                   feature_layers: tuple[int, ...]) -> Eagle3Config:
        """A head shaped like one layer of the target (what `train-speculator` trains); saved in
        the speculators layout, as vLLM's speculators library writes it."""
        layer = {"model_type": "llama", "hidden_size": target.hidden_size,
                 "intermediate_size": target.intermediate_size,
                 "num_attention_heads": target.num_heads,
                 "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim,
                 "num_hidden_layers": 1, "rms_norm_eps": target.rms_norm_eps,
                 "vocab_size": target.vocab_size,
                 "max_position_embeddings": target.max_position_embeddings}
        return cls("speculators", layer, target.vocab_size, draft_vocab_size, target.hidden_size,
                   tuple(feature_layers), norm_before_residual=True)

    @classmethod
    def read(cls, folder: str) -> Eagle3Config:
        data = read_json_config(folder)
        if data is None:
            raise FileNotFoundError(f"no config.json in {folder}: not an EAGLE-3 head folder")
        if data.get("speculators_model_type") is not None:
            if data["speculators_model_type"] != "eagle3":
                raise ValueError(f"{folder} holds a speculators {data['speculators_model_type']!r} "
                                 f"model, not eagle3")
            layout, layer = "speculators", dict(data.get("transformer_layer_config") or {})
            norm_before_residual = bool(data.get("norm_before_residual", True))
            ids = data.get("eagle_aux_hidden_state_layer_ids")
        elif set(data.get("architectures") or ()) & set(AUTHORS_ARCHITECTURES):
            layout, layer = "eagle3", dict(data)
            norm_before_residual = bool(data.get("norm_before_residual", False))
            ids = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
                or data.get("eagle_aux_hidden_state_layer_ids")
        else:
            raise ValueError(f"{folder}/config.json is neither an EAGLE-3 head "
                             f"({' / '.join(AUTHORS_ARCHITECTURES)}) nor a speculators eagle3 model")
        if data.get("norm_before_fc"):
            raise ValueError(f"{folder}: norm_before_fc heads are not supported")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"{folder}: the EAGLE-3 head has {layer['num_hidden_layers']} "
                             f"decoder layers; specserve runs one-layer heads")
        vocab_size = int(layer["vocab_size"])
        draft_vocab_size = int(data.get("draft_vocab_size") or layer.get("draft_vocab_size")
                               or vocab_size)
        target_hidden = data.get("target_hidden_size") or layer.get("target_hidden_size") \
            or layer["hidden_size"]
        return cls(layout, layer, vocab_size, draft_vocab_size, int(target_hidden),
                   None if not ids else tuple(int(i) for i in ids), norm_before_residual)

    def layers_for(self, target: DecoderArch, folder: str) -> tuple[int, ...]:
        """The target layers to read, checked against the target's depth."""
        ids = self.feature_layers or default_feature_layers(target.num_layers)
        if len(ids) != 3 or list(ids) != sorted(set(ids)) or ids[0] < 0 \
                or ids[-1] >= target.num_layers:
            named = "named" if self.feature_layers else "default"
            raise ValueError(f"the EAGLE-3 head in {folder} reads target layers {list(ids)} "
                             f"({named}); they must be 3 increasing layers of the target's "
                             f"{target.num_layers}")
        return ids

    def layer_arch(self, target: DecoderArch) -> DecoderArch:
        """The head's decoder layer; rotary from its own config, or the target's when it names none."""
        own = DecoderArch.from_hf_config(SimpleNamespace(**{
            **self.layer, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}))
        has_rope = any(key in self.layer for key in ("rope_theta", "rope_scaling",
                                                     "rope_parameters"))
        if not has_rope and own.head_dim == target.head_dim:
            own = replace(own, rope_inv_freq=target.rope_inv_freq,
                          rope_attention_scaling=target.rope_attention_scaling)
        return replace(own, sliding_window=None, qkv_bias=bool(self.layer.get("attention_bias")),
                       max_position_embeddings=target.max_position_embeddings)


class Eagle3Head(nn.Module):
    # the layer as one native call on the CPU (engine/models/native_pass.py), where the
    # proposer built one; None = the modules below
    native_pass = None

    def __init__(self, config: Eagle3Config, arch: DecoderArch, has_embeddings: bool) -> None:
        super().__init__()
        self.config = config
        hidden = arch.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, hidden, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if has_embeddings else None
        self.input_layernorm = RMSNorm(hidden, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        # q, k and v read the token's embedding and the feature side by side
        self.self_attn.qkv_proj = nn.Linear(2 * hidden, arch.q_size + 2 * arch.kv_size,
                                            bias=arch.qkv_bias)
        self.post_attention_layernorm = RMSNorm(hidden, arch.rms_norm_eps)
        self.mlp = MLP(arch)
        self.norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(arch.rope_inv_freq, arch.rope_attention_scaling)
        # target token id of each draft-vocabulary entry (i + d2t[i])
        self.register_buffer("draft_token_ids",
                             torch.zeros(config.draft_vocab_size, dtype=torch.int64))

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """token_embeds [T, hidden]; features [T, hidden]: fc-fused target features or the head's own
        state; returns the state s [T, hidden] (fed back for the next draft)."""
        cos, sin = self.rotary(positions, features.dtype)
        if self.native_pass is not None and self.native_pass.runs(meta):
            inputs = torch.cat([token_embeds, features], dim=-1)
            return self.native_pass(inputs, cos[:, 0], sin[:, 0], meta, kv_caches, ())[0]
        normed = self.hidden_norm(features)
        residual = normed if self.config.norm_before_residual else features
        x = torch.cat([self.input_layernorm(token_embeds), normed], dim=-1)
        x = residual + self.self_attn(x, cos, sin, meta, kv_caches[0])
        return x + self.mlp(self.post_attention_layernorm(x))

    def draft_logits(self, state: torch.Tensor) -> torch.Tensor:
        """[T, draft_vocab] from the head's state."""
        return self.lm_head(self.norm(state))

    def save(self, folder: str, trained_for: str = "") -> None:
        """The speculators layout: config.json and model.safetensors (q/k/v and gate/up unfused)."""
        config = self.config
        os.makedirs(folder, exist_ok=True)
        state = {name: t.detach().float().contiguous() for name, t in self.state_dict().items()
                 if name not in ("draft_token_ids", "rotary.inv_freq")}
        tensors = {}
        for name, tensor in state.items():
            if name.startswith(("self_attn.", "mlp.", "input_layernorm", "hidden_norm",
                                "post_attention_layernorm")):
                for fused, shards in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                      ("gate_up_proj", ("gate_proj", "up_proj"))):
                    if f".{fused}." in name:
                        for shard, split in enumerate(shards):
                            start, size = self._shard_span(fused, shard)
                            tensors["layers.0." + name.replace(fused, split)] = \
                                tensor.narrow(0, start, size).contiguous()
                        break
                else:
                    tensors["layers.0." + name] = tensor
            else:
                tensors[name] = tensor
        ids = self.draft_token_ids.cpu()
        tensors["d2t"] = ids - torch.arange(len(ids))
        tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({
                "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "draft_vocab_size": config.draft_vocab_size,
                "norm_before_residual": config.norm_before_residual,
                "target_hidden_size": config.target_hidden_size,
                "eagle_aux_hidden_state_layer_ids": list(config.feature_layers or ()),
                "transformer_layer_config": {**config.layer,
                                             "architectures": ["LlamaForCausalLM"]},
                "speculators_config": {"algorithm": "eagle3", "trained_for": trained_for},
            }, f, indent=2)

    @classmethod
    def load(cls, folder: str, target: DecoderArch, dtype: torch.dtype,
             device: torch.device) -> tuple[Eagle3Head, tuple[int, ...]]:
        """The head and the target layers it reads; a head for another model fails here."""
        config = Eagle3Config.read(folder)
        check_made_for(target, "the EAGLE-3 head was", folder, config.target_hidden_size,
                       config.vocab_size)
        layers = config.layers_for(target, folder)
        weights = {name.removeprefix("model."): tensor
                   for name, tensor in read_weights(folder).items()}
        arch = config.layer_arch(target)
        head = cls(config, arch, has_embeddings="embed_tokens.weight" in weights)
        if head.embed_tokens is None and arch.hidden_size != target.hidden_size:
            raise ValueError(f"the EAGLE-3 head in {folder} has hidden size {arch.hidden_size} "
                             f"and no embeddings of its own; it cannot share the target's "
                             f"({target.hidden_size})")
        head._load_weights(weights, folder)
        head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
        # NOTE: rotary frequencies stay float32 whatever the weights' dtype, as in the target
        head.rotary.inv_freq = torch.tensor(arch.rope_inv_freq, dtype=torch.float32, device=device)
        return head, layers

    def _load_weights(self, weights: dict[str, torch.Tensor], folder: str) -> None:
        layer_prefix = "midlayer." if self.config.layout == "eagle3" else "layers.0."
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        d2t = weights.pop("d2t", None)
        weights.pop("t2d", None)  # the inverse map, a bool mask over the target's vocabulary
        for name, tensor in weights.items():
            name = name.removeprefix(layer_prefix)
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                name = ".".join(parts[:-2] + [fused, parts[-1]])
            if name not in params:
                raise ValueError(f"{folder}: tensor {name!r} has no place in an EAGLE-3 head")
            param = params[name]
            with torch.no_grad():
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{folder}: {name} is {list(tensor.shape)}, the head "
                                         f"expects {list(param.shape)}")
                    param.copy_(tensor)
                else:
                    start, size = self._shard_span(fused, shard)
                    param.narrow(0, start, size).copy_(tensor)
            loaded.add(f"{name}#{shard}")
        missing = [f"{name}#{shard}" for name in params for shard in self._shards(name)
                   if f"{name}#{shard}" not in loaded]
        if missing:
            raise ValueError(f"{folder}: the EAGLE-3 head lacks {', '.join(sorted(missing))}")
        ids = torch.arange(self.config.draft_vocab_size)
        if d2t is not None:
            ids = ids + d2t.to(torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"{folder}: d2t maps draft tokens outside the target's vocabulary")
        self.draft_token_ids.copy_(ids)

    @staticmethod
    def _shards(name: str) -> tuple[int | None, ...]:
        if ".qkv_proj." in name:
            return 0, 1, 2
        return (0, 1) if ".gate_up_proj." in name else (None,)

    def _shard_span(self, fused: str, shard: int) -> tuple[int, int]:
        if fused == "qkv_proj":
            q, kv = self.self_attn.q_size, self.self_attn.kv_size
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        size = self.mlp.down_proj.in_features
        return shard * size, size
