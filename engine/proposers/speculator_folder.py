"""The folder a trained proposer lives in: a typed JSON config beside `model.safetensors`, written by
`specserve train-speculator` and read when `--speculative-config` names the folder."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

WEIGHTS_FILE = "model.safetensors"


def write_config(folder: str, file_name: str, kind: str, config: Any) -> None:
    """`config` (a dataclass) as JSON, tagged with the method it serves."""
    with open(os.path.join(folder, file_name), "w") as f:
        json.dump({"type": kind, **asdict(config)}, f, indent=2)


def read_config(folder: str, file_name: str, kind: str, what: str) -> dict[str, Any]:
    """The config's fields; a missing file or another method's config fails naming the folder."""
    path = os.path.join(folder, file_name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {file_name} in {folder}: not {what} folder (make one with "
                                f"`specserve train-speculator --method {kind}`)")
    with open(path) as f:
        data = json.load(f)
    if data.pop("type", None) != kind:
        raise ValueError(f"{path} does not describe an {kind}")
    return data
