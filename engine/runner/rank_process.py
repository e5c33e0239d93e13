"""One tensor-parallel rank other than 0, as its own process (engine/runner/ranks.py starts it):
it builds its Worker and runs rank 0's messages until told to stop, or until its parent is gone."""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time

from engine.config import CacheConfig, ModelConfig, ParallelConfig
from engine.runner.rank_messages import ExecutePass, KeepRows, StopRank

logger = logging.getLogger(__name__)

# seconds between checks that the parent process still lives
_PARENT_POLL_S = 1.0


def serve_rank(worker) -> None:
    """A rank other than 0: run rank 0's messages until it says stop (or is gone)."""
    group = worker.tp_group
    while True:
        message = group.receive()
        if isinstance(message, ExecutePass):
            worker.execute(message.forward)
        elif isinstance(message, KeepRows):
            worker.keep_rows(message.moves)
        elif isinstance(message, StopRank):
            return
        else:
            raise RuntimeError(f"rank {group.rank}: unknown message {type(message).__name__}")


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)  # NOTE: the engine (or node launcher) is gone; nobody will stop us
        time.sleep(_PARENT_POLL_S)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank (started by the engine)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--configs", required=True,
                        help="the model, cache and parallel configs as JSON")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s rank {options.rank} %(name)s: "
                               f"%(message)s")
    threading.Thread(target=_exit_with_parent, args=(options.parent_pid,), daemon=True).start()
    configs = json.loads(options.configs)
    from engine.runner.worker import Worker  # NOTE: torch and the model code load after the checks

    worker = Worker(ModelConfig(**configs["model"]), CacheConfig(**configs["cache"]),
                    ParallelConfig(**configs["parallel"]), rank=options.rank)
    try:
        serve_rank(worker)
    except RuntimeError as error:  # rank 0 left: its connection closed, or a collective timed out
        logger.error("leaving: %s", error)
        raise SystemExit(1) from None
    finally:
        worker.tp_group.close()


if __name__ == "__main__":
    main()
