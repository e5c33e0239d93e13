"""`specserve-loadtest` / `python -m loadtest`: flags -> a sweep (or agent-loop sessions) against
one server, or compare mode (one launched server per configuration); prints tables, writes the JSON
result file and plots."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from collections.abc import Callable
from typing import Any

from loadtest.agent_loop import AgentLoopPlan, run_agent_loop
from loadtest.agent_report import build_agent_result, format_agent_comparison, format_agent_result
from loadtest.client import SamplingOptions
from loadtest.compare import LaunchedServer, ServerConfig, parse_server_configs
from loadtest.datasets import DATASET_NAMES, DatasetError, load_requests
from loadtest.metrics_scrape import scrape_spec_counters
from loadtest.report import format_rate, format_run, format_summary, write_result_file
from loadtest.session import SweepPlan, run_sweep
from loadtest.stats import parse_slo
from loadtest.target import (
    API_PATHS,
    Endpoint,
    TargetError,
    discover_model,
    normalize_base_url,
    require_loopback,
)

EXAMPLES = """examples:
  specserve-loadtest --num-requests 20 --qps 0.5 1 --max-tokens 64 --result-json out.json
  specserve-loadtest --dataset workloads --concurrency 2 --qps inf --goodput ttft:2000 tpot:100
  specserve-loadtest --compare none ngram suffix --num-requests 12 --qps 1 --plot-dir plots/
  specserve-loadtest --workload agent-loop --compare none suffix --sessions 4 --turns 3
