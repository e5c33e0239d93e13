"""The tensor-parallel rank processes: started, joined, served and stopped.

Rank 0 is the engine process (it owns the scheduler, the sampler and the drafters); the other ranks
of its node are processes it starts (engine/runner/rank_process.py), and a node with
`--node-rank 1..` starts its own ranks the same way (`specserve serve --node-rank N`, no server).
Every rank runs the same Worker on its shard; ranks other than 0 wait for rank 0's messages and
answer each with their part of the pass:

    ExecutePass(ForwardInput)   run the target pass (the collectives inside meet rank 0's)
    KeepRows([KeptRows, ...])   a tree's accepted path moves its K/V (engine/runner/worker.py)
    StopRank()                  leave

(engine/runner/rank_messages.py).

A rank whose parent process is gone, or whose rank 0 is gone (the control group's connection
closes), exits.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

from engine.config import CacheConfig, ModelConfig, ParallelConfig
from engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)

def start_rank_processes(model_config: ModelConfig, cache_config: CacheConfig,
                         parallel: ParallelConfig, ranks: range) -> list[subprocess.Popen]:
    """Start one process per rank of `ranks` on this machine, each joining rank 0 at
    parallel.master_addr:master_port."""
    settings = json.dumps({"model": asdict(model_config), "cache": asdict(cache_config),
                           "parallel": asdict(parallel)})
    processes = []
    for rank in ranks:
        command = [sys.executable, "-m", "engine.runner.rank_process",
                   "--rank", str(rank),
                   "--parent-pid", str(os.getpid()), "--configs", settings]
        processes.append(subprocess.Popen(command))
        logger.info("tensor-parallel rank %d: pid %d", rank, processes[-1].pid)
    return processes


def run_node(args: EngineArgs) -> int:
    """A node other than 0 (`specserve serve --node-rank N`): run its ranks until they leave; the
    exit code is the first failing rank's (SIGTERM / Ctrl-C stops them)."""
    model_config, cache_config, _, _ = args.configs()
    parallel = args.parallel_config()
    processes = start_rank_processes(model_config, cache_config, parallel, parallel.local_ranks)
    logger.info("node %d of %d: ranks %s joining %s:%s", parallel.node_rank, parallel.nnodes,
                list(parallel.local_ranks), parallel.master_addr, parallel.master_port)
    signal.signal(signal.SIGTERM, lambda *_: _terminate(processes))
    try:
        while True:
            codes = [process.poll() for process in processes]
            failed = [code for code in codes if code]
            if failed or all(code is not None for code in codes):
                _terminate(processes)
                return failed[0] if failed else 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _terminate(processes)
        return 130


def _terminate(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    stop_rank_processes(processes)


def stop_rank_processes(processes: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Wait for the ranks to leave after a stop message; end the ones that do not."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
