"""EAGLE-1 heads as their authors publish them (SafeAILab/EAGLE, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B),
read into specserve's EagleHead so `"method": "eagle"` drafts with them unchanged.

Such a folder holds:
- config.json: the base model's Llama config cut to `num_hidden_layers: 1`, plus optionally `bias`
  (whether fc has one; the authors' loader defaults to true);
- pytorch_model.bin (or model.safetensors), the authors' module's whole state dict:
      fc.weight [hidden, 2 * hidden] (+ fc.bias)          fc([embed(x); feature])
      layers.0.self_attn.{q,k,v,o}_proj.weight            (+ q/k/v biases on Qwen2-style heads)
      layers.0.mlp.{gate,up,down}_proj.weight
      layers.0.post_attention_layernorm.weight
      embed_tokens.weight                                  (a copy of the base model's)
The authors' first layer has no input_layernorm: fc's output enters attention as it is (their
cnets.py builds and applies the norm only for layers after the first; vLLM replaces it with an
identity). Drafts are scored over the whole vocabulary by the target's LM head and read the target's
embedding, as the authors do; the copy of the embedding in the file is checked and dropped.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from engine.models.arch import DecoderArch
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.proposers.eagle_head import CONFIG_FILE, EagleConfig, EagleHead
from engine.proposers.head_weights import read_json_config, read_weights
from engine.proposers.speculator_folder import check_published_method, is_published

LAYER_PREFIX = "layers.0."


def load_eagle_head(folder: str, target: DecoderArch, dtype: torch.dtype,
                    device: torch.device) -> EagleHead:
    """specserve's own head folder, or one the EAGLE authors published (detected by its
    config.json and the absence of eagle_config.json), ready for inference; a head for another
    model fails here."""
    published = is_published(folder, CONFIG_FILE)
    head = load_authors_head(folder, target) if published else EagleHead.read(folder, target)
    return head.placed(target, dtype, device)


def read_authors_json(folder: str) -> dict[str, Any]:
    """config.json of an EAGLE-1 head; a folder published for another method fails naming it."""
    data = read_json_config(folder)
    if data is None:
        raise FileNotFoundError(f"no config.json in {folder}: not an EAGLE head folder")
    check_published_method(folder, data, "eagle")
    if data.get("speculators_model_type") is not None:
        raise ValueError(f"{folder} is in vLLM's speculators layout; for EAGLE-1 specserve reads "
                         f"the EAGLE authors' layout (config.json + pytorch_model.bin)")
    return data


def authors_config(folder: str, data: dict[str, Any], target: DecoderArch, has_fc_bias: bool,
                   has_qkv_bias: bool, has_input_norm: bool) -> EagleConfig:
    """The EagleConfig equivalent to the authors' head (config.json `data`, and what its tensors
    show); a head for another model fails here, naming the folder and both shapes."""
    if int(data.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"the EAGLE head in {folder} has {data['num_hidden_layers']} decoder "
                         f"layers; specserve runs one-layer heads")
    if "bias" in data and bool(data["bias"]) != has_fc_bias:
        raise ValueError(f"{folder}/config.json says bias={data['bias']}, but its weights "
                         f"{'have' if has_fc_bias else 'lack'} fc.bias")
    layer = _layer_arch(data)
    config = EagleConfig(
        hidden_size=int(data["hidden_size"]), vocab_size=int(data["vocab_size"]),
        num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
        intermediate_size=layer.intermediate_size, rms_norm_eps=layer.rms_norm_eps,
        draft_vocab_size=int(data["vocab_size"]), trained_for=f"EAGLE authors' head {folder}",
        fc_bias=has_fc_bias, input_norm=has_input_norm, qkv_bias=has_qkv_bias,
        rope_inv_freq=layer.rope_inv_freq if _names_rope(data) else None,
        rope_attention_scaling=layer.rope_attention_scaling)
    config.check_fits(target, folder)
    return config


def load_authors_head(folder: str, target: DecoderArch) -> EagleHead:
    """The authors' head in `folder` as an EagleHead (float32, on the CPU), every tensor placed."""
    data = read_authors_json(folder)
    weights = {name.removeprefix("model."): tensor
               for name, tensor in read_weights(folder).items()}
    if "fc.weight" not in weights:
        raise ValueError(f"{folder} holds no fc.weight: not an EAGLE head (a whole model drafts "
                         f'with "method": "draft_model")')
    config = authors_config(
        folder, data, target, has_fc_bias="fc.bias" in weights,
        has_qkv_bias=LAYER_PREFIX + "self_attn.q_proj.bias" in weights,
        has_input_norm=LAYER_PREFIX + "input_layernorm.weight" in weights)
    head = EagleHead(config, target)
    embeddings = weights.pop("embed_tokens.weight", None)
    if embeddings is not None and tuple(embeddings.shape) != (target.vocab_size,
                                                              target.hidden_size):
        raise ValueError(f"the EAGLE head in {folder} carries embeddings of shape "
                         f"{list(embeddings.shape)}; the target's are "
                         f"{[target.vocab_size, target.hidden_size]}")
    fc = {name.removeprefix("fc."): weights.pop(name) for name in ("fc.weight", "fc.bias")
          if name in weights}
    for name, tensor in fc.items():
        expected = tuple(getattr(head.fc, name).shape)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"the EAGLE head in {folder} has fc.{name} of shape "
                             f"{list(tensor.shape)}; hidden size {config.hidden_size} needs "
                             f"{list(expected)}")
    with torch.no_grad():
        head.fc.load_state_dict(fc)
    load_decoder_layer(head.layer, config.layer_arch(target), weights,
                       f"the EAGLE head in {folder}")
    with torch.no_grad():
        head.draft_token_ids.copy_(torch.arange(config.vocab_size))
    return head


def load_decoder_layer(layer: DecoderLayer, arch: DecoderArch, weights: dict[str, torch.Tensor],
                       what: str) -> None:
    """Copy Hugging Face-named `layers.0.*` tensors into `layer` through LlamaForCausalLM's own
    loader, which fuses q/k/v and gate/up exactly as for every target. The loader runs on a carrier
    model that holds only `layer` (a one-token vocabulary keeps its other tensors negligible); any
    tensor without a place, or a place without a tensor, fails naming `what` (an EAGLE head's
    folder, an MTP layer of a checkpoint)."""
    carrier = LlamaForCausalLM(replace(arch, num_layers=0, vocab_size=1, tie_word_embeddings=True))
    carrier.layers.append(layer)
    own = {name: param.detach().clone() for name, param in carrier.named_parameters()
           if not name.startswith("layers.")}
    try:
        carrier.load_weights({**own, **weights})
    except (ValueError, RuntimeError) as error:
        raise ValueError(f"{what} does not fit its config.json: {error}") from None


def _layer_arch(data: dict[str, Any]) -> DecoderArch:
    """The head's decoder layer as its config describes it (heads, sizes, norm eps, rotary)."""
    return DecoderArch.from_hf_config(SimpleNamespace(**{
        **data, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}))


def _names_rope(data: dict[str, Any]) -> bool:
    """Whether the config names its rotary frequencies (else the target's are used)."""
    return any(data.get(key) is not None for key in ("rope_theta", "rope_scaling",
                                                      "rope_parameters"))
