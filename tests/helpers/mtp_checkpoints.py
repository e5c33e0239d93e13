"""Targets that carry their own MTP layers, written the way DeepSeek-V3 and MiMo publish them: the
layers' tensors (their real names, written out here independently of the engine's reader) go into
mtp.safetensors beside the target's weights, and config.json gains num_nextn_predict_layers (MiMo's
also its model_type and architecture). Random layers, or "bigram" ones built from the target's own
weights that draft its bigram favourite, as tests/helpers/bigram_drafters.py does for EAGLE."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

# per layout: where layer j lives, and its own tensors beside the decoder layer's
LAYOUTS = {
    "deepseek": {"prefix": "model.layers.{index}.", "offset_by_target": True,
                 "norms": ("enorm", "hnorm", "shared_head.norm"), "projection": "eh_proj"},
    "mimo": {"prefix": "model.mtp_layers.{index}.", "offset_by_target": False,
             "norms": ("token_layernorm", "hidden_layernorm", "final_layernorm"),
             "projection": "input_proj"},
}


def read_config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def layer_prefix(config: dict, layout: str, depth: int) -> str:
    spec = LAYOUTS[layout]
    index = depth + (config["num_hidden_layers"] if spec["offset_by_target"] else 0)
    return spec["prefix"].format(index=index)


def target_tensors(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def random_mtp_tensors(config: dict, layout: str, depth: int, scale: float = 0.15,
                       seed: int = 0) -> dict[str, torch.Tensor]:
    """One MTP layer with random weights (q/k/v biases where the body has them, as Qwen2)."""
    generator = torch.Generator().manual_seed(seed * 100 + depth)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = hidden // heads

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden, generator=generator)

    p = layer_prefix(config, layout, depth)
    spec = LAYOUTS[layout]
    tensors = {f"{p}{name}.weight": norm() for name in spec["norms"]}
    tensors |= {
        f"{p}{spec['projection']}.weight": weight(hidden, 2 * hidden),
        f"{p}input_layernorm.weight": norm(),
        f"{p}self_attn.q_proj.weight": weight(heads * head_dim, hidden),
        f"{p}self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
        f"{p}self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
        f"{p}self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        f"{p}post_attention_layernorm.weight": norm(),
        f"{p}mlp.gate_proj.weight": weight(inner, hidden),
        f"{p}mlp.up_proj.weight": weight(inner, hidden),
        f"{p}mlp.down_proj.weight": weight(hidden, inner),
    }
    if is_qwen2(config):
        for name, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            tensors[f"{p}self_attn.{name}_proj.bias"] = 0.1 * torch.randn(size * head_dim,
                                                                           generator=generator)
    return tensors


def is_qwen2(config: dict) -> bool:
    return config.get("model_type") in ("qwen2", "mimo")


def bigram_mtp_tensors(config: dict, target: dict[str, torch.Tensor], layout: str,
                       depth: int) -> dict[str, torch.Tensor]:
    """A layer whose projection keeps the token's half and drops the state's, and whose decoder
    layer adds nothing (o_proj = down_proj = 0): its state is the token's normalised embedding, and
    the norm before the LM head is the target's final norm, so it drafts argmax
    lm_head(norm(embed(x))), the target's bigram favourite, at every depth."""
    tensors = random_mtp_tensors(config, layout, depth, seed=7)
    p, spec = layer_prefix(config, layout, depth), LAYOUTS[layout]
    hidden = config["hidden_size"]
    projection = torch.zeros(hidden, 2 * hidden)
    token_half = slice(hidden, 2 * hidden) if layout == "mimo" else slice(0, hidden)
    projection[:, token_half] = torch.eye(hidden)
    tensors[f"{p}{spec['projection']}.weight"] = projection
    tensors[f"{p}self_attn.o_proj.weight"].zero_()
    tensors[f"{p}mlp.down_proj.weight"].zero_()
    token_norm, _, head_norm = spec["norms"]
    tensors[f"{p}{token_norm}.weight"] = torch.ones(hidden)
    tensors[f"{p}{head_norm}.weight"] = target["model.norm.weight"].clone()
    return tensors


def add_mtp_layers(folder, layout: str = "deepseek", num_layers: int = 1, bigram: bool = False,
                   seed: int = 0, extra: dict[str, torch.Tensor] | None = None) -> str:
    """Write MTP layers into the target folder (mtp.safetensors) and name them in config.json;
    `extra`: more tensors for the same file (copies of the target's tables, stray names)."""
    config = read_config(folder)
    target = target_tensors(folder)
    tensors: dict[str, torch.Tensor] = {}
    for depth in range(num_layers):
        tensors |= (bigram_mtp_tensors(config, target, layout, depth) if bigram
                    else random_mtp_tensors(config, layout, depth, seed=seed))
    tensors |= extra or {}
    save_file({name: t.contiguous() for name, t in tensors.items()},
              os.path.join(folder, "mtp.safetensors"))
    config["num_nextn_predict_layers"] = num_layers
    if layout == "mimo":
        config |= {"model_type": "mimo", "architectures": ["MiMoForCausalLM"],
                   "auto_map": {"AutoConfig": "configuration_mimo.MiMoConfig",
                                "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"}}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return str(folder)


def copy_target(source, destination) -> str:
    """A copy of a target folder to add MTP layers to (the plain target stays the reference)."""
    shutil.copytree(source, destination)
    return str(destination)
