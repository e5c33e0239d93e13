"""Put a checkpoint's packed weights (GGUF blocks, bf16/f16) into a Llama module on the CPU as they are.

Linear layers whose weights the checkpoint keeps packed become `QuantizedLinear` (q/k/v and gate/up
stacked, as the module fuses them), the embedding a `QuantizedEmbedding` (its rows dequantized at
lookup, and the same bytes serve as the tied LM head). Everything else (norms, float32 tensors) is
left for `LlamaForCausalLM.load_weights`. The modules are swapped in while the model is still on the
meta device, so no float32 copy of a packed weight is ever allocated.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.models.cpu_linear import QuantizedEmbedding, QuantizedLinear
from engine.models.llama import LlamaForCausalLM
from kernels.packed_weight import PackedWeight

# the module's fused linears and the Hugging Face projections stacked into each, in order
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.down_proj": ("mlp.down_proj",)}


def has_packed_weights(weights: Mapping[str, object]) -> bool:
    return any(isinstance(tensor, PackedWeight) for tensor in weights.values())


def expand_packed_weights(weights: Mapping[str, torch.Tensor | PackedWeight],
                          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every packed weight dequantized (exactly as transformers would) and cast to `dtype`."""
    return {name: tensor.dequantize().to(dtype) if isinstance(tensor, PackedWeight) else tensor
            for name, tensor in weights.items()}


def install_packed_weights(model: LlamaForCausalLM, weights: Mapping[str, torch.Tensor | PackedWeight]
                           ) -> dict[str, torch.Tensor]:
    """Swap packed modules into `model` (on the meta device); returns the weights left to load."""
    rest = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
    for index, layer in enumerate(model.layers):
        prefix = f"layers.{index}."
        for fused, parts in _FUSED.items():
            names = [f"{prefix}{part}.weight" for part in parts]
            if not all(isinstance(rest.get(name), PackedWeight) for name in names):
                for name in names:  # a layer the file keeps partly in float: expand the rest of it
                    if isinstance(rest.get(name), PackedWeight):
                        rest[name] = rest[name].dequantize()
                continue
            biases = [rest.pop(f"{prefix}{part}.bias", None) for part in parts]
            bias = None if all(b is None for b in biases) else torch.cat(biases)
            parent, _, child = f"{prefix}{fused}".rpartition(".")
            setattr(model.get_submodule(parent), child,
                    QuantizedLinear.from_packed([rest.pop(name) for name in names], bias))
    embedding = rest.get("embed_tokens.weight")
    if isinstance(embedding, PackedWeight):
        model.embed_tokens = QuantizedEmbedding(rest.pop("embed_tokens.weight"))
        if model.arch.tie_word_embeddings:
            model.lm_head = model.embed_tokens.as_linear()
    head = rest.get("lm_head.weight")
    if isinstance(head, PackedWeight):
        model.lm_head = QuantizedLinear.from_packed([rest.pop("lm_head.weight")])
    for name, tensor in rest.items():  # what no packed module took: expand
        if isinstance(tensor, PackedWeight):
            rest[name] = tensor.dequantize()
    return rest


def packed_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of packed weights, bytes of float parameters and buffers) the model holds; a table
    shared by the embedding and the tied LM head counts once."""
    tables = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            tables.update((id(part), part) for part in module.parts)
        elif isinstance(module, QuantizedEmbedding):
            tables[id(module.table)] = module.table
    dense = {id(t): t for t in (*model.parameters(), *model.buffers())}
    # NOTE: float32 in the kernel's layout (a float32 layer run by the native pass) is not packed
    float32 = sum(t.nbytes for t in tables.values() if t.format == "F32")
    return (sum(table.nbytes for table in tables.values()) - float32,
            sum(t.numel() * t.element_size() for t in dense.values()) + float32)


def packed_formats(model: torch.nn.Module) -> list[str]:
    """The packed formats the model's modules hold, for logs."""
    formats = set()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            formats.update(part.format for part in module.parts)
        elif isinstance(module, QuantizedEmbedding):
            formats.add(module.table.format)
    return sorted(formats - {"F32"})
