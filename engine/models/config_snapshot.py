"""A model's Hugging Face config as plain values, kept in its GGUF's metadata cache folder, so a warm
engine process builds the model without importing transformers.

Importing transformers and the chain LlamaConfig's module pulls in (torch.distributed.tensor, sympy)
took ~3 s of a ~9 s warm start on 2 cores, for a handful of numbers the engine reads by attribute
(engine/models/arch.py, gguf_checkpoint.py). The snapshot is the config's full `to_dict()` (every
attribute, defaults included), written beside the converted config.json the first time a process
reads that; the folder's name already digests the file's header and transformers' version
(gguf_cache.py), so the snapshot can only be stale if specserve changes what it writes (FORMAT).

A config whose rope type is not the default (for any layer type, where the config keeps one set of
rope parameters per type, as Gemma 3's does) is not snapshotted: its frequencies come from
transformers' own functions, which expect the real config object.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

from engine.disk_cache import write_atomically

SNAPSHOT_NAME = "specserve-config.json"
FORMAT = 1


class ConfigSnapshot(SimpleNamespace):
    """The config's attributes; `to_dict()` as on the transformers config it was taken from."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def can_snapshot(hf_config: Any) -> bool:
    """Only configs whose every use in the engine is an attribute read: default rope, as
    engine/models/arch.py reads the rope type (rope_scaling is rope_parameters' old name), in
    the parameters of every layer type too where there are several (Gemma 3's
    {"full_attention": {...}, "sliding_attention": {...}})."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    per_layer_type = [value for value in params.values() if isinstance(value, dict)]
    rope_types = [params.get("rope_type") or legacy.get("rope_type") or legacy.get("type")]
    rope_types += [value.get("rope_type") for value in per_layer_type]
    return all((rope_type or "default") == "default" for rope_type in rope_types)


def write_snapshot(folder: str, hf_config: Any) -> None:
    """Save `hf_config` into `folder` (raises OSError where it cannot be written)."""
    write_atomically(os.path.join(folder, SNAPSHOT_NAME), json.dumps(
        {"format": FORMAT, "config": hf_config.to_dict()}, indent=1, sort_keys=True).encode())


def read_snapshot(folder: str) -> ConfigSnapshot | None:
    """The snapshot in `folder`, or None (none yet, another format, or unreadable)."""
    try:
        with open(os.path.join(folder, SNAPSHOT_NAME), encoding="utf-8") as file:
            saved = json.load(file)
        if saved.get("format") != FORMAT or not isinstance(saved.get("config"), dict):
            return None
        config = saved["config"]
        if isinstance(config.get("id2label"), dict):  # NOTE: JSON keys are strings; the config's ints
            config["id2label"] = {int(key): label for key, label in config["id2label"].items()}
        return ConfigSnapshot(**config)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
