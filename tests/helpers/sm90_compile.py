"""Compiling Triton kernels for a real GPU (sm_90) without one, in a fresh process where the
interpreter flag is off.

Triton's cache lives in one folder per machine (SPECSERVE_TEST_TRITON_CACHE moves it) instead of a
fresh one per module and run: its keys hold the kernel's source, the options, the target and
Triton's version, so a hit is this very kernel compiled before, and each kernel is compiled once
per machine, not once per run. The scripts read the PTX from the compiled kernel either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def triton_cache_dir() -> str:
    default = Path.home() / ".cache" / "specserve" / "tests-triton-sm90"
    return os.environ.get("SPECSERVE_TEST_TRITON_CACHE", str(default))


def run_compile_script(script: str, timeout: float = 600, **env_updates: str) -> dict:
    """The JSON object `script` prints last, run with the interpreter off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=triton_cache_dir(), **env_updates)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
