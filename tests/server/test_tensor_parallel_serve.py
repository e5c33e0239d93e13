"""`specserve serve --tensor-parallel-size 2` on the CPU (gloo): the embedded model split over two
ranks gives one rank's greedy text with every proposer it can run; a rank killed mid-generation
ends every in-flight request with an error and the server; two "nodes" on 127.0.0.1 serve as one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import openai
import pytest
from engine_kill import kill_engine_under_load
from live_server import (
    LiveServer,
    assert_health_is_503,
    child_pids,
    engine_pid,
    launcher_exiting_late,
)
from openai_errors import assert_openai_error
from prometheus_server import find_free_port

from engine import LLM, SamplingParams

# two-rank servers: the full suite's
pytestmark = pytest.mark.slow

PROMPTS = ["The three primary colours are", "def fibonacci(n):\n    \"\"\"Return the n-th",
           "Translate to French: the cat sleeps on the red sofa. Answer:"]
MAX_TOKENS = 32
# generous: proves a request ends, not how fast (benchmarks/bench_tensor_parallel.py times it)
DEADLINE_S = 60.0


def rank_pids(engine: int) -> list[int]:
    """The tensor-parallel rank processes an engine process started."""
    return child_pids(engine, b"engine.runner.rank_process")


@pytest.fixture(scope="module")
def one_rank():
    """The embedded model on one rank, in this process (the default: packed weights): its outputs,
    with the top-2 logprobs of every token, and its tokenizer."""
    llm = LLM(None, num_threads=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params)], llm.tokenizer


def assert_same_text(texts: list[str], one_rank) -> None:
    """Equal to one rank's text; where not, the message gives one rank's top-2 logprob gap at the
    first token that differs (a near-tie flipped by the sums' rounding is a small gap; a bug is
    not)."""
    outputs, tokenizer = one_rank
    for text, output in zip(texts, outputs):
        if text == output.text:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        at = next((i for i, (a, b) in enumerate(zip(ids, output.token_ids)) if a != b),
                  min(len(ids), len(output.token_ids)))
        gap = None
        if at < len(output.logprobs):
            top = output.logprobs[at].top
            gap = top[0][1] - top[1][1] if len(top) > 1 else None
        raise AssertionError(f"2 ranks: {text!r}\n1 rank:  {output.text!r}\nfirst differing "
                             f"token {at}; one rank's top-2 logprob gap there: {gap}")


def completions(server: LiveServer, speculate: bool = True) -> list[str]:
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    extra = {"ignore_eos": True}
    if not speculate:
        extra["speculative_decoding"] = {"enabled": False}
    return [client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body=extra).choices[0].text
            for prompt in PROMPTS]


def test_embedded_model_on_two_ranks_gives_one_ranks_text(one_rank):
    """The serve default (adaptive suffix decoding, drafting on rank 0) and requests that turn
    speculation off; n-gram, trees and the model drafters at two ranks: tests/engine/
    test_tensor_parallel.py, on tiny models."""
    with LiveServer(["--tensor-parallel-size", "2", "--max-model-len", "512",
                     "--kv-cache-memory-gib", "0.1"]) as server:
        assert "tensor-parallel rank 1 of 2" in server.output()
        assert_same_text(completions(server), one_rank)
        assert_same_text(completions(server, speculate=False), one_rank)


def test_a_rank_killed_mid_generation_fails_every_request_and_the_server(tiny_chat_llama):
    with LiveServer(["--model", tiny_chat_llama, "--dtype", "float32", "--max-model-len", "512",
                     "-tp", "2", "--distributed-timeout", "30"],
                    launcher=launcher_exiting_late(6.0)) as server:
        ranks = rank_pids(engine_pid(server.process.pid))
        assert len(ranks) == 1
        ends = asyncio.run(kill_engine_under_load(server.api, ranks[0], num_streams=2,
                                                  num_plain=2, max_tokens=480,
                                                  deadline_s=DEADLINE_S)).ends
        assert all(end.seconds_to_end is not None for end in ends), "a request outlived the deadline"
        for end in ends:
            assert end.transport_error is None, end
            error = assert_openai_error({"error": end.error})
            assert error["type"] == "ServiceUnavailableError", error
        assert_health_is_503(server.url)
        assert server.process.wait(DEADLINE_S) == 1
        assert "engine failed" in server.output()


def test_a_hung_rank_fails_the_engine_after_the_distributed_timeout(tiny_chat_llama):
    """SIGSTOP leaves the rank's connections open: only the collective's timeout notices."""
    with LiveServer(["--model", tiny_chat_llama, "--dtype", "float32", "--max-model-len", "512",
                     "-tp", "2", "--distributed-timeout", "3"],
                    launcher=launcher_exiting_late(6.0)) as server:
        rank = rank_pids(engine_pid(server.process.pid))[0]
        try:
            os.kill(rank, 19)  # SIGSTOP
            client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0,
                                   timeout=DEADLINE_S)
            model = client.models.list().data[0].id
            with pytest.raises(openai.APIStatusError) as raised:
                client.completions.create(model=model, prompt="Hello", max_tokens=8)
            assert raised.value.status_code == 503
            assert server.process.wait(DEADLINE_S) == 1
        finally:
            try:
                os.kill(rank, 9)
            except ProcessLookupError:
                pass


def test_two_nodes_on_loopback_serve_as_one(tiny_chat_llama):
    """Node 1 runs rank 1 alone (no HTTP); node 0 serves. Greedy text equals one rank's, and
    node 1 leaves cleanly when the server stops."""
    common = ["--model", tiny_chat_llama, "--dtype", "float32", "--max-model-len", "512"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.outputs[0].text for o in LLM(tiny_chat_llama, dtype="float32", max_model_len=512,
                                          num_threads=1).generate(PROMPTS, params)]
    port = str(find_free_port())
    nodes = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    node1 = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", *common, *nodes,
                              "--node-rank", "1", "--num-threads", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with LiveServer([*common, *nodes, "--node-rank", "0"]) as server:
            assert completions(server) == want
        assert node1.wait(DEADLINE_S) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
        output = node1.communicate()[0]
    assert "tensor-parallel rank 1 of 2" in output
