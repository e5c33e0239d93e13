"""`specserve serve`: start the engine process, wait until it is ready, then serve HTTP until told to
stop (SIGTERM drains in-flight requests up to a timeout) or until the engine dies (exit code 1, so an
orchestrator restarts the server)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from engine.engine_args import EngineArgs
from engine.messages import StepStats
from engine.models.loader import load_tokenizer
from server.api_key import key_tenant
from server.app import ServerState, build_app
from server.body_limit import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT
from server.engine_client import EngineClient
from server.engine_launch import EngineLaunch
from server.http_protocol import DEFAULT_MAX_CONNECTIONS, limited_h11_protocol
from server.metrics import ServerMetrics
from server.openai_serving import OpenAIServing

logger = logging.getLogger("specserve.server")

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    # each key is its own tenant; empty: no key is asked for
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None
    # choices sent to the engine with no token yet; beyond this, new requests get 429
    max_waiting_requests: int = 256
    # seconds SIGTERM waits for in-flight requests before closing them
    drain_timeout: float = 30.0
    # larger request bodies get 413 before they are parsed
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # seconds a client has for its request headers, and again for its body (then 408)
    read_timeout: float = DEFAULT_READ_TIMEOUT
    # open connections beyond this get 503 and are closed
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    log_level: str = "info"
    # the tool-call convention (server/tools/conventions.py); None = the chat template's
    tool_call_parser: str | None = None
    # values for the sampling fields a request leaves out (server/sampling_defaults.py)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


def served_model_name(engine_args: EngineArgs, server_args: ServerArgs) -> str:
    if server_args.served_model_name:
        return server_args.served_model_name
    if engine_args.model is None:
        return EMBEDDED_MODEL_NAME
    return os.path.basename(os.path.normpath(engine_args.model)).removesuffix(".gguf")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but a stop signal first marks the state as draining (new requests: 503)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: uvicorn's own version re-raises the signal after serving, which kills the process
        # before the engine is shut down; a drained server exits normally (code 0) instead
        stop_signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in stop_signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.state.draining:
            logger.info("stop signal: draining in-flight requests (up to %.0f s)",
                        self.config.timeout_graceful_shutdown or 0)
        self.state.draining = True
        super().handle_exit(sig, frame)


@dataclass
class EngineCallbacks:
    """What the engine client's callbacks reach, each filled in once it exists: the metrics when
    the engine is ready, the HTTP server after them."""

    metrics: ServerMetrics | None = None
    server: DrainingServer | None = None

    def on_stats(self, stats: StepStats) -> None:
        if self.metrics is not None:
            self.metrics.observe_step(stats)

    def on_dead(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


async def serve(engine_args: EngineArgs, server_args: ServerArgs,
                launch: EngineLaunch | None = None) -> int:
    """Run until stopped; returns the process exit code. `launch`: the engine process, if started
    already (server/engine_launch.py)."""
    # NOTE: the engine keeps OpenMP's default wait policy (a short spin, then sleep) and one
    # thread per usable core (engine/cpu_threads.py). OMP_WAIT_POLICY=PASSIVE, set here before,
    # made every decode step ~27% slower (each of a step's ~1,000 parallel ops woke sleeping
    # threads), which was the whole gap between the server and the offline engine; it only pays
    # when another busy process shares the cores (docs/perf.md), and the variable is still obeyed.
    callbacks = EngineCallbacks()
    client = EngineClient(engine_args, on_stats=callbacks.on_stats, on_dead=callbacks.on_dead,
                          launch=launch)
    # NOTE: the tokenizer loads on a thread while the engine loads the model
    tokenizer_loaded = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, engine_args.model))
    try:
        ready = await client.start()
        name = served_model_name(engine_args, server_args)
        metrics = ServerMetrics(name, ready.speculative_method, ready.num_speculative_tokens)
        callbacks.metrics = metrics
        tokenizer = await tokenizer_loaded
        serving = OpenAIServing(client, tokenizer, name, metrics, server_args.max_waiting_requests,
                                server_args.tool_call_parser, server_args.sampling_defaults)
        state = ServerState(client, serving, metrics, server_args.api_keys,
                            max_body_bytes=server_args.max_body_bytes,
                            read_timeout=server_args.read_timeout)
        method = ready.speculative_method or "none"
        logger.info("engine ready: %s as %r, %s on %s, context %d, %d KV blocks of %d tokens; %s",
                    ready.model_name, name, ready.dtype, ready.device, ready.max_model_len,
                    ready.num_kv_blocks, ready.block_size, ready.memory)
        logger.info("speculation: %s%s", method,
                    f" (k = {ready.num_speculative_tokens})" if ready.speculative_method else "")
        if server_args.api_keys:  # NOTE: tenants by digest; a key itself is never logged
            logger.info("API keys: %d, each its own cache tenant (%s)", len(server_args.api_keys),
                        ", ".join(key_tenant(key) for key in server_args.api_keys))
        logger.info("serving the OpenAI API on http://%s:%d/v1", server_args.host, server_args.port)
        config = uvicorn.Config(build_app(state), host=server_args.host, port=server_args.port,
                                log_level=server_args.log_level, lifespan="off",
                                timeout_graceful_shutdown=server_args.drain_timeout,
                                http=limited_h11_protocol(server_args.read_timeout,
                                                          server_args.max_connections))
        server = DrainingServer(config, state)
        callbacks.server = server
        if not client.is_alive:
            return 1
        await server.serve()
        if client.dead_reason is not None:
            logger.error("exiting: %s", client.dead_reason)
            return 1
        return 0
    finally:
        if not tokenizer_loaded.done():  # NOTE: the engine failed first; its error is the one told
            tokenizer_loaded.cancel()
        elif not tokenizer_loaded.cancelled():
            tokenizer_loaded.exception()  # NOTE: marks a failure seen, if the engine's was raised
        await client.shutdown()
