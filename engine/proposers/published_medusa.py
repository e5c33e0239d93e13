"""Medusa heads as their authors publish them and as vLLM reads them, renamed into MedusaHeads
(medusa_heads.py), so `"method": "medusa"` drafts with them unchanged.

FasterDecoding/Medusa (e.g. FasterDecoding/medusa-vicuna-7b-v1.3): config.json with
`medusa_num_heads`, `medusa_num_layers` (default 1) and `base_model_name_or_path`, beside
medusa_lm_head.safetensors or medusa_lm_head.pt, the state dict of their `medusa_head` ModuleList:
      {i}.{j}.linear.weight [hidden, hidden], {i}.{j}.linear.bias   head i's ResBlock j
      {i}.{num_layers}.weight [vocab, hidden]                       head i's projection
(possibly prefixed `medusa_head.`). A file without any projection shares the target's LM head.

vLLM (vllm/model_executor/models/medusa.py): config.json with `model_type` "medusa", hidden_size,
vocab_size, num_heads, num_hidden_layers, optionally truncated_vocab_size, original_lm_head and
medusa_fc_bias (default false), beside model.safetensors or pytorch_model.bin holding
`blocks.{i}.layers.{j}.weight` (+ `.bias`), `lm_heads.{i}.weight` ([truncated_vocab_size, hidden];
with original_lm_head one shared `lm_heads.0.weight` or `lm_head.weight`) and, when the vocabulary
is truncated, `token_map` (the draft vocabulary's token ids), possibly prefixed `medusa_heads.`.
A folder without any projection shares the target's LM head.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from safetensors.torch import load_file

from engine.models.arch import DecoderArch
from engine.proposers.head_weights import read_json_config, read_weights
from engine.proposers.medusa_heads import CONFIG_FILE, MedusaConfig, MedusaHeads
from engine.proposers.speculator_folder import published_method

# FasterDecoding's weight files, in the order looked for
AUTHORS_WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_AUTHORS_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_AUTHORS_PROJECTION = re.compile(r"(\d+)\.(\d+)\.weight")


def load_medusa_heads(folder: str, target: DecoderArch, dtype: torch.dtype,
                      device: torch.device) -> MedusaHeads:
    """specserve's own folder, FasterDecoding's or vLLM's, ready for inference; heads made for
    another model, or a folder of none of these layouts, fail here naming the folder."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"Medusa head folder {folder} does not exist")
    if os.path.isfile(os.path.join(folder, CONFIG_FILE)):
        heads = MedusaHeads.read(folder)
    elif authors_weight_file(folder) is not None:
        heads = read_authors_heads(folder, target)
    else:
        heads = read_vllm_heads(folder, target)
    heads.config.check_fits(target, folder)
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


def authors_weight_file(folder: str) -> str | None:
    for name in AUTHORS_WEIGHT_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def read_authors_heads(folder: str, target: DecoderArch) -> MedusaHeads:
    """FasterDecoding's layout; its config gives the head and block counts, its tensors the sizes."""
    data = read_json_config(folder) or {}
    path = authors_weight_file(folder)
    if path.endswith(".safetensors"):
        weights = load_file(path)
    else:  # NOTE: weights_only: a pickled checkpoint can carry tensors and nothing that runs
        weights = torch.load(path, map_location="cpu", weights_only=True)
    weights = {name.removeprefix("medusa_head."): tensor for name, tensor in weights.items()}
    blocks = [match.groups() for match in map(_AUTHORS_BLOCK.fullmatch, weights) if match]
    num_layers = len({layer for head, layer, _ in blocks if head == "0"})
    if int(data.get("medusa_num_layers", num_layers)) != num_layers:
        raise ValueError(f"{folder}: config.json says medusa_num_layers "
                         f"{data['medusa_num_layers']}, {os.path.basename(path)} holds "
                         f"{num_layers} ResBlocks per head")
    num_heads = int(data.get("medusa_num_heads") or
                    1 + max((int(head) for head, _, _ in blocks), default=-1))
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        block, projection = _AUTHORS_BLOCK.fullmatch(name), _AUTHORS_PROJECTION.fullmatch(name)
        if block:
            head, layer, kind = block.groups()
            renamed[f"blocks.{head}.layers.{layer}.{kind}"] = tensor
        elif projection and int(projection.group(2)) == num_layers:
            renamed[f"lm_heads.{projection.group(1)}.weight"] = tensor
        else:
            renamed[name] = tensor  # NOTE: reported as unplaced, under the file's own name
    has_bias = any(name.endswith(".bias") for name in renamed)
    return _heads_from(folder, renamed, num_heads, num_layers, has_bias, target,
                       shared_projection=False, draft_vocab_size=None)


