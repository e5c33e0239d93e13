"""A pure-torch decoder (Llama, Mistral, Qwen2, SmolLM, Qwen3, Gemma 3) over a flattened batch and a paged cache.

The families differ only in switches of engine/models/arch.py: per-head q/k norms (Qwen3, Gemma 3),
norms around each block's output, scaled embeddings, GeGLU and sliding layers with their own RoPE
(Gemma 3). In this module `post_attention_layernorm` is always the norm before the MLP (Llama's
name); Gemma 3's checkpoint names are mapped onto it at load (`_GEMMA3_NORMS`).

The forward takes explicit token ids, positions and attention metadata, so the target and a draft model in
the same process never share hidden state. q/k/v and gate/up are fused into one matmul each.

The torch ops below are the reference. `use_fused_ops` swaps in a set of fused per-layer ops with the
same signatures: specserve's C++ ops for float32 on the CPU (`kernels/decoder_ops.py`) or its Triton
kernels (`kernels/fused_ops_triton.py`); each is tested against these torch ops.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch import DecoderArch
from engine.models.attention import AttentionMetadata, paged_attention, write_kv


class RMSNorm(nn.Module):
    # a fused-ops module (rms_norm, add_rms_norm, rotary_, silu_and_mul), or None for the torch ops
    fused_ops = None

    def __init__(self, size: int, eps: float, scale_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # Gemma's order: scale in float32, then cast (Llama casts, then scales). Its weight here
        # is already 1 + the checkpoint's, folded at load exactly as its reference adds it.
        self.scale_in_float32 = scale_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None and x.dim() == 2:
            return self.fused_ops.rms_norm(x, self.weight, self.eps)
        # NOTE: normalise in float32 and cast back before the weight, exactly as the Hugging Face reference
        # does (float64 test models included), so greedy tokens match it.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_float32:
            return (xf * self.weight.float()).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def new_norm(arch: DecoderArch, size: int | None = None) -> RMSNorm:
    """An RMSNorm of this family over `size` features (default: the hidden size)."""
    return RMSNorm(size or arch.hidden_size, arch.rms_norm_eps, scale_in_float32=arch.gemma_norms)


def scale_embeddings(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Gemma's embeddings times sqrt(hidden), the scale cast to x's dtype as its reference does;
    None: x as it is."""
    if scale is None:
        return x
    return x * torch.tensor(scale, dtype=torch.float32).to(x.dtype)


