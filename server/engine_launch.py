"""Starting the engine process, apart from the engine client (which imports the engine's messages,
and so torch): `specserve serve` starts the engine right after reading its flags, then imports the
HTTP side (FastAPI, the tokenizer) while the engine loads the model."""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
from dataclasses import dataclass

from engine.engine_args import EngineArgs
from engine.process_main import run_engine_process

logger = logging.getLogger("specserve.server")


@dataclass(frozen=True)
class EngineLaunch:
    """A started engine process and the two IPC addresses it connects to (the client binds them)."""

    process: multiprocessing.process.BaseProcess
    socket_dir: str
    input_address: str
    output_address: str


def launch_engine(args: EngineArgs, socket_dir: str | None = None) -> EngineLaunch:
    """Start the engine process; it connects to `socket_dir`'s addresses (a new folder if None).
    ZeroMQ queues its messages until the client binds there, so binding may come later."""
    socket_dir = socket_dir or tempfile.mkdtemp(prefix="specserve-ipc-")
    input_address, output_address = f"ipc://{socket_dir}/input", f"ipc://{socket_dir}/output"
    # NOTE: spawn, not fork: the child must not inherit the event loop or its sockets
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_process, name="specserve-engine", daemon=True,
        args=(args, input_address, output_address, os.getpid()))
    process.start()
    logger.info("engine process %d started: it loads %s while this process starts the HTTP side",
                process.pid, args.model or "the embedded model")
    return EngineLaunch(process, socket_dir, input_address, output_address)
