"""The engine loop process: owns the EngineCore, takes requests from the server over ZeroMQ, steps
while there is work, and sends each step's token deltas and stats back. It never speaks HTTP.

It exits when told to (Shutdown), when its parent server dies (it would otherwise hold the model and
the port's clients forever), or on an error, after telling the server why (EngineFailed).
"""

from __future__ import annotations

import logging
import os
import traceback

import zmq

from engine.core import EngineCore
from engine.engine_args import EngineArgs
from engine.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    RequestRejected,
    Shutdown,
    decode,
    encode,
)
from engine.structured.compile_pool import GrammarCompilePool
from engine.structured.compiler import CompiledGrammar

logger = logging.getLogger("specserve.engine")

# how long an idle engine waits for a message before checking that its parent is still alive
IDLE_POLL_MS = 200
# how long a failing engine waits for the server to take its EngineFailed: the server may still be
# importing (it starts the engine first, server/engine_launch.py) and bind its socket after
FAILURE_LINGER_MS = 10_000
# how often an engine with nothing to step but a grammar compiling looks for the compile's end
COMPILE_POLL_MS = 2


def run_engine_process(args: EngineArgs, input_address: str, output_address: str,
                       parent_pid: int) -> None:
    """Entry point of the engine process (multiprocessing target)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("engine process: loading the model")
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(output_address)
    core = None
    linger_ms = 1000
    try:
        core = EngineCore(*args.configs(), parallel_config=args.parallel_config())
        outbox.send(encode(_ready_message(core)))
        EngineLoop(core, inbox, outbox, parent_pid).run()
    except BaseException as error:  # the server must learn why, whatever it was
        message = f"{type(error).__name__}: {error}"
        logger.error("engine failed: %s\n%s", message, traceback.format_exc())
        outbox.send(encode(EngineFailed(message)))
        linger_ms = FAILURE_LINGER_MS
        raise SystemExit(1) from error
    finally:
        if core is not None:
            core.close()
        outbox.close(linger=linger_ms)
        inbox.close(linger=0)
        context.term()


def _ready_message(core: EngineCore) -> EngineReady:
    worker, spec = core.worker, core.speculative_config
    return EngineReady(
        model_name=worker.source, max_model_len=worker.kv_spec.max_model_len,
        vocab_size=worker.arch.vocab_size, dtype=str(worker.dtype).removeprefix("torch."),
        device=str(worker.device), num_kv_blocks=worker.kv_spec.num_blocks,
        block_size=worker.kv_spec.block_size,
        speculative_method=None if spec is None else spec.method,
        num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
        memory=worker.memory.describe())


class EngineLoop:
    def __init__(self, core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket,
                 parent_pid: int) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        # AddRequests whose response_format grammar compiles on a thread, off this loop
        self.grammars: GrammarCompilePool[AddRequest] = GrammarCompilePool(core.grammar_compiler)

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.grammars.shutdown()

    def _run(self) -> None:
        while True:
            if os.getppid() != self.parent_pid:
                logger.warning("the server process is gone; the engine exits")
                return
            # NOTE: never block while requests are running; an idle engine sleeps in poll()
            timeout = 0 if self.core.has_unfinished else (
                COMPILE_POLL_MS if self.grammars.has_pending else IDLE_POLL_MS)
            while self.inbox.poll(timeout):
                if not self._handle(decode(self.inbox.recv())):
                    return
                timeout = 0
            for message, grammar in self.grammars.take_finished():
                self._add(message, grammar)
            if self.core.has_unfinished:
                result = self.core.step()
                self._send(EngineOutputs(result.updates,
                                         result.stats or self.core.gauge_snapshot()))

    def _handle(self, message: object) -> bool:
        """Apply one message from the server; False means shut down."""
        if isinstance(message, AddRequest):
            response_format = message.params.response_format
            if isinstance(response_format, str):  # NOTE: compiled off this loop, added when done
                self.grammars.submit(message.request_id, response_format, message)
            else:
                self._add(message)
        elif isinstance(message, AbortRequests):
            self.grammars.cancel(message.request_ids)
            updates = self.core.abort(message.request_ids)
            if updates:
                self._send(EngineOutputs(updates, self.core.gauge_snapshot()))
        elif isinstance(message, Shutdown):
            return False
        else:
            raise TypeError(f"unexpected message {type(message).__name__}")
        return True

    def _add(self, message: AddRequest, grammar: CompiledGrammar | Exception | None = None) -> None:
        """Into the scheduler; a request the engine cannot run (bad values, a grammar that did
        not compile) is refused alone."""
        if isinstance(grammar, Exception):  # whatever the library raised: this request's alone
            self._send(RequestRejected(message.request_id, str(grammar)))
            return
        try:
            self.core.add_request(message.request_id, message.prompt_token_ids,
                                  message.params, message.cache_salt,
                                  grammar=grammar)
        except (ValueError, TypeError) as error:
            self._send(RequestRejected(message.request_id, str(error)))

    def _send(self, message: object) -> None:
        self.outbox.send(encode(message))