class ScaledEmbedding(nn.Module):
    """A table's rows as the model's forward embeds them (scale_embeddings): what a drafter
    reads, as its trainer read transformers' get_input_embeddings()."""

    def __init__(self, table: nn.Module, scale: float) -> None:
        super().__init__()
        self.table, self.scale = table, scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return scale_embeddings(self.table(input_ids), self.scale)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by absolute position; computed in float32 like the reference."""

    def __init__(self, inv_freq: tuple[float, ...], scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor(inv_freq, dtype=torch.float32),
                             persistent=False)
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        cos = (freqs.cos() * self.scaling).to(dtype)
        sin = (freqs.sin() * self.scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]  # [T, 1, D/2] each, broadcast over heads


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [T, heads, D] with the first and second halves as the two components."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    # with fused ops: rotary in place on q and k within the qkv rows
    fused_ops = None
    # under tensor parallelism (engine/runner/collectives.py): o_proj is row-parallel, its parts summed
    tp_group = None
    # every row's bits independent of the step's other rows (engine/models/batch_invariant.py)
    batch_invariant = False

    def __init__(self, arch: DecoderArch, sliding: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.scale = arch.attention_scale or self.head_dim**-0.5
        # per-head norms of q and k before RoPE (Qwen3, Gemma 3), None where the family has none
        self.q_norm = new_norm(arch, self.head_dim) if arch.qk_norm else None
        self.k_norm = new_norm(arch, self.head_dim) if arch.qk_norm else None
        # a sliding layer of a model that mixes them: it reads the step's windowed layout
        # (AttentionMetadata.windowed) and the model's local RoPE tables
        self.sliding = sliding

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            self._normalize_heads(qkv)
        if self.fused_ops is not None:
            self.fused_ops.rotary_(qkv, cos[:, 0], sin[:, 0], self.num_heads + self.num_kv_heads,
                                   self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kvH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.fused_ops is None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(kv_cache, k, v, meta)
        attended = paged_attention(q, kv_cache, meta, self.scale, self.batch_invariant)
        out = self.o_proj(attended)  # [T, hidden]
        return out if self.tp_group is None else self.tp_group.all_reduce(out)

    def _normalize_heads(self, qkv: torch.Tensor) -> None:
        """q and k within the qkv rows, each head through its norm, in place (before RoPE)."""
        num_tokens = qkv.shape[0]
        q = qkv[:, :self.q_size].reshape(num_tokens * self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].reshape(
            num_tokens * self.num_kv_heads, self.head_dim)
        qkv[:, :self.q_size] = self.q_norm(q).view(num_tokens, self.q_size)
        qkv[:, self.q_size:self.q_size + self.kv_size] = self.k_norm(k).view(num_tokens,
                                                                             self.kv_size)


class MLP(nn.Module):
    fused_ops = None
    # under tensor parallelism: down_proj is row-parallel, its parts summed
    tp_group = None

    def __init__(self, arch: DecoderArch) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        # SwiGLU (silu) or Gemma's GeGLU (gelu_pytorch_tanh): act(gate) * up
        self.hidden_act = arch.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            fused = (self.fused_ops.silu_and_mul if self.hidden_act == "silu"
                     else self.fused_ops.gelu_tanh_and_mul)
            out = self.down_proj(fused(self.gate_up_proj(x)))
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            activated = F.silu(gate) if self.hidden_act == "silu" else F.gelu(gate,
                                                                            approximate="tanh")
            out = self.down_proj(activated * up)
        return out if self.tp_group is None else self.tp_group.all_reduce(out)


class DecoderLayer(nn.Module):
    # with fused ops: each norm one op, the second with the residual add before it
    fused_ops = None

    def __init__(self, arch: DecoderArch, sliding: bool = False) -> None:
        super().__init__()
        self.input_layernorm = new_norm(arch)
        self.self_attn = Attention(arch, sliding)
        self.post_attention_layernorm = new_norm(arch)  # before the MLP
        self.mlp = MLP(arch)
        # Gemma 3's norms of the attention's and the MLP's outputs, before each residual add
        self.attention_output_norm = new_norm(arch) if arch.sandwich_norms else None
        self.mlp_output_norm = new_norm(arch) if arch.sandwich_norms else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        if self.attention_output_norm is not None:
            attended = self.attention_output_norm(attended)
        if self.fused_ops is not None:
            norm = self.post_attention_layernorm
            x, normed = self.fused_ops.add_rms_norm(x, attended, norm.weight, norm.eps)
        else:
            x = x + attended
            normed = self.post_attention_layernorm(x)
        out = self.mlp(normed)
        if self.mlp_output_norm is not None:
            out = self.mlp_output_norm(out)
        return x + out


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: DecoderArch) -> None:
        super().__init__()
        self.arch = arch
        # NOTE: weights always come from a checkpoint, so the table is left uninitialized: a random
        # init on the meta device (build_model) imports torch._dynamo, ~1.7-3 s of start-up
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.rotary = RotaryEmbedding(arch.rope_inv_freq, arch.rope_attention_scaling)
        # the sliding layers' own RoPE base (Gemma 3), None where every layer shares `rotary`
        self.local_rotary = None if arch.local_rope_inv_freq is None else RotaryEmbedding(
            arch.local_rope_inv_freq, arch.local_rope_attention_scaling)
        self.layers = nn.ModuleList(DecoderLayer(arch, arch.is_sliding(index))
                                    for index in range(arch.num_layers))
        self.norm = new_norm(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # EAGLE-3 reads the residual stream entering these layers (HF's hidden_states[i]); each
        # forward then leaves them side by side in aux_hidden_states, [num_tokens, n * hidden]
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None
        # the whole decoder stack as one native call on the CPU (engine/models/native_pass.py),
        # set by build_model when the model allows it; None = the modules below
        self.native_pass = None
        # under tensor parallelism: this rank's first vocabulary row, and every rank's row count
        self.tp_group = None
        self.vocab_start, self.vocab_widths = 0, [arch.vocab_size]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; returns final-norm hidden states [num_tokens, hidden]."""
        return self._decode(input_ids, positions, meta, kv_caches, None)[0]

    def forward_with_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                            meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                            logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward's hidden states and compute_logits at `logits_rows` ([R] int64): one native
        call where the pass holds the LM head, the same bits either way."""
        hidden, logits = self._decode(input_ids, positions, meta, kv_caches, logits_rows)
        if logits is None:
            logits = self.compute_logits(hidden[logits_rows])
        return hidden, logits

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], logits_rows: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-norm hidden states, and the logits at `logits_rows` where the native pass
        computed them (else None)."""
        x = self.embed(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, x.dtype)
        local_cos, local_sin = (cos, sin) if self.local_rotary is None else self.local_rotary(
            positions, x.dtype)
        if self.native_pass is not None and self.native_pass.runs(meta):
            head_rows = logits_rows if self.native_pass.has_head else None
            hidden, aux, logits = self.native_pass(
                x, cos[:, 0], sin[:, 0], meta, kv_caches, self.aux_hidden_layers, head_rows,
                local_rotary=None if self.local_rotary is None else (local_cos[:, 0],
                                                                     local_sin[:, 0]))
            if self.aux_hidden_layers:
                self.aux_hidden_states = aux
            return hidden, logits
        aux = []
        windowed = meta.windowed or meta
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if index in self.aux_hidden_layers:
                aux.append(x)
            if layer.self_attn.sliding:
                x = layer(x, local_cos, local_sin, windowed, kv_cache)
            else:
                x = layer(x, cos, sin, meta, kv_cache)
        if self.aux_hidden_layers:
            self.aux_hidden_states = torch.cat(aux, dim=-1)
        return self.norm(x), None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden]; under tensor parallelism each rank looks up the
        ids in its rows, zeros the others, and the sum fills every row (exactly: x + 0 = x)."""
        if self.tp_group is None:
            return self._scaled(self.embed_tokens(input_ids))
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.arch.vocab_size)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return self._scaled(self.tp_group.all_reduce(x.masked_fill_(outside[:, None], 0.0)))

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return scale_embeddings(x, self.arch.embedding_scale)

    def use_tensor_parallel(self, group, vocab_start: int, vocab_widths: list[int]) -> None:
        """This module is one rank's shard (engine/runner/sharding.py): every row-parallel output
        and the embedding are summed over `group`, logits gathered on its first rank."""
        self.tp_group, self.vocab_start, self.vocab_widths = group, vocab_start, list(vocab_widths)
        self.native_pass = None  # NOTE: the native pass knows no collectives
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.tp_group = group

    def use_fused_ops(self, fused_ops: ModuleType | None) -> None:
        """Run every norm, rotary and SiLU-and-multiply through `fused_ops` (None: the torch ops)."""
        use_fused_ops(self, fused_ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [num_rows, hidden] (only the rows that sample) -> logits [num_rows, vocab]
        (under tensor parallelism: on the first rank; the others get None)."""
        logits = self.lm_head(hidden)
        if self.tp_group is None:
            return logits
        return self.tp_group.gather_columns(logits, self.vocab_widths)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; a missing tensor is an error."""
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights.items():
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if self.arch.sandwich_norms:
                name = _gemma3_norm_name(name)
            if self.arch.gemma_norms and name.endswith("norm.weight"):
                # NOTE: exactly the reference's `1.0 + weight.float()`, computed once
                tensor = 1.0 + tensor.float()
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, shard = fused[parts[-2]]
                name = ".".join(parts[:-2] + [fused_name, parts[-1]])
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}")
            param = params[name]
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    sizes = self._shard_sizes(name)
                    param.narrow(0, sum(sizes[:shard]), sizes[shard]).copy_(tensor)
            loaded.add(f"{name}#{shard}")
        self._check_complete(loaded, params)

    def _shard_sizes(self, name: str) -> list[int]:
        if "qkv_proj" in name:
            return [self.arch.q_size, self.arch.kv_size, self.arch.kv_size]
        return [self.arch.intermediate_size, self.arch.intermediate_size]

    def _check_complete(self, loaded: set[str], params: dict[str, nn.Parameter]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            shards = range(3 if "qkv_proj" in name else 2) if "_proj." in name and (
                "qkv_proj" in name or "gate_up_proj" in name) else [None]
            missing += [name for s in shards if f"{name}#{s}" not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(set(missing))[:8]}")


# Gemma 3's per-layer norm names -> this module's (post_attention_layernorm is the one before the MLP)
_GEMMA3_NORMS = {"post_attention_layernorm": "attention_output_norm",
                 "pre_feedforward_layernorm": "post_attention_layernorm",
                 "post_feedforward_layernorm": "mlp_output_norm"}


def _gemma3_norm_name(name: str) -> str:
    """layers.N.<Gemma 3 norm>.weight -> layers.N.<this module's norm>.weight; others as they are."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in _GEMMA3_NORMS:
        parts[2] = _GEMMA3_NORMS[parts[2]]
    return ".".join(parts)


def use_fused_ops(model: nn.Module, fused_ops: ModuleType | None) -> None:
    """Every norm, attention, MLP and decoder layer of `model` (a target or a draft head built from
    these blocks) runs its per-layer ops through `fused_ops` (None: the torch ops)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, DecoderLayer, Attention, MLP)):
            module.fused_ops = fused_ops
    if isinstance(model, LlamaForCausalLM):
        model.native_pass = None  # NOTE: built for the ops it had; build_model builds it after