def read_vllm_heads(folder: str, target: DecoderArch) -> MedusaHeads:
    data = read_json_config(folder)
    if data is None:
        raise FileNotFoundError(
            f"{folder} holds no Medusa heads: expected {CONFIG_FILE} (written by `specserve "
            f"train-speculator --method medusa`), FasterDecoding's config.json with "
            f"{' or '.join(AUTHORS_WEIGHT_FILES)}, or vLLM's config.json (model_type medusa) with "
            f"its weights")
    if not is_vllm_medusa_config(data):
        found = published_method(data)
        what = (f"a published {found!r} speculator" if found not in ("eagle", "medusa")
                else "no Medusa heads")
        raise ValueError(f"{folder} holds {what}: its config.json has no Medusa head count "
                         f"(medusa_num_heads, or num_heads with model_type medusa) and there is "
                         f"no {' or '.join(AUTHORS_WEIGHT_FILES)}")
    weights = {name.removeprefix("medusa_heads."): tensor
               for name, tensor in read_weights(folder).items()}
    vocab_size = int(data.get("vocab_size", target.vocab_size))
    truncated = int(data.get("truncated_vocab_size") or vocab_size)
    token_map = weights.pop("token_map", None)
    draft_vocab_size = None
    if truncated < vocab_size:
        if token_map is None:
            raise ValueError(f"{folder}: truncated_vocab_size {truncated} < vocab_size "
                             f"{vocab_size} needs a token_map tensor of the draft vocabulary")
        weights["draft_token_ids"] = token_map
        draft_vocab_size = truncated
    shared = bool(data.get("original_lm_head", False))
    if shared and "lm_heads.0.weight" in weights:
        # NOTE: as vLLM reads it: the first head's projection serves every head, copies ignored
        weights["lm_head.weight"] = weights.pop("lm_heads.0.weight")
        weights = {name: t for name, t in weights.items() if not name.startswith("lm_heads.")}
    has_bias = any(name.endswith(".bias") for name in weights)  # medusa_fc_bias, as the file has it
    return _heads_from(folder, weights, _count(data, "heads", folder),
                       _count(data, "layers", folder),
                       has_bias, target, shared, draft_vocab_size,
                       hidden_size=int(data.get("hidden_size", target.hidden_size)),
                       vocab_size=vocab_size)


def is_vllm_medusa_config(data: dict[str, Any]) -> bool:
    return data.get("model_type") == "medusa" or "MedusaModel" in (data.get("architectures") or ()) \
        or "medusa_num_heads" in data


def _count(data: dict[str, Any], what: str, folder: str) -> int:
    """num_heads / num_hidden_layers, under vLLM's name or FasterDecoding's (vLLM renames those);
    one block per head unless told (both layouts' default)."""
    names = ("num_heads", "medusa_num_heads") if what == "heads" else \
        ("num_hidden_layers", "medusa_num_layers")
    for name in names:
        if name in data:
            return int(data[name])
    if what == "heads":
        raise ValueError(f"{folder}/config.json gives no head count (num_heads or medusa_num_heads)")
    return 1


def _heads_from(folder: str, weights: dict[str, torch.Tensor], num_heads: int, num_layers: int,
                has_bias: bool, target: DecoderArch, shared_projection: bool,
                draft_vocab_size: int | None, hidden_size: int | None = None,
                vocab_size: int | None = None) -> MedusaHeads:
    """Heads from renamed published weights: the projection is the heads' own when the file has
    one, the target's LM head when it has none; the sizes are read from the tensors where the
    layout's config does not give them."""
    projections = [name for name in weights if name.startswith(("lm_heads.", "lm_head."))]
    if shared_projection and projections:
        vocab_projection = "shared"
    elif projections:
        vocab_projection = "per_head"
    else:
        vocab_projection, draft_vocab_size = "target", None
        weights.pop("draft_token_ids", None)
    if hidden_size is None:
        sample = weights.get("blocks.0.layers.0.weight", weights.get("lm_heads.0.weight"))
        hidden_size = target.hidden_size if sample is None else int(sample.shape[1])
    if vocab_size is None:
        sample = weights.get("lm_heads.0.weight")
        vocab_size = target.vocab_size if sample is None else int(sample.shape[0])
    config = MedusaConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads,
                          num_layers=num_layers, has_block_bias=has_bias,
                          vocab_projection=vocab_projection, draft_vocab_size=draft_vocab_size,
                          trained_for=f"published heads in {folder}")
    # NOTE: before the tensors are placed: a head for another model is refused by its sizes
    config.check_fits(target, folder)
    return MedusaHeads.from_weights(config, weights, folder)

