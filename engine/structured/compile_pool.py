"""Grammar compiles off the engine loop: a request with a `response_format` waits here while a
worker thread compiles its grammar (0.1 ms to ~1 s), and the loop keeps stepping the others.

llguidance releases the GIL while it compiles (measured: a 0.85 s compile left the main thread's
longest pause at 16 ms), so a slow schema costs the other requests' steps nothing but a core.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from engine.structured.compiler import CompiledGrammar, GrammarCompiler

Payload = TypeVar("Payload")

# compiles at once; the engine loop keeps one core, the grammar library takes the rest
DEFAULT_COMPILE_THREADS = 2


class GrammarCompilePool(Generic[Payload]):
    """`submit(request_id, key, payload)`, then `take_finished()` from the loop: each payload with
    its compiled grammar, or the exception its compile raised. Cancelled requests never come back.
    Only the loop thread calls these methods."""

    def __init__(self, compiler: Callable[[], GrammarCompiler],
                 num_threads: int = DEFAULT_COMPILE_THREADS) -> None:
        """compiler: returns the engine's GrammarCompiler (built on first call, on a worker)."""
        self._compiler = compiler
        self._compiler_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar-compile")
        self._pending: dict[str, tuple[Payload, Future[CompiledGrammar]]] = {}

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def submit(self, request_id: str, response_format_key: str, payload: Payload) -> None:
        self._pending[request_id] = (payload, self._executor.submit(self._compile,
                                                                   response_format_key))

    def cancel(self, request_ids: Iterable[str]) -> None:
        """Forget these requests (aborted while compiling); a compile already running finishes
        into the compiler's cache."""
        for request_id in request_ids:
            entry = self._pending.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()

    def take_finished(self) -> list[tuple[Payload, CompiledGrammar | Exception]]:
        """The requests whose compile ended since the last call, in submission order."""
        finished = []
        for request_id, (payload, future) in list(self._pending.items()):
            if future.done():
                del self._pending[request_id]
                error = future.exception()
                finished.append((payload, future.result() if error is None else error))
        return finished

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, response_format_key: str) -> CompiledGrammar:
        with self._compiler_lock:  # NOTE: the first call builds the compiler; only once
            compiler = self._compiler()
        return compiler.compile_key(response_format_key)
