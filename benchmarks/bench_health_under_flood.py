"""How long /health takes to answer while hostile or heavy requests are in flight: the event loop's
responsiveness (issue 28: 8,000,000 stop_token_ids once held /health for 12.7 s; the aim is ~100 ms).

Starts `specserve serve` on 127.0.0.1 (the embedded model, or --tiny for a tiny random model with
the embedded tokenizer), then for each flood sends its requests --repeats times, --concurrency at a
time, while a prober GETs /health every 50 ms; prints /health p50 and max, and the statuses seen.

Run: python -m benchmarks.bench_health_under_flood [--tiny] [--repeats 3] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx

from benchmarks.bench_llamacpp import free_port
from benchmarks.common import cpu_name

# NOTE: the flood bodies and the prober are shared with tests/hardening (one definition of each)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "helpers"))
from floods import (  # noqa: E402
    HealthProbe,
    deep_schema_body,
    huge_prompt_body,
    post,
    small_chat_body,
    stop_ids_flood_body,
)


def slow_schema_body() -> bytes:
    """A schema whose support check and compile take ~0.4 s each here (llguidance)."""
    properties = {f"f{i}": {"type": "integer", "minimum": -123456789 + i, "maximum": 987654321 - i}
                  for i in range(600)}
    return json.dumps({"prompt": "Hi", "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "slow", "schema": {
            "type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}}}}).encode()


FLOODS = {
    "idle (no flood)": None,
    "stop_token_ids, 7.8M in 15 MiB": ("/v1/completions", stop_ids_flood_body),
    "text prompt, 12 MiB": ("/v1/completions", huge_prompt_body),
    "json_schema nested 950 deep": ("/v1/completions", deep_schema_body),
    "json_schema slow to compile": ("/v1/completions", slow_schema_body),
    "64 concurrent chats": ("/v1/chat/completions", small_chat_body),
}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    model_args = ["--max-model-len", "2048"]
    if args.tiny:
        from tiny_chat_model import build_tiny_chat_checkpoint
        model_args = ["--model", build_tiny_chat_checkpoint(tempfile.mkdtemp(prefix="tiny-")),
                      "--dtype", "float32", "--max-model-len", "512"]
    log = tempfile.NamedTemporaryFile("w+", prefix="bench-flood-", suffix=".log", delete=False)
    process = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--port", str(port), *model_args,
         *args.server_args], stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, SPECSERVE_NO_PROGRESS="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {open(log.name).read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise TimeoutError("the server did not become healthy")


def run_flood(url: str, flood, repeats: int, concurrency: int) -> tuple[HealthProbe, Counter]:
    statuses: Counter = Counter()
    with HealthProbe(url) as probe:
        if flood is None:
            time.sleep(2.0)
        else:
            path, make_body = flood
            count = 64 if "chat" in path else repeats
            bodies = [make_body() for _ in range(min(count, 2))]  # built before timing starts
            with concurrent.futures.ThreadPoolExecutor(concurrency if count < 64 else 64) as pool:
                for status, _ in pool.map(lambda i: post(url, path, bodies[i % len(bodies)]),
                                          range(count)):
                    statuses[status] += 1
    return probe, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (fast start)")
    parser.add_argument("--repeats", type=int, default=3, help="requests per flood")
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="more `specserve serve` flags")
    args = parser.parse_args()
    process, url, log = start_server(args)
    print(f"# /health latency under floods; {cpu_name()}; model "
          f"{'tiny random' if args.tiny else 'embedded SmolLM2-135M'}")
    print(f"{'flood':34s} {'health p50 ms':>13s} {'health max ms':>13s} {'probes':>7s}  statuses")
    try:
        for name, flood in FLOODS.items():
            probe, statuses = run_flood(url, flood, args.repeats, args.concurrency)
            print(f"{name:34s} {probe.p50 * 1000:13.1f} {probe.max * 1000:13.1f} "
                  f"{len(probe.latencies):7d}  {dict(sorted(statuses.items()))}", flush=True)
    finally:
        process.terminate()
        process.wait(30)
        os.unlink(log.name)


if __name__ == "__main__":
    main()
