"""The embedded model's real tokenizer, read from its cache (built once if missing), for tests that
need real byte-level BPE text without loading the model."""

from __future__ import annotations

from typing import Any

from engine.models import loader


def load_embedded_tokenizer() -> Any:
    return loader.load_tokenizer(None)
