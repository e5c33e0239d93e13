"""The HTTP process's handle on the engine process: starts it, waits for its readiness message, sends
requests and aborts, routes each step's token deltas to the request they belong to, and notices when
the engine dies so every waiting request ends with an error instead of hanging.

NOTE: a background task of this client (the output router, the process watchdog) that ends with an
error counts as a dead engine: nothing would route outputs any more, so every request would hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import tempfile
from collections.abc import Callable

import zmq
import zmq.asyncio

from engine.engine_args import EngineArgs
from engine.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    RequestRejected,
    Shutdown,
    StepStats,
    decode,
    encode,
)
from engine.sampling_params import SamplingParams
from engine.step.types import RequestUpdate
from server.engine_launch import EngineLaunch, launch_engine

logger = logging.getLogger("specserve.server")

# how often the watchdog checks that the engine process is alive
WATCHDOG_SECONDS = 0.2
# how long shutdown() tries to hand the engine its Shutdown message before killing it instead
SHUTDOWN_SEND_SECONDS = 1.0


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing more will come from it."""


class EngineStartError(RuntimeError):
    """The engine process could not load what it was asked to (its message says why)."""


class RequestRejectedError(ValueError):
    """The engine refused a request (its message says why); the server answers 400."""


class RequestFailedError(RuntimeError):
    """The engine ended one request mid-generation with an error (its grammar, its drafts or its
    logits broke) and went on with the others; the server answers 500, or an error event."""


