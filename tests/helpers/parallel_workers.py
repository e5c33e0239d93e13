"""The suite runs on two pytest-xdist workers (pyproject.toml's addopts: `-n 2 --dist loadfile`,
each test file whole on one worker, so module fixtures are built once); `-n 0` runs it in one
process.

Two workers on two cores share them with each other's torch threads, and with the live servers
the tests start: OpenMP's default wait policy spins in a parallel region's barrier, and a thread
spinning on a core another process needs made one 6-token pass 47x slower here (TOOLCHAIN.md).
The workers and every server they start therefore wait passively (threads sleep at a barrier),
which costs a quiet machine a little per op and a shared one nothing like the spin.
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # NOTE: the controller starts the workers after configure, so they inherit this; a worker's
    # own torch is loaded after it, when its conftest is imported
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
