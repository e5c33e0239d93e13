"""The engine process's entry point, importable without the engine itself (torch, the model code):
the server pickles a reference to it when it starts the process, and does so before its own heavy
imports, so the two processes load side by side (server/engine_launch.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.engine_args import EngineArgs


def run_engine_process(args: EngineArgs, input_address: str, output_address: str,
                       parent_pid: int) -> None:
    """multiprocessing target: engine/engine_process.py's loop, imported in the new process."""
    from engine.engine_process import run_engine_process as run

    run(args, input_address, output_address, parent_pid)
