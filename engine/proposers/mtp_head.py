"""Multi-token prediction (MTP) layers, read from the target's own checkpoint as DeepSeek-V3 and
MiMo ship them, to draft as EAGLE heads do (engine/proposers/mtp.py).

MTP layer j (j = 0 .. N-1) at position p reads the token x_p and the state before it, h^j_{p-1}:
the target's final-norm hidden state f_{p-1} for layer 0, layer j-1's output for the others:

    s = proj([token_norm(embed(x_p)) ; hidden_norm(h^j_{p-1})])     MiMo: [hidden ; token]
    h^{j+1}_p = decoder_layer(s)                                      MiMo: final_layernorm after
    logits(x_{p+1+j}) = lm_head(head_norm(h^{j+1}_p))                 DeepSeek: shared_head.norm

so at the newest position layer j guesses the token j + 1 places further on. The state fed on is
the layer's output (DeepSeek: before shared_head.norm; MiMo: after final_layernorm). The target's
feature is its final-norm hidden state, as vLLM feeds it (its DeepSeek model hands the drafter
norm(hidden + residual)); hidden_norm rescales it anyway, RMSNorm being blind to scale.

The layouts (N = config.json's num_nextn_predict_layers, L = num_hidden_layers):
- DeepSeek-V3: layer j under model.layers.{L + j}.: enorm, hnorm, eh_proj, shared_head.norm, and
  optionally shared_head.head and embed_tokens (DeepSeek-V3's files carry copies of the target's;
  a copy equal to the target's is dropped and the target's shared), plus the decoder layer's own
  names (input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.*_proj).
- MiMo (XiaomiMiMo/MiMo-7B, a Qwen2 body): layer j under model.mtp_layers.{j}.: token_layernorm,
  hidden_layernorm, input_proj, final_layernorm and the decoder layer's names; the target's
  embedding and LM head serve every layer.
Decoder layers of the target's own shape (Llama, Mistral, Qwen2) are what specserve runs; MoE or
MLA layers fail naming the tensors that have no place.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from engine.models.arch import DecoderArch
from engine.models.attention import AttentionMetadata
from engine.models.llama import DecoderLayer, RMSNorm, RotaryEmbedding
from engine.proposers.published_eagle import load_decoder_layer

CONFIG_KEY = "num_nextn_predict_layers"
# the decoder layer's Hugging Face names (q/k/v and gate/up unfused), as every layout keeps them
_DECODER_NAMES = frozenset(
    ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"]
    + [f"self_attn.{name}_proj.{kind}" for name in "qkv" for kind in ("weight", "bias")]
    + [f"mlp.{name}_proj.weight" for name in ("gate", "up", "down")])


@dataclass(frozen=True)
class MtpLayout:
    """Where one published layout keeps an MTP layer's tensors, and how it wires them."""

    name: str  # which models ship it, for messages
    # where layer i's tensors are: "{index}" is i, or num_hidden_layers + i where numbered after
    # the target's layers (DeepSeek-V3's layers continue the decoder stack's numbering)
    layer_prefix: str
    numbered_after_target: bool
    token_norm: str
    hidden_norm: str
    projection: str
    # the projection reads [hidden ; token] (MiMo), not [token ; hidden]
    hidden_first: bool
    # applied to the layer's output, which is then fed on (MiMo's final_layernorm)
    output_norm: str | None
    # applied before the LM head only (DeepSeek's shared_head.norm)
    head_norm: str | None
    # the layer's own LM head and embedding, where the layout may carry them (DeepSeek)
    own_head: str | None
    own_embedding: str | None

    def prefix(self, num_target_layers: int, depth: int) -> str:
        index = depth + (num_target_layers if self.numbered_after_target else 0)
        return self.layer_prefix.format(index=index)


DEEPSEEK = MtpLayout("DeepSeek-V3", "model.layers.{index}.", numbered_after_target=True,
                     token_norm="enorm", hidden_norm="hnorm", projection="eh_proj",
                     hidden_first=False, output_norm=None, head_norm="shared_head.norm",
                     own_head="shared_head.head", own_embedding="embed_tokens")
MIMO = MtpLayout("MiMo", "model.mtp_layers.{index}.", numbered_after_target=False,
                 token_norm="token_layernorm", hidden_norm="hidden_layernorm",
                 projection="input_proj", hidden_first=True, output_norm="final_layernorm",
                 head_norm=None, own_head=None, own_embedding=None)
LAYOUTS = (DEEPSEEK, MIMO)


