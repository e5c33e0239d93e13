"""Medusa head folders the tests write themselves, in the published layouts (FasterDecoding's and
vLLM's) and specserve's own: random heads, and heads built from a mostly-bigram target so that their
drafts are often right.

Tensors are made under specserve's names (vLLM's: blocks.{i}.layers.{j}.weight / .bias,
lm_heads.{i}.weight, lm_head.weight) and renamed for each layout on the way out."""

from __future__ import annotations

import json
import math
import os

import torch
import transformers
from safetensors.torch import save_file

from engine.models.arch import DecoderArch


def random_tensors(hidden: int, vocab: int, num_heads: int = 3, num_layers: int = 1,
                   projection: str = "per_head", bias: bool = True, seed: int = 0,
                   projection_rows: int | None = None) -> dict[str, torch.Tensor]:
    """Random heads: blocks that change the state by about its own size, projections whose logits
    spread over a few units. projection: "per_head", "shared" (one lm_head) or "target" (none)."""
    generator = torch.Generator().manual_seed(seed)
    rows = projection_rows or vocab
    tensors = {}
    for head in range(num_heads):
        for layer in range(num_layers):
            tensors[f"blocks.{head}.layers.{layer}.weight"] = \
                torch.randn(hidden, hidden, generator=generator) / math.sqrt(hidden)
            if bias:
                tensors[f"blocks.{head}.layers.{layer}.bias"] = \
                    0.1 * torch.randn(hidden, generator=generator)
        if projection == "per_head":
            tensors[f"lm_heads.{head}.weight"] = \
                2 * torch.randn(rows, hidden, generator=generator) / math.sqrt(hidden)
    if projection == "shared":
        tensors["lm_head.weight"] = 2 * torch.randn(rows, hidden, generator=generator) \
            / math.sqrt(hidden)
    return tensors


def write_authors_folder(folder: str, tensors: dict[str, torch.Tensor], num_heads: int,
                         num_layers: int, file: str = "safetensors", prefix: str = "") -> str:
    """FasterDecoding's layout: config.json (medusa_num_heads, medusa_num_layers,
    base_model_name_or_path) and medusa_lm_head.safetensors / .pt with `{i}.{j}.linear.weight`,
    `{i}.{j}.linear.bias` and `{i}.{num_layers}.weight`."""
    renamed = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[0] == "blocks":  # blocks.i.layers.j.kind
            renamed[f"{prefix}{parts[1]}.{parts[3]}.linear.{parts[4]}"] = tensor
        elif parts[0] == "lm_heads":
            renamed[f"{prefix}{parts[1]}.{num_layers}.weight"] = tensor
        else:
            raise ValueError(f"FasterDecoding's layout has no place for {name}")
    os.makedirs(folder, exist_ok=True)
    if file == "safetensors":
        save_file({k: v.contiguous() for k, v in renamed.items()},
                  os.path.join(folder, "medusa_lm_head.safetensors"))
    else:
        torch.save({k: v.half() for k, v in renamed.items()},
                   os.path.join(folder, "medusa_lm_head.pt"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
                   "base_model_name_or_path": "tiny-target", "transformers_version": "4.34.0"}, f)
    return folder


