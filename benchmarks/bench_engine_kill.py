"""How fast in-flight requests learn that the engine died: a live server with streams and plain
requests generating, SIGKILL to its engine process, and the time from the kill to each request's
error (an SSE error event or a 503), plus the time until the server process exits.

The target: every in-flight request ends with an error within 2 s (the server's watchdog polls the
engine process every 0.2 s, server/engine_client.py). Needs the embedded model's converted cache
for the tokenizer (built on first use).
Run: python -m benchmarks.bench_engine_kill [--repeats 5] [--streams 4] [--plain 4]
     [--model PATH | --model embedded]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

# NOTE: the scenario and the live-server harness are the tests' own (tests/helpers), so the test
# and this measurement run exactly the same thing
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "helpers"))

from engine_kill import kill_engine_under_load  # noqa: E402
from live_server import LiveServer, engine_pid  # noqa: E402
from tiny_chat_model import build_tiny_chat_checkpoint  # noqa: E402

from benchmarks.common import cpu_name  # noqa: E402

TARGET_S = 2.0


def one_run(model_flags: list[str], args: argparse.Namespace) -> tuple[list[float], float]:
    """Seconds from the kill to each request's error, and to the server's exit."""
    with LiveServer([*model_flags, "--dtype", "float32", "--max-model-len", "512"]) as server:
        result = asyncio.run(kill_engine_under_load(
            server.api, engine_pid(server.process.pid), args.streams, args.plain,
            max_tokens=args.max_tokens, deadline_s=args.deadline))
        exit_code = server.process.wait(args.deadline)
        exited_after = time.monotonic() - result.killed_at
    if exit_code != 1:
        raise RuntimeError(f"the server exited with {exit_code}, not 1")
    missing = [end for end in result.ends if end.seconds_to_error is None]
    if missing:
        raise RuntimeError(f"{len(missing)} requests got no error within {args.deadline} s")
    return [end.seconds_to_error for end in result.ends], exited_after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--plain", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=480)
    parser.add_argument("--deadline", type=float, default=30.0, help="seconds to wait for errors")
    parser.add_argument("--model", default=None,
                        help="HF folder, or 'embedded' for SmolLM2-135M (default: a tiny random "
                             "Llama with the embedded tokenizer, built in a temp folder)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-engine-kill-") as folder:
        if args.model is None:
            model_flags = ["--model", build_tiny_chat_checkpoint(folder)]
        else:
            model_flags = [] if args.model == "embedded" else ["--model", args.model]
        name = model_flags[1] if model_flags else "embedded SmolLM2-135M"
        print(f"CPU: {cpu_name()}, engine 1 thread; model {name}; "
              f"{args.streams} streams + {args.plain} plain requests in flight per run")
        every, exits = [], []
        for run in range(1, args.repeats + 1):
            seconds, exited_after = one_run(model_flags, args)
            every += seconds
            exits.append(exited_after)
            print(f"run {run}: time to error median {statistics.median(seconds):.3f} s, "
                  f"max {max(seconds):.3f} s; server exited {exited_after:.3f} s after the kill")
    print(f"all {len(every)} requests over {args.repeats} runs: time to error median "
          f"{statistics.median(every):.3f} s, max {max(every):.3f} s (target {TARGET_S:.0f} s: "
          f"{'met' if max(every) <= TARGET_S else 'MISSED'}); server exit median "
          f"{statistics.median(exits):.3f} s, max {max(exits):.3f} s")


if __name__ == "__main__":
    main()
