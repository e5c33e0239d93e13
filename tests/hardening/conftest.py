"""Fixtures of the hardening tests: a tiny random model that also has a real tokenizer and chat
template, so text prompts and chat requests reach the engine in milliseconds."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from tiny_models import build_tiny_checkpoint

from engine.models import loader

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory) -> str:
    """The tiny random Llama with the embedded model's tokenizer (vocabulary 49152)."""
    embedded = loader.embedded_cache_dir(loader.embedded_gguf_path())
    if not os.path.isfile(os.path.join(embedded, "config.json")):
        loader.load_checkpoint(None, torch.float32)  # converts the GGUF once (~25 s)
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_chat_llama"), "llama",
                                 vocab_size=49152, eos_token_id=2, bos_token_id=1)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(embedded, name)):
            shutil.copy(os.path.join(embedded, name), path)
    return path
