"""The embedded model loaded once per pytest session, for the modules that only read it: the
engine as served by default (packed weights, no speculation) and transformers' float32 reference
on the same dequantized weights."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def embedded_llm():
    """LLM(None) with no speculation and a roomy KV cache (no preemption); prefix caching on, as
    served, which changes no token. Tests must not change its settings."""
    from engine import LLM

    llm = LLM(None, num_threads=2, max_model_len=1024)
    assert llm.engine.worker.memory.packed_weight_bytes > 90e6  # the default: packed Q4_1 / Q8_0
    return llm


@pytest.fixture(scope="session")
def embedded_reference():
    """The embedded model in transformers, float32, exactly the GGUF's dequantized weights
    (tests/engine/test_gguf_checkpoint.py)."""
    from engine.models.reference_model import load_transformers_model

    return load_transformers_model(None, torch.float32)