class MtpLayer(nn.Module):
    """One MTP module; forward has an EAGLE head's signature, so the EAGLE trainer's unrolled
    layout (engine/training/train_eagle.py) runs it as it is."""

    # the decoder layer as one native call on the CPU (engine/models/native_pass.py), where the
    # proposer built one; None = the layer's modules
    native_pass = None

    def __init__(self, arch: DecoderArch, layout: MtpLayout) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.layout = layout
        self.token_norm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(arch)
        self.output_norm = RMSNorm(hidden, eps) if layout.output_norm else None
        self.head_norm = RMSNorm(hidden, eps) if layout.head_norm else None
        # the layer's own embedding and LM head where they differ from the target's; else None
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head: nn.Linear | None = None
        self.rotary = RotaryEmbedding(arch.rope_inv_freq, arch.rope_attention_scaling)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """token_embeds, features: [T, hidden] (x_p's embedding, the state at p - 1); kv_caches:
        this layer's cache, in a list as a model's; returns the state fed on, [T, hidden]."""
        token, state = self.token_norm(token_embeds), self.hidden_norm(features)
        x = self.proj(torch.cat([state, token] if self.layout.hidden_first else [token, state],
                                dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        if self.native_pass is not None and self.native_pass.runs(meta):
            x = self.native_pass(x, cos[:, 0], sin[:, 0], meta, kv_caches, ())[0]
        else:
            x = self.layer(x, cos, sin, meta, kv_caches[0])
        return x if self.output_norm is None else self.output_norm(x)

    def head_input(self, state: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of the state: [T, hidden]."""
        return state if self.head_norm is None else self.head_norm(state)

    def named_roles(self) -> dict[str, nn.Module]:
        """The layout's tensor-name stems -> this layer's modules (the decoder layer aside)."""
        layout = self.layout
        roles = {layout.token_norm: self.token_norm, layout.hidden_norm: self.hidden_norm,
                 layout.projection: self.proj}
        if layout.output_norm:
            roles[layout.output_norm] = self.output_norm
        if layout.head_norm:
            roles[layout.head_norm] = self.head_norm
        return roles


class MtpHead(nn.Module):
    """A checkpoint's N MTP layers (N = num_nextn_predict_layers), each with its own KV cache."""

    def __init__(self, arch: DecoderArch, layout: MtpLayout, num_layers: int) -> None:
        super().__init__()
        self.layout = layout
        self.layers = nn.ModuleList(MtpLayer(mtp_layer_arch(arch, 1), layout)
                                    for _ in range(num_layers))

    def placed(self, dtype: torch.dtype, device: torch.device) -> MtpHead:
        """The head in `dtype` on `device`, for inference; rotary frequencies stay float32."""
        inv_freqs = [layer.rotary.inv_freq.clone() for layer in self.layers]
        head = self.to(device=device, dtype=dtype).eval().requires_grad_(False)
        for layer, inv_freq in zip(head.layers, inv_freqs):
            layer.rotary.inv_freq = inv_freq.to(device)
        return head


def mtp_layer_arch(target: DecoderArch, num_layers: int) -> DecoderArch:
    """The MTP layers are shaped like the target's; their cache holds one layer per MTP layer.
    NOTE: full attention, as EAGLE's head: a sliding window only narrows what a draft sees."""
    return target.plain_layers(num_layers)


# ---------------------------------------------------------------- reading a checkpoint


class CheckpointTensors:
    """The tensors of a folder's *.safetensors files, each read only when asked for."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._shard_of: dict[str, str] = {}
        for shard in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            with safe_open(shard, framework="pt") as handle:
                self._shard_of.update(dict.fromkeys(handle.keys(), shard))

    def names(self, prefix: str) -> list[str]:
        return [name for name in self._shard_of if name.startswith(prefix)]

    def __contains__(self, name: str) -> bool:
        return name in self._shard_of

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self._shard_of[name], framework="pt") as handle:
            return handle.get_tensor(name)


def read_mtp_head(folder: str | None, target: DecoderArch) -> MtpHead:
    """The MTP layers of the target's checkpoint `folder` (float32, on the CPU); a checkpoint
    without them, or with layers that do not fit the target, fails here naming what is missing."""
    looked_for = (f'config.json "{CONFIG_KEY}" and tensors model.layers.'
                  f'{{num_hidden_layers + i}}.* ({DEEPSEEK.name}) or model.mtp_layers.{{i}}.* '
                  f'({MIMO.name})')
    if folder is None or not os.path.isdir(folder):
        what = "the embedded GGUF" if folder is None else f"{folder}, not a folder,"
        raise ValueError(f'speculative method "mtp" reads the MTP layers from the target\'s own '
                         f'Hugging Face folder ({looked_for}); the target is {what} which holds '
                         f'none: serve a folder with MTP layers, e.g. one written by '
                         f'`specserve train-speculator --method mtp --out DIR`')
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    num_layers = int(config.get(CONFIG_KEY) or 0)
    num_target_layers = int(config["num_hidden_layers"])
    if num_layers < 1:
        raise ValueError(f'{folder} holds no MTP layers: config.json has no "{CONFIG_KEY}" '
                         f'(or 0); specserve looks for {looked_for}')
    tensors = CheckpointTensors(folder)
    layouts = [layout for layout in LAYOUTS if tensors.names(layout.prefix(num_target_layers, 0))]
    if not layouts:
        raise ValueError(f'{folder}/config.json says "{CONFIG_KEY}": {num_layers}, but its '
                         f'weights hold no MTP layer: no tensor under '
                         f'{DEEPSEEK.prefix(num_target_layers, 0)} ({DEEPSEEK.name}) nor '
                         f'{MIMO.prefix(num_target_layers, 0)} ({MIMO.name})')
    layout = layouts[0]
    head = MtpHead(target, layout, num_layers)
    for depth, layer in enumerate(head.layers):
        _load_layer(layer, tensors, depth, layout.prefix(num_target_layers, depth), target)
    return head


def _load_layer(layer: MtpLayer, tensors: CheckpointTensors, depth: int, prefix: str,
                target: DecoderArch) -> None:
    what = f"MTP layer {depth} ({prefix}*) of {tensors.folder}"
    names = tensors.names(prefix)
    if not names:
        raise ValueError(f"{tensors.folder} lacks MTP layer {depth} of its config's "
                         f"{CONFIG_KEY}: no tensor under {prefix} ({layer.layout.name} layout)")
    weights = {name.removeprefix(prefix): tensors.get(name) for name in names}
    decoder = {f"layers.0.{name}": weights.pop(name) for name in list(weights)
               if name in _DECODER_NAMES}
    load_decoder_layer(layer.layer, mtp_layer_arch(target, 1), decoder, what)
    for stem, module in layer.named_roles().items():
        _copy_param(module, "weight", weights.pop(f"{stem}.weight", None), f"{prefix}{stem}", what)
    layout = layer.layout
    if layout.own_head and f"{layout.own_head}.weight" in weights:
        own = weights.pop(f"{layout.own_head}.weight")
        if not _equals_target(own, tensors, ("lm_head.weight", "model.embed_tokens.weight")):
            layer.lm_head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)
            _copy_param(layer.lm_head, "weight", own, f"{prefix}{layout.own_head}", what)
    if layout.own_embedding and f"{layout.own_embedding}.weight" in weights:
        own = weights.pop(f"{layout.own_embedding}.weight")
        if not _equals_target(own, tensors, ("model.embed_tokens.weight",)):
            layer.embed_tokens = nn.Embedding(target.vocab_size, target.hidden_size)
            _copy_param(layer.embed_tokens, "weight", own, f"{prefix}{layout.own_embedding}", what)
    if weights:
        raise ValueError(f"{what}: tensors {sorted(prefix + name for name in weights)[:6]} have "
                         f"no place in an MTP layer of the {layout.name} layout (specserve runs "
                         f"MTP layers shaped like a Llama, Mistral or Qwen2 decoder layer)")


def _copy_param(module: nn.Module, name: str, tensor: torch.Tensor | None, full_name: str,
                what: str) -> None:
    param = getattr(module, name)
    if tensor is None:
        raise ValueError(f"{what} lacks {full_name}.{name}")
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"{what}: {full_name}.{name} is {list(tensor.shape)}, the target's shape "
                         f"needs {list(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


def _equals_target(tensor: torch.Tensor, tensors: CheckpointTensors,
                   candidates: tuple[str, ...]) -> bool:
    """Whether the layer's copy equals the target's own tensor (the first of `candidates` the
    checkpoint holds: an LM head tied to the embedding has no lm_head.weight)."""
    for name in candidates:
        if name in tensors:
            theirs = tensors.get(name)
            return theirs.shape == tensor.shape and bool(torch.equal(theirs, tensor))
    return False


# ---------------------------------------------------------------- writing one (training)


def mtp_layer_tensors(layer: MtpLayer, prefix: str) -> dict[str, torch.Tensor]:
    """The layer's tensors under `prefix` with the layout's names, q/k/v and gate/up unfused, as a
    published checkpoint holds them (float32, contiguous)."""
    tensors = {f"{prefix}{stem}.weight": module.weight
               for stem, module in layer.named_roles().items()}
    decoder = layer.layer
    attention, mlp = decoder.self_attn, decoder.mlp
    q, kv = attention.q_size, attention.kv_size
    for name, part in zip(("q_proj", "k_proj", "v_proj"), (slice(0, q), slice(q, q + kv),
                                                           slice(q + kv, q + 2 * kv))):
        tensors[f"{prefix}self_attn.{name}.weight"] = attention.qkv_proj.weight[part]
        if attention.qkv_proj.bias is not None:
            tensors[f"{prefix}self_attn.{name}.bias"] = attention.qkv_proj.bias[part]
    inner = mlp.down_proj.in_features
    tensors[f"{prefix}mlp.gate_proj.weight"] = mlp.gate_up_proj.weight[:inner]
    tensors[f"{prefix}mlp.up_proj.weight"] = mlp.gate_up_proj.weight[inner:]
    for name, module in (("self_attn.o_proj", attention.o_proj), ("mlp.down_proj", mlp.down_proj),
                         ("input_layernorm", decoder.input_layernorm),
                         ("post_attention_layernorm", decoder.post_attention_layernorm)):
        tensors[f"{prefix}{name}.weight"] = module.weight
    return {name: t.detach().float().contiguous() for name, t in tensors.items()}
