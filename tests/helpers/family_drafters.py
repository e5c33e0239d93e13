"""Often-right drafters for tiny Qwen3 and Gemma 3 targets where bigram_drafters.py's and
mtp_checkpoints.py's Llama-shaped builders do not fit (EAGLE-3, MTP): these targets' head_dim is
not hidden / heads, and their final norm has a gain of its own (Gemma's is 1 + weight). Also the
mostly-bigram target itself, which build_tiny_checkpoint's layer_scale alone does not make for
Gemma 3, and a draft model cut from the target.

Every drafter here guesses the target's bigram favourite g(x) = argmax lm_head(norm(embed(x))),
as bigram_drafters.py's do, with the final norm's gain folded in so the guess is the target's."""

from __future__ import annotations

import json
import os
import shutil

import torch
import transformers
from bigram_drafters import final_norm_gain
from safetensors.torch import load_file, save_file

from engine.models.arch import DecoderArch
from engine.proposers.mtp_head import DEEPSEEK, MtpLayer, mtp_layer_arch, mtp_layer_tensors

WEIGHTS = "model.safetensors"
# per family, how much each layer adds: the target's greedy token is then its last token's bigram
# favourite ~85-90% of the time on test prompts (Medusa's heads, guessing 2-4 tokens ahead, need
# that much; the context still decides the rest). Gemma 3's scale goes to its output norms' gains
# (build_tiny_checkpoint), which give a block's output unit scale whatever o_proj and down_proj are.
MOSTLY_BIGRAM_SCALE = {"qwen3": 0.003, "gemma3": 0.1}


def build_mostly_bigram_target(path, kind: str, seed: int = 41) -> str:
    """A mostly-bigram target of `kind` (tiny_models.build_tiny_checkpoint): hidden 128 over a
    96-token vocabulary (Medusa's bigram heads need independent states: medusa_heads.py), three
    layers (EAGLE-3 reads all three; Gemma 3's are sliding, sliding, full), head_dim 24."""
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint(path, kind, seed=seed, num_hidden_layers=3, hidden_size=128,
                                 intermediate_size=256, layer_scale=MOSTLY_BIGRAM_SCALE[kind])


def _target(checkpoint: str) -> tuple[DecoderArch, transformers.PreTrainedModel]:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return DecoderArch.from_hf_config(model.config), model


def add_bigram_mtp_layers(target: str, folder: str, num_layers: int = 2) -> str:
    """A copy of `target` carrying `num_layers` MTP layers in DeepSeek-V3's layout, each drafting
    g(x): the projection keeps the token's half, the decoder layer adds nothing, and the norm
    before the LM head has the final norm's gain. Written by the engine's own writer
    (mtp_layer_tensors), so the layer is shaped as the engine reads it whatever the family."""
    arch, model = _target(target)
    shutil.copytree(target, folder)
    hidden, gain = arch.hidden_size, final_norm_gain(arch, model)
    tensors = {}
    torch.manual_seed(7)
    for depth in range(num_layers):
        layer = MtpLayer(mtp_layer_arch(arch, 1), DEEPSEEK)
        with torch.no_grad():
            layer.proj.weight.zero_()
            layer.proj.weight[:, :hidden] = torch.eye(hidden)  # DeepSeek: [token ; state]
            layer.layer.self_attn.o_proj.weight.zero_()
            layer.layer.mlp.down_proj.weight.zero_()
            layer.head_norm.weight.copy_(gain)
        tensors |= mtp_layer_tensors(layer, DEEPSEEK.prefix(arch.num_layers, depth))
    save_file(tensors, os.path.join(folder, "mtp.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = num_layers
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return str(folder)


def write_layer_subset(target: str, folder: str, keep: tuple[int, ...]) -> str:
    """The target with only the layers `keep` (renumbered, their layer types kept): a draft model
    of the same family that shares every weight it has with the target, so on a mostly-bigram
    target it guesses right most of the time, not always."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    tensors = {}
    for name, tensor in load_file(os.path.join(target, WEIGHTS)).items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            if int(parts[2]) not in keep:
                continue
            parts[2] = str(keep.index(int(parts[2])))
        tensors[".".join(parts)] = tensor
    config["num_hidden_layers"] = len(keep)
    if config.get("layer_types"):
        config["layer_types"] = [config["layer_types"][i] for i in keep]
    save_file(tensors, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return folder
