"""The servers the benchmarks time over HTTP: a server process on a loopback port, and one greedy
streamed request on specserve (OpenAI completions) or llama.cpp (its native /completion), timed
to the first token and to the end, with the text (and llama.cpp's token ids) it returned."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass

import httpx


@dataclass
class Timing:
    seconds: float
    first_token_seconds: float
    num_tokens: int
    text: str = ""
    token_ids: list[int] | None = None  # only where the server returns them (llama.cpp)
    others_cores: float = 0.0  # cores the rest of the machine used meanwhile (cpu_share.py)

    @property
    def e2e_tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.num_tokens - 1) / max(1e-9, self.seconds - self.first_token_seconds)


class Server:
    """A server process on a free loopback port, and how to time one greedy request on it."""

    def __init__(self, label: str, command: list[str], port: int, env: dict | None = None,
                 weights: str = "", spec: str = "") -> None:
        self.label, self.port = label, port
        self.weights, self.spec = weights, spec  # "Q4_1"/"F32"/"packed"/"float32"; spec name
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{label.replace(' ', '-')}-",
                                               suffix=".log")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.label} exited:\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.label} did not become healthy")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


class SpecserveServer(Server):
    def time_request(self, prompt: list[int], max_tokens: int, **extra) -> Timing:
        # NOTE: a fresh cache_salt unless given: no request reuses an earlier one's prompt K/V or
        # drafts from its output (llama.cpp gets cache_prompt false)
        body = {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                "temperature": 0, "stream": True, "cache_salt": uuid.uuid4().hex, **extra}
        return _time_stream(f"{self.url}/v1/completions", body,
                            lambda chunk: chunk["choices"][0]["text"] if chunk.get("choices")
                            else "", lambda chunk: None, lambda chunk: None, max_tokens)


class LlamaCppServer(Server):
    def time_request(self, prompt: list[int], max_tokens: int) -> Timing:
        # NOTE: llama.cpp's ignore_eos masks EOS, as min_tokens does for specserve: same lengths
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": False, "stream": True, "return_tokens": True}
        return _time_stream(f"{self.url}/completion", body,
                            lambda chunk: chunk.get("content") or "",
                            lambda chunk: chunk.get("tokens"),
                            lambda chunk: chunk.get("stop") and chunk.get("tokens_predicted"),
                            max_tokens)


def _time_stream(url: str, body: dict, chunk_text, chunk_tokens, final_count,
                 max_tokens: int) -> Timing:
    start = time.perf_counter()
    first = None
    count = max_tokens
    texts: list[str] = []
    token_ids: list[int] | None = None
    with httpx.stream("POST", url, json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            text = chunk_text(chunk)
            if first is None and text:
                first = time.perf_counter() - start
            texts.append(text)
            if (ids := chunk_tokens(chunk)) is not None:
                token_ids = (token_ids or []) + list(ids)
            count = final_count(chunk) or count
    seconds = time.perf_counter() - start
    return Timing(seconds, first if first is not None else seconds, count, "".join(texts),
                  token_ids)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
