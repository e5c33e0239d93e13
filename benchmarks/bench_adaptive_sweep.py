"""Adaptive speculation under load: one QPS sweep, run by the load tester in compare mode, of no
speculation, a fixed k and adaptive k on the embedded model; prints each configuration's latency and
throughput against no speculation's at every QPS, side by side from the same run.

Run: python -m benchmarks.bench_adaptive_sweep [--qps 0.05 0.2 1] [--num-requests 8]
     [--max-tokens 128] [--method suffix] [--k 8] [--result-json sweep.json] [--plot-dir plots/]
The fixed and adaptive runs use the same proposer: suffix with k 8 by default, the server's default.
About 14 minutes on 2 CPU cores. The engine gets one thread (--serve-args) so that the HTTP server
and the load tester keep the other core: timings are steadier than with both cores contended.
The aim (issue 7): adaptive is never more than 5% slower than no speculation at any QPS (mean
end-to-end latency, and output throughput), and keeps most of fixed k's gain at low QPS.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from loadtest.cli import main as loadtest_main

# the aim: adaptive may cost at most this much against no speculation, at any QPS
TOLERANCE = 0.05


def spec_json(method: str, k: int, adaptive: bool) -> str:
    config = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=4)
    if adaptive:
        config["adaptive"] = True
    return json.dumps(config)


def compare_rows(runs: list[dict]) -> list[str]:
    """Per QPS and configuration: latency and throughput, and their ratios to no speculation."""
    by_rate: dict[str, dict[str, dict]] = {}
    for run in runs:
        by_rate.setdefault(str(run["request_rate"]), {})[run["label"]] = run
    lines = [f"{'QPS':>5} {'config':>9} {'done':>5} {'tok/s':>7} {'TPOT ms':>8} {'E2E ms':>8} "
             f"{'α':>5} {'τ':>5} {'E2E/none':>9} {'tok/s/none':>11} {'kept gain':>10}"]
    verdicts = []
    for rate, labels in by_rate.items():
        plain = labels.get("none")
        for label, run in labels.items():
            row = (f"{rate:>5} {label:>9} {run['completed']:>5} {run['output_throughput']:>7.1f} "
                   f"{_ms(run['mean_tpot_ms']):>8} {_ms(run['mean_e2el_ms']):>8} "
                   f"{_num(run['acceptance_rate']):>5} {_num(run['mean_acceptance_length']):>5}")
            if plain is not None and label != "none" and plain["mean_e2el_ms"]:
                e2e_ratio = run["mean_e2el_ms"] / plain["mean_e2el_ms"]
                throughput_ratio = run["output_throughput"] / plain["output_throughput"]
                row += f" {e2e_ratio:>9.3f} {throughput_ratio:>11.3f}"
                fixed = labels.get("fixed")
                if label == "adaptive" and fixed is not None:
                    gain = plain["mean_e2el_ms"] - fixed["mean_e2el_ms"]
                    kept = (plain["mean_e2el_ms"] - run["mean_e2el_ms"]) / gain if gain > 0 else None
                    row += f" {_num(kept):>10}"
                    ok = e2e_ratio <= 1 + TOLERANCE and throughput_ratio >= 1 - TOLERANCE
                    verdicts.append(f"QPS {rate}: adaptive E2E x{e2e_ratio:.3f}, throughput "
                                    f"x{throughput_ratio:.3f} vs none -> "
                                    f"{'within' if ok else 'OUTSIDE'} {TOLERANCE:.0%}")
            lines.append(row)
    return lines + [""] + verdicts


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qps", nargs="+", default=["0.05", "0.2", "1"])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--method", choices=["suffix", "ngram"], default="suffix",
                        help="the proposer of the fixed and adaptive runs (default: the server's)")
    parser.add_argument("--k", type=int, default=8, help="k of the fixed run; adaptive's largest")
    parser.add_argument("--duration", type=float, default=240.0, help="seconds per run at most")
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--plot-dir", default=None)
    parser.add_argument("--serve-args", default="--num-threads 1")
    args = parser.parse_args()
    result = args.result_json or os.path.join(tempfile.mkdtemp(), "sweep.json")
    argv = ["--compare", "none", f"fixed={spec_json(args.method, args.k, False)}",
            f"adaptive={spec_json(args.method, args.k, True)}", "--dataset", "workloads", "--ignore-eos",
            "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens),
            "--duration", str(args.duration), "--qps", *args.qps, "--result-json", result,
            f"--serve-args={args.serve_args}"]
    if args.plot_dir:
        argv += ["--plot-dir", args.plot_dir]
    if loadtest_main(argv) != 0:
        raise SystemExit("the load test failed")
    with open(result) as f:
        runs = json.load(f)["runs"]
    print("\n".join(compare_rows(runs)))


if __name__ == "__main__":
    main()