class EngineClient:
    def __init__(self, args: EngineArgs, on_stats: Callable[[StepStats], None] | None = None,
                 on_dead: Callable[[], None] | None = None,
                 launch: EngineLaunch | None = None) -> None:
        """`launch`: the engine process, if started already (server/engine_launch.py); start()
        starts it otherwise."""
        self.args = args
        self.on_stats = on_stats
        self.on_dead = on_dead
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        # set once the in-flight requests were failed and on_dead was called (_fail runs once)
        self._has_failed = False
        # set by shutdown(): tasks ending from then on are being stopped, not failing
        self._is_shutting_down = False
        self._queues: dict[str, asyncio.Queue[RequestUpdate | Exception]] = {}
        self._process: multiprocessing.process.BaseProcess | None = None
        self._tasks: list[asyncio.Task] = []
        # abort_soon's sends, referenced until done so they are not garbage-collected mid-flight
        self._pending_sends: set[asyncio.Task] = set()
        self._launch = launch
        self._socket_dir = tempfile.mkdtemp(prefix="specserve-ipc-") if launch is None \
            else launch.socket_dir
        self._context = zmq.asyncio.Context()
        self._to_engine = self._context.socket(zmq.PUSH)
        self._from_engine = self._context.socket(zmq.PULL)

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._process is not None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def start(self, timeout: float = 900.0) -> EngineReady:
        """Start the engine process (unless it was launched already) and wait until it has loaded
        the model and says so."""
        launch = self._launch = self._launch or launch_engine(self.args, self._socket_dir)
        self._to_engine.bind(launch.input_address)
        self._from_engine.bind(launch.output_address)
        self._process = launch.process
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if await self._from_engine.poll(500):
                message = decode(await self._from_engine.recv())
                if isinstance(message, EngineReady):
                    break
                if isinstance(message, EngineFailed):
                    raise EngineStartError(f"the engine failed to start: {message.message}")
            if not self._process.is_alive():
                raise EngineStartError(
                    f"the engine process exited with code {self._process.exitcode} while starting")
            if loop.time() > deadline:
                raise EngineStartError(f"the engine did not become ready within {timeout:.0f} s")
        self.ready = message
        self._tasks = [asyncio.create_task(self._route_outputs(), name="engine-output-router"),
                       asyncio.create_task(self._watch_process(), name="engine-watchdog")]
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)
        return message

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit; kill it if it does not."""
        self._is_shutting_down = True
        for task in self._tasks:
            task.cancel()
        if self._process is not None and self._process.is_alive():
            # NOTE: bounded: a PUSH socket with no peer (an engine that died, or failed to start,
            # before connecting) holds a send forever, which hung a failed start-up
            with contextlib.suppress(zmq.ZMQError, TimeoutError):
                await asyncio.wait_for(self._to_engine.send(encode(Shutdown())),
                                       SHUTDOWN_SEND_SECONDS)
            await asyncio.to_thread(self._process.join, timeout)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
        # NOTE: destroy, not term: term waits for every socket, and a start-up failure can leave one
        self._context.destroy(linger=0)
        with contextlib.suppress(OSError):
            for name in os.listdir(self._socket_dir):
                os.unlink(os.path.join(self._socket_dir, name))
            os.rmdir(self._socket_dir)

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, cache_salt: str | None = None,
                          ) -> asyncio.Queue[RequestUpdate | Exception]:
        """Queue of this request's deltas; it ends with a delta carrying finish_reason, or an
        exception (RequestRejectedError, RequestFailedError, EngineDeadError). Raises RequestRejectedError when the
        request cannot be encoded for the engine. `cache_salt` is the request's tenant (None: no
        tenant, shares nothing): only requests of one tenant share state that outlives a request."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        try:
            message = encode(AddRequest(request_id, list(prompt_token_ids), params, cache_salt))
        except (OverflowError, TypeError, ValueError) as error:  # e.g. an integer beyond 64 bits
            raise RequestRejectedError(f"the request cannot be sent to the engine: {error}") from None
        queue: asyncio.Queue[RequestUpdate | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        await self._to_engine.send(message)
        return queue

    async def abort(self, request_ids: list[str]) -> None:
        """Stop requests in the engine (their KV blocks are freed there); no more deltas arrive."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        if request_ids and self.is_alive:
            await self._to_engine.send(encode(AbortRequests(list(request_ids))))

    def abort_soon(self, request_ids: list[str]) -> None:
        """abort() from code that cannot await (cleanup of a cancelled stream)."""
        if request_ids:
            task = asyncio.get_running_loop().create_task(self.abort(request_ids))
            self._pending_sends.add(task)
            task.add_done_callback(self._pending_sends.discard)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ------------------------------------------------------------------ background tasks
    async def _route_outputs(self) -> None:
        while True:
            message = decode(await self._from_engine.recv())
            if isinstance(message, EngineOutputs):
                for delta in message.updates:
                    queue = self._queues.get(delta.request_id)
                    if queue is None:
                        continue  # aborted here already
                    if delta.finish_reason is not None:
                        del self._queues[delta.request_id]
                    if delta.error is None:
                        queue.put_nowait(delta)
                        continue
                    # NOTE: tokens it emitted before failing still reach the client, then the error
                    if delta.new_token_ids:
                        queue.put_nowait(dataclasses.replace(delta, finish_reason=None, error=None))
                    queue.put_nowait(RequestFailedError(delta.error))
                if message.stats is not None and self.on_stats is not None:
                    self.on_stats(message.stats)
            elif isinstance(message, RequestRejected):
                queue = self._queues.pop(message.request_id, None)
                if queue is not None:
                    queue.put_nowait(RequestRejectedError(message.message))
            elif isinstance(message, EngineFailed):
                self.dead_reason = f"the engine failed: {message.message}"
                logger.error(self.dead_reason)

    async def _watch_process(self) -> None:
        while self._process.is_alive() and self.dead_reason is None:
            await asyncio.sleep(WATCHDOG_SECONDS)
        self._fail(f"the engine process exited unexpectedly (exit code {self._process.exitcode})")

    def _on_task_done(self, task: asyncio.Task) -> None:
        """A background task that raised leaves nobody routing outputs: fail like a dead engine."""
        if task.cancelled() or self._is_shutting_down or task.exception() is None:
            return
        error = task.exception()
        logger.error("the engine client's %s task failed", task.get_name(),
                     exc_info=(type(error), error, error.__traceback__))
        self._fail(f"the server's {task.get_name()} failed: {type(error).__name__}: {error}")

    def _fail(self, reason: str) -> None:
        """The engine is dead to this server (keeps an earlier, more precise reason): fail every
        in-flight request, stop the engine process if it still runs, tell on_dead. Runs once."""
        self.dead_reason = self.dead_reason or reason
        if self._has_failed:
            return
        self._has_failed = True
        logger.error("%s; failing %d in-flight requests", self.dead_reason, len(self._queues))
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait(EngineDeadError(self.dead_reason))
        if self._process is not None and self._process.is_alive():
            # NOTE: nothing reads its outputs any more; shutdown() reaps it
            self._process.kill()
        if self.on_dead is not None:
            self.on_dead()
