"""Fixtures of the hardening tests."""

from __future__ import annotations

import pytest
from tiny_chat_model import build_tiny_chat_checkpoint


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory) -> str:
    """The tiny random Llama with the embedded model's tokenizer and chat template."""
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat_llama"))
