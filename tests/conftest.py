"""Shared fixtures: tiny random Llama-family checkpoints, built once per session."""

from __future__ import annotations

import os

import torch

# NOTE: Triton decorates its own library functions when it is first imported, and reads
# TRITON_INTERPRET then; transformers may import it during collection of any test module. The engine
# never launches Triton on the CPU, so interpreting for the whole session only affects kernel tests.
# On a GPU the engine does launch it, compiled (tests/cuda).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from tiny_chat_model import build_tiny_chat_checkpoint
from tiny_models import build_tiny_checkpoint

# `--quick`, the `slow` and `promise` markers, and the check that every promise stays quick;
# live servers and the embedded model shared by the session (server_pool, embedded_server,
# embedded_llm, embedded_reference); two xdist workers that share the cores politely
pytest_plugins = ["tiers", "shared_servers", "shared_models", "parallel_workers"]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory) -> str:
    """The tiny random Llama with the embedded model's tokenizer and chat template."""
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat_llama"))
