"""specserve beside llama.cpp's llama-server on the same weights, over HTTP, in one run.

Both servers get the workloads' chat prompts as the same token ids, greedy, a fixed number of output
tokens, requests interleaved configuration by configuration; the table gives end-to-end tokens/s
(prompt processing included) and decode tokens/s (after the first token), medians over repeats, and
each configuration's ratio to llama.cpp F32 without speculation.

Run: python -m benchmarks.bench_llamacpp --llama-server PATH/llama-server [--max-tokens 128]
     [--repeats 3] [--threads 2] [--configs none suffix ngram]
Without --llama-server (or when the binary is missing) only specserve is measured, with a message.
The F32 GGUF llama.cpp serves is made once from the embedded Q4_1 file with llama-quantize (next to
llama-server), so both run exactly the dequantized weights. ../shared/TOOLCHAIN.md: how to build it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.common import cpu_name
from engine.models.loader import embedded_gguf_path, load_tokenizer
from loadtest.workloads import chat_prompts

# specserve speculative configs by name; "none" turns speculation off
SPECSERVE_CONFIGS = {
    "none": "none",
    "ngram": json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 4}),
    "suffix": json.dumps({"method": "suffix", "num_speculative_tokens": 8}),
    "suffix-adaptive": json.dumps({"method": "suffix", "num_speculative_tokens": 8,
                                   "adaptive": True}),
}
# llama.cpp's n-gram speculation at its best here (TOOLCHAIN.md)
LLAMACPP_NGRAM = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                  "--spec-ngram-simple-size-m", "8"]


@dataclass
class Timing:
    seconds: float
    first_token_seconds: float
    num_tokens: int

    @property
    def e2e_tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.num_tokens - 1) / max(1e-9, self.seconds - self.first_token_seconds)


class Server:
    """A server process on a free loopback port, and how to time one greedy request on it."""

    def __init__(self, label: str, command: list[str], port: int, env: dict | None = None) -> None:
        self.label, self.port = label, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{label}-", suffix=".log")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 300.0) -> None:
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
        body = {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                "temperature": 0, "stream": True, **extra}
        return _time_stream(f"{self.url}/v1/completions", body,
                            lambda chunk: bool(chunk.get("choices") and chunk["choices"][0]["text"]),
                            lambda chunk: None, max_tokens)


class LlamaCppServer(Server):
    def time_request(self, prompt: list[int], max_tokens: int) -> Timing:
        # NOTE: llama.cpp's ignore_eos masks EOS, as min_tokens does for specserve: same lengths
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": False, "stream": True}
        return _time_stream(f"{self.url}/completion", body,
                            lambda chunk: bool(chunk.get("content")),
                            lambda chunk: chunk.get("tokens_predicted") if chunk.get("stop") else None,
                            max_tokens)


def _time_stream(url: str, body: dict, has_text, final_count, max_tokens: int) -> Timing:
    start = time.perf_counter()
    first = None
    count = max_tokens
    with httpx.stream("POST", url, json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if first is None and has_text(chunk):
                first = time.perf_counter() - start
            count = final_count(chunk) or count
    seconds = time.perf_counter() - start
    return Timing(seconds, first if first is not None else seconds, count)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def f32_gguf(llama_server: Path, out_dir: Path) -> Path:
    """The embedded Q4_1 weights dequantized to an F32 GGUF, as transformers and specserve run them."""
    target = out_dir / "smollm2-135m-instruct-f32.gguf"
    if not target.exists():
        subprocess.run([str(llama_server.parent / "llama-quantize"), "--allow-requantize",
                        embedded_gguf_path(), str(target), "F32"], check=True,
                       capture_output=True, env=_llama_env(llama_server))
    return target


def _llama_env(llama_server: Path) -> dict:
    return {**os.environ, "LD_LIBRARY_PATH": str(llama_server.parent)}


def start_servers(args: argparse.Namespace) -> list[Server]:
    servers: list[Server] = []
    for name in args.configs:
        port = free_port()
        command = [sys.executable, "-m", "server.cli", "serve", "--port", str(port),
                   "--max-model-len", "4096", "--speculative-config", SPECSERVE_CONFIGS[name]]
        if args.threads is not None:
            command += ["--num-threads", str(args.threads)]
        servers.append(SpecserveServer(f"specserve {name}", command, port,
                                       env={"SPECSERVE_NO_PROGRESS": "1"}))
    binary = Path(args.llama_server) if args.llama_server else None
    if binary is None or not binary.exists():
        print(f"llama.cpp skipped: {'no --llama-server given' if binary is None else binary} "
              "(build it as ../shared/TOOLCHAIN.md says)")
        return servers
    gguf = f32_gguf(binary, Path(args.gguf_dir))
    threads = str(args.threads or os.cpu_count())
    for label, extra in (("llama.cpp F32", []), ("llama.cpp F32 ngram", LLAMACPP_NGRAM)):
        port = free_port()
        command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   "-t", threads, "-tb", threads, "-c", "4096", "-np", "1", *extra]
        servers.append(LlamaCppServer(label, command, port, env=_llama_env(binary)))
    return servers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    parser.add_argument("--gguf-dir", default=tempfile.gettempdir(),
                        help="where the F32 GGUF for llama.cpp is written once")
    parser.add_argument("--configs", nargs="+", default=["none", "ngram", "suffix"],
                        choices=sorted(SPECSERVE_CONFIGS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both servers (default: each server's own default)")
    args = parser.parse_args()

    prompts = chat_prompts(load_tokenizer(None))
    servers = start_servers(args)
    try:
        for server in servers:
            server.wait_ready()
        # warm-up: one short request each, so no server pays for its first call in the table
        for server in servers:
            server.time_request(prompts["open_chat"], 8)
        timings: dict[tuple[str, str], list[Timing]] = {}
        for _ in range(args.repeats):
            for workload, prompt in prompts.items():
                for server in servers:  # NOTE: interleaved, so drift hits every server alike
                    timings.setdefault((workload, server.label), []).append(
                        server.time_request(prompt, args.max_tokens))
    finally:
        for server in servers:
            server.stop()
    print_table(args, prompts, servers, timings)


def print_table(args, prompts, servers, timings) -> None:
    print(f"CPU: {cpu_name()}, threads: {args.threads or 'each server default'}, "
          f"{args.max_tokens} tokens, median of {args.repeats}")
    print(f"{'workload':<13} {'server':<22} {'e2e tok/s':>9} {'decode tok/s':>12} "
          f"{'e2e x llama.cpp':>15} {'decode x llama.cpp':>18}")
    base_label = "llama.cpp F32"
    for workload in prompts:
        base = timings.get((workload, base_label))
        for server in servers:
            runs = timings[(workload, server.label)]
            e2e = statistics.median(t.e2e_tokens_per_s for t in runs)
            decode = statistics.median(t.decode_tokens_per_s for t in runs)
            row = f"{workload:<13} {server.label:<22} {e2e:>9.1f} {decode:>12.1f}"
            if base is not None:
                row += (f" {e2e / statistics.median(t.e2e_tokens_per_s for t in base):>15.2f}"
                        f" {decode / statistics.median(t.decode_tokens_per_s for t in base):>18.2f}")
            print(row)


if __name__ == "__main__":
    main()
