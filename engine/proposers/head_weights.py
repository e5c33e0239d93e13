"""A published speculator folder's config.json and weights, as their authors ship them."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file

# what published heads ship, in the order looked for
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def read_json_config(folder: str) -> dict[str, Any] | None:
    """config.json of the folder, or None when there is none."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_weights(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight file, on the CPU; `.bin` files are read with
    weights_only, so a pickled checkpoint can carry tensors and nothing that runs."""
    for name in WEIGHT_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            if name.endswith(".safetensors"):
                return load_file(path)
            return torch.load(path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights in {folder}: expected one of {', '.join(WEIGHT_FILES)}")
