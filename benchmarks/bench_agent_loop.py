"""Suffix decoding on agent traffic: the same tool-calling sessions (loadtest/agent_loop.py) against
`specserve serve` on the embedded model, launched once without speculation and once with suffix
decoding; prints τ and output tok/s per request kind side by side, with suffix's ratio to none.

Run: python -m benchmarks.bench_agent_loop [--sessions 4] [--turns 3] [--max-tokens 128]
     [--max-tool-calls 3] [--suffix-config JSON] [--serve-args "--num-threads 1"]
     [--result-json agent.json]
Needs function calling in the server (`tools`, `tool_choice`); without it every request fails and
the table says so. Greedy, so both servers see the same conversations as long as their outputs
agree. Without speculation each step emits one token, so its τ is 1 by definition.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import httpx

from loadtest.agent_loop import AgentLoopPlan, run_agent_loop
from loadtest.agent_report import SUMMARY_NAMES, build_agent_result, format_agent_result, ratio
from loadtest.client import SamplingOptions
from loadtest.compare import LaunchedServer, ServerConfig
from loadtest.report import write_result_file
from loadtest.target import Endpoint, discover_model

SUFFIX = '{"method": "suffix", "num_speculative_tokens": 8}'


def run_config(config: ServerConfig, plan: AgentLoopPlan, serve_args: list[str]) -> dict:
    print(f"starting specserve serve for {config.label!r}...", file=sys.stderr, flush=True)
    with LaunchedServer(config, serve_args) as server:
        endpoint = Endpoint(server.base_url, discover_model(server.base_url, None), "chat", None)
        _warm_up(endpoint)
        outcome = run_agent_loop(endpoint, plan)
    result = build_agent_result(config.label, endpoint, plan, config.speculative_config, outcome)
    print(format_agent_result(result), flush=True)
    return result


def _warm_up(endpoint: Endpoint) -> None:
    """One short plain request, so that neither run pays the server's first-request costs."""
    httpx.post(endpoint.url, timeout=300.0, json={
        "model": endpoint.model, "max_tokens": 8, "temperature": 0.0,
        "messages": [{"role": "user", "content": "Say hello."}]}).raise_for_status()


def side_by_side(none: dict, suffix: dict) -> list[str]:
    """Per request kind: τ, tok/s of request time and of wall time, and suffix / none."""
    lines = [f"{'kind':<8}{'ok none':>9}{'ok sfx':>8}{'τ none':>8}{'τ sfx':>7}"
             f"{'tok/s req none':>16}{'sfx':>8}{'x':>6}{'tok/s wall none':>17}{'sfx':>8}{'x':>6}"]
    for name in SUMMARY_NAMES:
        plain, fast = none["kinds"][name], suffix["kinds"][name]
        plain_tau = plain["mean_acceptance_length"] or 1.0  # one token per step without drafts
        per_request = (plain["tokens_per_request_second"], fast["tokens_per_request_second"])
        per_wall = (plain["output_throughput"], fast["output_throughput"])
        lines.append(
            f"{name:<8}{_ok(plain):>9}{_ok(fast):>8}{plain_tau:>8.2f}"
            f"{_number(fast['mean_acceptance_length'], 2):>7}"
            f"{_number(per_request[0]):>16}{_number(per_request[1]):>8}"
            f"{_number(ratio(per_request[1], per_request[0]), 2):>6}"
            f"{_number(per_wall[0]):>17}{_number(per_wall[1]):>8}"
            f"{_number(ratio(per_wall[1], per_wall[0]), 2):>6}")
    for result in (none, suffix):
        if result["error_counts"]:
            lines.append(f"{result['label']} failures: {result['error_counts']}")
    return lines


def _ok(kind: dict) -> str:
    return f"{kind['completed']}/{kind['sent']}"


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tool-calls", type=int, default=3, help="per turn at most")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="sessions in flight at most (default: all)")
    parser.add_argument("--duration", type=float, default=900.0, help="seconds per server at most")
    parser.add_argument("--suffix-config", default=SUFFIX, help="the speculative config to test")
    parser.add_argument("--serve-args", default="", help='e.g. "--num-threads 1"')
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    plan = AgentLoopPlan(num_sessions=args.sessions, num_turns=args.turns,
                         max_tool_calls_per_turn=args.max_tool_calls,
                         sampling=SamplingOptions(args.max_tokens), duration_s=args.duration,
                         max_concurrency=args.concurrency)
    serve_args = shlex.split(args.serve_args)
    configs = [ServerConfig("none", None), ServerConfig("suffix", json.loads(args.suffix_config))]
    none, suffix = [run_config(config, plan, serve_args) for config in configs]
    print("\n".join(side_by_side(none, suffix)))
    if args.result_json:
        write_result_file(args.result_json, [none, suffix], ["bench_agent_loop", *sys.argv[1:]])


if __name__ == "__main__":
    main()
