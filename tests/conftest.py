"""Shared fixtures: tiny random Llama-family checkpoints, built once per session."""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")
