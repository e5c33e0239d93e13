"""CUDA-only tests: the compiled Triton kernel and the engine on a GPU. They need a CUDA device, which
CI and the development machines lack, so there they are skipped with that reason; run them on a GPU with
`TRITON_INTERPRET=0 python -m pytest tests/cuda` (results recorded in docs/perf.md)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    def pytest_collection_modifyitems(items):
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "tests/cuda/" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def compiled_triton():
    """kernels.rejection_triton decorated for the GPU, not the interpreter the CPU tests use."""
    os.environ["TRITON_INTERPRET"] = "0"
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import rejection_triton
    if isinstance(rejection_triton._accept_kernel, InterpretedFunction):
        rejection_triton = importlib.reload(rejection_triton)
    assert not isinstance(rejection_triton._accept_kernel, InterpretedFunction)
    return rejection_triton
