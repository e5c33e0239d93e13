"""The folder a proposer lives in: either specserve's own (a typed JSON config beside
`model.safetensors`, written by `specserve train-speculator`) or one published for the target (a
`config.json` beside the authors' weights), read when `--speculative-config` names the folder."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.models.arch import DecoderArch

WEIGHTS_FILE = "model.safetensors"
PUBLISHED_CONFIG_FILE = "config.json"

# what a published config.json says it is, for each method that reads published folders
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
MLP_SPECULATOR_ARCHITECTURES = ("MLPSpeculatorPreTrainedModel",)


def write_config(folder: str, file_name: str, kind: str, config: Any) -> None:
    """`config` (a dataclass) as JSON, tagged with the method it serves."""
    with open(os.path.join(folder, file_name), "w") as f:
        json.dump({"type": kind, **asdict(config)}, f, indent=2)


def read_config(folder: str, file_name: str, kind: str, what: str) -> dict[str, Any]:
    """The config's fields; a missing file or another method's config fails naming the folder."""
    path = os.path.join(folder, file_name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {file_name} in {folder}: not {what} folder (make one with "
                                f"`specserve train-speculator --method {kind}`, or use one "
                                f"published for the target, with its {PUBLISHED_CONFIG_FILE})")
    with open(path) as f:
        data = json.load(f)
    if data.pop("type", None) != kind:
        raise ValueError(f"{path} does not describe an {kind}")
    return data


def check_made_for(target: DecoderArch, what: str, folder: str, hidden_size: int,
                   vocab_size: int) -> None:
    """A proposer reads the target's hidden states and scores its vocabulary: one made for another
    model fails at start-up, saying what it was made for. `what`: "the EAGLE head was", say."""
    if (hidden_size, vocab_size) != (target.hidden_size, target.vocab_size):
        subject, verb = what.rsplit(" ", 1)
        raise ValueError(f"{subject} in {folder} {verb} made for hidden size {hidden_size} and "
                         f"vocabulary {vocab_size}; the target has {target.hidden_size} and "
                         f"{target.vocab_size}")


def is_published(folder: str, own_config_file: str) -> bool:
    """A folder without specserve's own config but with a config.json: one published for the
    target (specserve's own folders always load as they were written)."""
    return (not os.path.isfile(os.path.join(folder, own_config_file))
            and os.path.isfile(os.path.join(folder, PUBLISHED_CONFIG_FILE)))


def published_method(config: dict[str, Any]) -> str:
    """The speculative method a published config.json serves. EAGLE-1 heads ship their base
    model's own Llama config (one layer), so "eagle" is whatever is not recognisably another."""
    architectures = set(config.get("architectures") or ())
    if config.get("speculators_model_type") is not None:
        return str(config["speculators_model_type"])
    if architectures & set(EAGLE3_ARCHITECTURES):
        return "eagle3"
    if config.get("model_type") == "mlp_speculator" or \
            architectures & set(MLP_SPECULATOR_ARCHITECTURES):
        return "mlp_speculator"
    if config.get("model_type") == "medusa" or "medusa_num_heads" in config:
        return "medusa"  # vLLM's layout, or FasterDecoding's
    return "eagle"


def check_published_method(folder: str, config: dict[str, Any], method: str) -> None:
    """A published folder named under the wrong method fails saying which method it is for."""
    found = published_method(config)
    if found != method:
        raise ValueError(f"{folder} holds a published {found!r} speculator, not {method!r}: set "
                         f'"method": "{found}" in the speculative config')
