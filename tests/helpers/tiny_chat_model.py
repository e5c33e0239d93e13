"""A tiny random Llama that also carries a real tokenizer and chat template (the embedded model's),
so text prompts, chat requests and streamed text reach the engine and come back in milliseconds."""

from __future__ import annotations

import os
import shutil

from tiny_models import build_tiny_checkpoint

from engine.models import loader

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# the embedded SmolLM2 tokenizer's vocabulary and its special tokens
VOCAB_SIZE = 49152
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2


def build_tiny_chat_checkpoint(path, **overrides) -> str:
    """Save the tiny random Llama with the embedded tokenizer's files beside it; `overrides` change
    its config as build_tiny_checkpoint's do (e.g. a longer max_position_embeddings)."""
    embedded = loader.prepare_embedded_cache()  # its tokenizer files, converted once
    path = build_tiny_checkpoint(path, "llama", vocab_size=VOCAB_SIZE, bos_token_id=BOS_TOKEN_ID,
                                 eos_token_id=EOS_TOKEN_ID, **overrides)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(embedded, name)):
            shutil.copy(os.path.join(embedded, name), path)
    return path