"""
WORKLOADS = ("requests", "agent-loop")
# runs one server (label, endpoint, the speculative config it was launched with) -> its results
RunOneServer = Callable[[str, Endpoint, dict[str, Any] | None], list[dict[str, Any]]]


def _positive_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 (or inf), got {text}")
    return rate


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve-loadtest", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load-test an OpenAI-compatible server: TTFT, TPOT, ITL, end-to-end latency, "
                    "throughput, goodput, and α/τ from specserve's /metrics.")
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server, with or without /v1 (default %(default)s)")
    server.add_argument("--allow-remote", action="store_true",
                        help="allow a base URL that is not a loopback address")
    server.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                        help="bearer token (default $SPECSERVE_API_KEY)")
    server.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    server.add_argument("--endpoint", choices=tuple(API_PATHS), default="chat")

    parser.add_argument("--workload", choices=WORKLOADS, default="requests",
                        help="requests: independent requests at --qps; agent-loop: multi-turn "
                             "tool-calling sessions (chat only; the dataset and QPS flags do not "
                             "apply) (default %(default)s)")
    data = parser.add_argument_group("requests")
    data.add_argument("--dataset", choices=DATASET_NAMES, default="synthetic")
    data.add_argument("--dataset-path", default=None, help="the JSONL file for --dataset jsonl")
    data.add_argument("--input-words", type=_positive_int, default=64,
                      help="words per synthetic prompt (default %(default)s)")
    data.add_argument("--max-tokens", type=_positive_int, default=128)
    data.add_argument("--temperature", type=float, default=0.0)
    data.add_argument("--ignore-eos", action="store_true",
                      help="generate exactly max_tokens (a specserve/vLLM extra)")

    load = parser.add_argument_group("load and bounds")
    load.add_argument("--qps", type=_positive_rate, nargs="+", default=[1.0],
                      help="offered requests/s; several values sweep; inf = unpaced")
    load.add_argument("--burstiness", type=_positive_float, default=1.0,
                      help="gamma shape of arrival gaps: 1 = Poisson, <1 burstier")
    load.add_argument("--concurrency", type=_positive_int, default=None,
                      help="at most this many requests in flight (with --qps inf: a fixed "
                           "concurrency; with --workload agent-loop: sessions in flight)")
    load.add_argument("--num-requests", type=_positive_int, default=50,
                      help="requests per run at most (default %(default)s)")
    load.add_argument("--duration", type=_positive_float, default=120.0,
                      help="seconds per run at most; in-flight requests are then cancelled "
                           "(default %(default)s)")
    load.add_argument("--seed", type=int, default=0, help="arrival gaps and synthetic prompts")
    load.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                      help="SLOs for goodput, e.g. ttft:2000 tpot:100 e2el:10000")

    agent = parser.add_argument_group("agent loop (--workload agent-loop)")
    agent.add_argument("--sessions", type=_positive_int, default=4,
                       help="concurrent sessions, at most --concurrency at a time "
                            "(default %(default)s)")
    agent.add_argument("--turns", type=_positive_int, default=3,
                       help="user questions per session (default %(default)s)")
    agent.add_argument("--max-tool-calls", type=_positive_int, default=3,
                       help="tool-calling responses per turn at most (default %(default)s)")

    compare = parser.add_argument_group("compare mode (launches specserve serve per config)")
    compare.add_argument("--compare", nargs="+", default=None, metavar="CONFIG",
                         help="none, a method name (ngram, suffix), or JSON; LABEL=CONFIG names "
                              "it; each gets its own server, so --base-url is not used")
    compare.add_argument("--num-speculative-tokens", type=_positive_int, default=3,
                         help="k for configurations given by method name (default %(default)s)")
    compare.add_argument("--serve-args", default="",
                         help="extra `specserve serve` flags, e.g. --serve-args=\"--num-threads 1\"")

    output = parser.add_argument_group("output")
    output.add_argument("--label", default=None,
                        help="name of this configuration in tables and plots (default: the "
                             "server's speculation method)")
    output.add_argument("--result-json", default=None, help="write every run here")
    output.add_argument("--plot-dir", default=None, help="write PNG plots here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    is_agent_loop = args.workload == "agent-loop"
    try:
        slos_ms = dict(parse_slo(text) for text in args.goodput)
        configs = (parse_server_configs(args.compare, args.num_speculative_tokens)
                   if args.compare else None)
        base_url = normalize_base_url(args.base_url)
        if configs is None:
            require_loopback(base_url, args.allow_remote)
        if is_agent_loop:
            _check_agent_loop_flags(args)
        else:
            requests = load_requests(args.dataset, args.num_requests, path=args.dataset_path,
                                     num_words=args.input_words, seed=args.seed)
            if args.endpoint == "completions":
                for request in requests:
                    request.completion_prompt()
    except (ValueError, TargetError) as error:  # DatasetError is a ValueError
        parser.error(str(error))
    sampling = SamplingOptions(args.max_tokens, args.temperature, ignore_eos=args.ignore_eos)
    if is_agent_loop:
        run_one = _agent_loop_runner(args, sampling)
    else:
        plan = SweepPlan(
            requests=requests, dataset=args.dataset, sampling=sampling, request_rates=args.qps,
            burstiness=args.burstiness, max_concurrency=args.concurrency,
            duration_s=args.duration, slos_ms=slos_ms, seed=args.seed)

        def run_one(label: str, endpoint: Endpoint,
                    speculative_config: dict[str, Any] | None) -> list[dict[str, Any]]:
            _announce(label, plan)
            return run_sweep(endpoint, plan, label, speculative_config,
                             lambda run: print(format_run(run), flush=True))

    runs: list[dict[str, Any]] = []
    try:
        _for_each_server(configs, base_url, args, run_one, runs)
    except (TargetError, DatasetError, RuntimeError, TimeoutError) as error:
        print(f"specserve-loadtest: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("specserve-loadtest: interrupted", file=sys.stderr)
        return 130
    finally:
        _write_outputs(runs, args, sys.argv[1:] if argv is None else argv)
    if len(runs) > 1:
        print(format_agent_comparison(runs) if is_agent_loop else format_summary(runs))
    return 0


def _for_each_server(configs: list[ServerConfig] | None, base_url: str, args: argparse.Namespace,
                     run_one: RunOneServer, runs: list[dict[str, Any]]) -> None:
    """The server at --base-url, or one launched server per configuration in turn; each run's
    results join `runs` as soon as they exist, so a later failure keeps them."""
    if configs is None:
        endpoint = _endpoint(base_url, args)
        runs += run_one(args.label or _server_label(endpoint), endpoint, None)
        return
    serve_args = shlex.split(args.serve_args)
    for config in configs:
        print(f"starting specserve serve for {config.label!r}...", file=sys.stderr, flush=True)
        with LaunchedServer(config, serve_args) as server:
            runs += run_one(config.label, _endpoint(server.base_url, args),
                            config.speculative_config)


def _check_agent_loop_flags(args: argparse.Namespace) -> None:
    """Flags that cannot mean anything for tool-calling sessions fail instead of being ignored."""
    if args.endpoint != "chat":
        raise ValueError("--workload agent-loop needs --endpoint chat: tools are a chat feature")
    if args.goodput:
        raise ValueError("--goodput applies to --workload requests only")
    if args.plot_dir:
        raise ValueError("--plot-dir applies to --workload requests only")


def _agent_loop_runner(args: argparse.Namespace, sampling: SamplingOptions) -> RunOneServer:
    plan = AgentLoopPlan(num_sessions=args.sessions, num_turns=args.turns,
                         max_tool_calls_per_turn=args.max_tool_calls, sampling=sampling,
                         duration_s=args.duration, max_concurrency=args.concurrency,
                         seed=args.seed)

    def run_one(label: str, endpoint: Endpoint,
                speculative_config: dict[str, Any] | None) -> list[dict[str, Any]]:
        print(f"{label}: {plan.num_sessions} agent-loop sessions of {plan.num_turns} turns "
              f"(concurrency {plan.max_concurrency or 'all'}, at most {plan.duration_s:g} s)",
              file=sys.stderr, flush=True)
        result = build_agent_result(label, endpoint, plan, speculative_config,
                                    run_agent_loop(endpoint, plan))
        print(format_agent_result(result), flush=True)
        return [result]

    return run_one


def _endpoint(base_url: str, args: argparse.Namespace) -> Endpoint:
    model = args.model or discover_model(base_url, args.api_key)
    return Endpoint(base_url, model, args.endpoint, args.api_key)


def _server_label(endpoint: Endpoint) -> str:
    """The server's own speculation method when it exports one, else its model name."""
    counters = scrape_spec_counters(endpoint.base_url)
    return (counters.spec_method if counters and counters.spec_method else endpoint.model)


def _announce(label: str, plan: SweepPlan) -> None:
    rates = ", ".join(format_rate(rate) for rate in plan.request_rates)
    print(f"{label}: {len(plan.requests)} requests per run at {rates} QPS "
          f"(burstiness {plan.burstiness:g}, concurrency {plan.max_concurrency or 'unlimited'}, "
          f"at most {plan.duration_s:g} s each)", file=sys.stderr, flush=True)


def _write_outputs(runs: list[dict[str, Any]], args: argparse.Namespace,
                   argv: list[str]) -> None:
    """Whatever ran is kept, even when a later configuration failed to start."""
    if not runs:
        return
    if args.result_json:
        write_result_file(args.result_json, runs, ["specserve-loadtest", *argv])
        print(f"results: {args.result_json}", file=sys.stderr)
    if args.plot_dir:
        from loadtest.plots import write_plots  # matplotlib loads only when plots are asked for
        for path in write_plots(runs, args.plot_dir):
            print(f"plot: {path}", file=sys.stderr)
