"""What the HTTP process costs a single stream: the offline engine (`LLM.generate`, in this process)
against `specserve serve` (streamed over HTTP), same config, same default threads, interleaved.

Run: python -m benchmarks.bench_server_overhead [--configs none suffix] [--max-tokens 128]
     [--repeats 3] [--threads N]
The aim (issue 15): the server's tokens/s is at least 95% of the offline engine's, with and without
speculation, at the default thread count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

from benchmarks.bench_llamacpp import SPECSERVE_CONFIGS, SpecserveServer, free_port
from benchmarks.common import cpu_name
from engine import LLM, SamplingParams
from loadtest.workloads import chat_prompts

AIM = 0.95


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["none", "suffix"],
                        choices=sorted(SPECSERVE_CONFIGS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="engine threads (default: the engine's own default)")
    parser.add_argument("--server-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra environment for the server only, e.g. OMP_WAIT_POLICY=PASSIVE")
    args = parser.parse_args()
    server_env = dict(item.split("=", 1) for item in args.server_env)

    rows = []
    for name in args.configs:
        config = SPECSERVE_CONFIGS[name]
        llm = LLM(None, dtype="float32", max_model_len=4096, num_threads=args.threads,
                  speculative_config=None if config == "none" else config)
        prompts = chat_prompts(llm.tokenizer)
        port = free_port()
        command = [sys.executable, "-m", "server.cli", "serve", "--port", str(port),
                   "--max-model-len", "4096", "--speculative-config", config]
        if args.threads is not None:
            command += ["--num-threads", str(args.threads)]
        server = SpecserveServer(f"server {name}", command, port,
                                 env={"SPECSERVE_NO_PROGRESS": "1", **server_env})
        try:
            server.wait_ready()
            server.time_request(prompts["open_chat"], 8)
            llm.generate({"prompt_token_ids": prompts["open_chat"]}, _params(8))
            for workload, prompt in prompts.items():
                offline, http = [], []
                for _ in range(args.repeats):  # NOTE: interleaved: drift hits both alike
                    # NOTE: a fresh cache_salt per request: no run drafts from an earlier repeat
                    start = time.perf_counter()
                    out = llm.generate({"prompt_token_ids": prompt, "cache_salt": _salt()},
                                       _params(args.max_tokens))
                    offline.append(len(out[0].outputs[0].token_ids)
                                   / (time.perf_counter() - start))
                    http.append(server.time_request(prompt, args.max_tokens,
                                                    cache_salt=_salt()).e2e_tokens_per_s)
                rows.append((name, workload, statistics.median(offline), statistics.median(http)))
        finally:
            server.stop()
        del llm

    print(f"CPU: {cpu_name()}, engine threads: {args.threads or 'default'}, "
          f"{args.max_tokens} tokens, median of {args.repeats}, server env {server_env or 'as is'}")
    print(f"{'config':<16} {'workload':<13} {'offline tok/s':>13} {'HTTP tok/s':>10} "
          f"{'HTTP/offline':>12}")
    for name, workload, offline, http in rows:
        print(f"{name:<16} {workload:<13} {offline:>13.1f} {http:>10.1f} {http / offline:>12.3f}")
    worst = min(http / offline for _, _, offline, http in rows)
    print(f"worst HTTP/offline: {worst:.3f} (aim >= {AIM}: {'met' if worst >= AIM else 'NOT met'})")


def _salt() -> str:
    return uuid.uuid4().hex


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


if __name__ == "__main__":
    main()