def write_vllm_folder(folder: str, tensors: dict[str, torch.Tensor], hidden: int, vocab: int,
                      num_heads: int, num_layers: int, original_lm_head: bool = False,
                      token_map: torch.Tensor | None = None, file: str = "safetensors") -> str:
    """vLLM's layout: config.json (model_type medusa, hidden_size, vocab_size, num_heads,
    num_hidden_layers, truncated_vocab_size, original_lm_head, medusa_fc_bias) and
    model.safetensors or pytorch_model.bin under `medusa_heads.`, with `token_map` when truncated."""
    renamed = {f"medusa_heads.{name}": t for name, t in tensors.items()}
    if original_lm_head and "lm_head.weight" in tensors:  # vLLM's converters write it as head 0's
        renamed["medusa_heads.lm_heads.0.weight"] = renamed.pop("medusa_heads.lm_head.weight")
    if token_map is not None:
        renamed["token_map"] = token_map
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": hidden,
              "vocab_size": vocab, "num_heads": num_heads, "num_hidden_layers": num_layers,
              "max_paths": 64, "topk": 10, "original_lm_head": original_lm_head,
              "medusa_fc_bias": any(name.endswith(".bias") for name in tensors)}
    if token_map is not None:
        config["truncated_vocab_size"] = len(token_map)
    os.makedirs(folder, exist_ok=True)
    if file == "safetensors":
        save_file({k: v.contiguous() for k, v in renamed.items()},
                  os.path.join(folder, "model.safetensors"))
    else:
        torch.save(renamed, os.path.join(folder, "pytorch_model.bin"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


# ---- heads that are often right ------------------------------------------------------------------
def build_medusa_target(path) -> str:
    """A mostly-bigram target (tests/helpers/tiny_models.py) whose hidden size (128) exceeds its
    vocabulary (96): its tokens' normalised embeddings are then independent, so a linear projection
    can send each one to any token (bigram_tensors). Its layers add less (layer_scale 0.003, not
    0.01) than bigram_drafters' target: a head guesses two to four tokens ahead from one state,
    where those drafters guess one ahead from the token itself, so the bigram has to hold longer.
    Heads 0-2 then guess right ~65%, ~50% and ~35% of the time on the tests' prompts."""
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint(path, "llama", seed=41, num_hidden_layers=2, layer_scale=0.003,
                                 hidden_size=128, intermediate_size=256)


def bigram_tensors(checkpoint: str, num_heads: int = 3) -> dict[str, torch.Tensor]:
    """Heads that guess what a mostly-bigram target will say. The target's state after token x is
    about s(x) = norm(embed(x)), and its next token about g(x) = argmax lm_head(s(x)); so from the
    state after x_t, head i guesses g^(i + 2)(x_t), the token i + 2 places on. Its blocks are zero
    (Medusa's own initialisation: the identity) and its projection P_i solves P_i s(x) = 8 ·
    onehot(g^(i + 2)(x)) for every x, exactly, since the s(x) are independent."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    arch = DecoderArch.from_hf_config(model.config)
    with torch.no_grad():
        states = model.model.norm(model.model.embed_tokens.weight)  # [vocab, hidden] s(x)
        favourite = model.lm_head(states).argmax(-1)  # [vocab] g(x)
    inverse = torch.linalg.pinv(states.T)  # [vocab, hidden]: inverse @ states.T = I
    tensors, guess = {}, favourite
    for head in range(num_heads):
        guess = favourite[guess]  # g^(head + 2)
        onehot = torch.zeros(arch.vocab_size, arch.vocab_size, dtype=torch.float64)
        onehot[guess, torch.arange(arch.vocab_size)] = 8.0  # column x: the guess after x
        tensors[f"lm_heads.{head}.weight"] = (onehot @ inverse).float()
        tensors[f"blocks.{head}.layers.0.weight"] = torch.zeros(arch.hidden_size, arch.hidden_size)
        tensors[f"blocks.{head}.layers.0.bias"] = torch.zeros(arch.hidden_size)
    return tensors


def write_bigram_medusa(checkpoint: str, folder: str, layout: str = "authors",
                        num_heads: int = 3) -> str:
    """bigram_tensors in FasterDecoding's layout ("authors") or vLLM's ("vllm")."""
    arch = DecoderArch.from_hf_config(transformers.AutoConfig.from_pretrained(checkpoint))
    tensors = bigram_tensors(checkpoint, num_heads)
    if layout == "authors":
        return write_authors_folder(folder, tensors, num_heads, 1)
    return write_vllm_folder(folder, tensors, arch.hidden_size, arch.vocab_size, num_heads, 1)
