"""The embedded model's real tokenizer, read from its converted cache (built once if missing), for
tests that need real byte-level BPE text without loading the model."""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers

from engine.models import loader


def load_embedded_tokenizer() -> Any:
    folder = loader.embedded_cache_dir(loader.embedded_gguf_path())
    if not os.path.isfile(os.path.join(folder, "config.json")):
        loader.load_checkpoint(None, torch.float32)  # converts the GGUF once (~25 s)
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
