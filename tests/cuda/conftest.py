"""CUDA-only tests: the compiled Triton kernel and the engine on a GPU. They need a CUDA device, which
CI and the development machines lack, so there they are skipped with that reason; run them on a GPU with
`TRITON_INTERPRET=0 python -m pytest tests/cuda` (results recorded in docs/perf.md)."""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    def pytest_collection_modifyitems(items):
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "tests/cuda/" in str(item.fspath):
                item.add_marker(skip)


# specserve's Triton kernel modules (kernels/)
KERNEL_MODULES = ("rejection_triton", "tree_rejection_triton", "paged_attention_triton",
                  "fused_ops_triton", "batch_invariant_matmul")


@pytest.fixture(scope="session")
def gpu_kernels() -> SimpleNamespace:
    """Every kernel module decorated for the GPU, not the interpreter the CPU tests use: one
    imported under TRITON_INTERPRET=1 earlier in this process is decorated again."""
    os.environ["TRITON_INTERPRET"] = "0"
    from triton.runtime.interpreter import InterpretedFunction

    def interpreted(module) -> bool:
        return any(isinstance(value, InterpretedFunction) for value in vars(module).values())

    modules = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"kernels.{name}")
        if interpreted(module):
            module = importlib.reload(module)
        assert not interpreted(module), name
        modules[name] = module
    return SimpleNamespace(**modules)


@pytest.fixture(scope="session")
def compiled_triton(gpu_kernels):
    """kernels.rejection_triton decorated for the GPU."""
    return gpu_kernels.rejection_triton
