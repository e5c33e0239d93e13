"""A run's result as one flat dict (field names follow `vllm bench serve` where one exists), the
JSON file that holds a list of them, and the tables printed for people.

Scalar fields of a run are listed in RUN_FIELDS; per-request arrays in PER_REQUEST_FIELDS (one entry
per completed request, in send order) and `errors` (one message per failed request).
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.metrics_scrape import SpecCounters
from loadtest.runner import CANCELLED_ERROR, RunOutcome
from loadtest.stats import (
    LATENCY_METRICS,
    PERCENTILES,
    distribution_fields,
    goodput,
    time_per_output_token,
)

SETTINGS_FIELDS = (
    "label",               # the configuration's name (compare mode) or --label
    "base_url", "model", "endpoint", "dataset",
    "request_rate",        # offered QPS, or "inf" when requests are not paced
    "burstiness",          # gamma shape of the gaps; 1 = Poisson
    "max_concurrency",     # cap on requests in flight, or None
    "max_requests", "duration_limit_s",  # the two bounds of the run
    "max_tokens", "temperature",
    "speculative_config",  # what compare mode launched the server with (None = no speculation)
)
COUNT_FIELDS = (
    "duration",            # seconds, from the start to the last request's end (or the deadline)
    "sent", "completed", "failed",  # completed + failed == sent
    "cancelled",           # the failed requests cancelled at the duration limit
    "error_counts",        # failure kind -> count ("HTTP 429", "cancelled", ...)
    "total_input_tokens", "total_output_tokens",  # over completed requests (usage)
    "request_throughput", "output_throughput", "total_token_throughput",  # per second of duration
    "request_goodput",     # completed requests per second within every SLO; None without SLOs
    "goodput_slos_ms",     # the SLOs judged: metric -> limit in ms
)
LATENCY_FIELDS = tuple(f"{stat}_{metric}_ms" for metric in LATENCY_METRICS
                       for stat in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES)))
SPEC_FIELDS = (
    "metrics_available",   # False when the server had no readable /metrics: the rest are None
    "spec_method", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
    "acceptance_rate",     # α = accepted / draft tokens, over this run (None: nothing drafted)
    "mean_acceptance_length",  # τ = 1 + accepted / drafts
    "acceptance_rate_per_position",  # per 1-based draft position: accepted / drafts
    "prefix_cache_hit_rate",  # prompt tokens found cached / looked up (None: nothing looked up)
)
RUN_FIELDS = SETTINGS_FIELDS + COUNT_FIELDS + LATENCY_FIELDS + SPEC_FIELDS
TABLE_WIDTH = 68
PER_REQUEST_FIELDS = ("start_times", "input_lens", "output_lens", "ttfts", "tpots", "itls", "e2els",
                      "generated_texts")


def build_run_result(settings: dict[str, Any], run: RunOutcome, spec: SpecCounters | None,
                     slos_ms: dict[str, float]) -> dict[str, Any]:
    """Everything about one run, as written to the result file."""
    missing = [name for name in SETTINGS_FIELDS if name not in settings]
    if missing:
        raise ValueError(f"run settings lack {missing}")
    done = [outcome for outcome in run.outcomes if outcome.is_success]
    failed = [outcome for outcome in run.outcomes if not outcome.is_success]
    total_input = sum(outcome.input_len for outcome in done)
    total_output = sum(outcome.output_len for outcome in done)
    tpots = [time_per_output_token(outcome) for outcome in done]

    def per_second(amount: float) -> float:
        return amount / run.duration if run.duration > 0 else 0.0

    result: dict[str, Any] = {name: settings[name] for name in SETTINGS_FIELDS}
    result.update(
        duration=run.duration, sent=run.num_sent, completed=len(done), failed=len(failed),
        cancelled=sum(outcome.error.startswith(CANCELLED_ERROR) for outcome in failed),
        error_counts=dict(Counter(error_kind(outcome.error) for outcome in failed)),
        total_input_tokens=total_input, total_output_tokens=total_output,
        request_throughput=per_second(len(done)), output_throughput=per_second(total_output),
        total_token_throughput=per_second(total_input + total_output),
        request_goodput=goodput(run.outcomes, slos_ms, run.duration),
        goodput_slos_ms=dict(slos_ms))
    result.update(distribution_fields("ttft", [outcome.ttft for outcome in done]))
    result.update(distribution_fields("tpot", [tpot for tpot in tpots if tpot is not None]))
    result.update(distribution_fields("itl", [itl for outcome in done for itl in outcome.itls]))
    result.update(distribution_fields("e2el", [outcome.latency for outcome in done]))
    result.update(_spec_fields(spec))
    result.update(
        start_times=[outcome.start_time for outcome in done],
        input_lens=[outcome.input_len for outcome in done],
        output_lens=[outcome.output_len for outcome in done],
        ttfts=[outcome.ttft for outcome in done], tpots=tpots,
        itls=[outcome.itls for outcome in done], e2els=[outcome.latency for outcome in done],
        generated_texts=[outcome.generated_text for outcome in done],
        errors=[outcome.error for outcome in failed])
    return result


def error_kind(error: str) -> str:
    """The class of a failure that error counts group by: "HTTP 429", "cancelled", ..."""
    if error.startswith(CANCELLED_ERROR):
        return "cancelled"
    if error.startswith("HTTP "):
        return error.split(":", 1)[0]
    return error.split(":", 1)[0][:60]


def _spec_fields(spec: SpecCounters | None) -> dict[str, Any]:
    if spec is None:
        return dict.fromkeys(SPEC_FIELDS) | {"metrics_available": False,
                                             "acceptance_rate_per_position": []}
    return {"metrics_available": True, "spec_method": spec.spec_method,
            # counters are whole numbers; Prometheus text carries them as floats
            "num_drafts": round(spec.num_drafts), "num_draft_tokens": round(spec.num_draft_tokens),
            "num_accepted_tokens": round(spec.num_accepted_tokens),
            "acceptance_rate": spec.acceptance_rate,
            "mean_acceptance_length": spec.mean_acceptance_length,
            "acceptance_rate_per_position": spec.acceptance_rate_per_position,
            "prefix_cache_hit_rate": spec.prefix_cache_hit_rate}


def write_result_file(path: str | Path, runs: list[dict[str, Any]],
                      command_line: list[str]) -> None:
    """The JSON result file: when and how it ran, then every run."""
    document = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command_line": command_line,
                "host": platform.node(), "runs": runs}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


def format_rate(rate: float | str) -> str:
    return "inf" if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else f"{rate:g}"


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_run(run: dict[str, Any]) -> str:
    """One run as a vertical block, like `vllm bench serve` prints."""
    concurrency = run["max_concurrency"] or "unlimited"
    title = f" {run['label']} @ {format_rate(run['request_rate'])} QPS, concurrency {concurrency} "
    errors = ", ".join(f"{kind} x{count}" for kind, count in run["error_counts"].items()) or "none"
    rows = [
        ("Requests sent / completed / failed", f"{run['sent']} / {run['completed']} / "
                                               f"{run['failed']}"),
        ("Failures", errors),
        ("Duration (s)", _number(run["duration"], 2)),
        ("Total input / output tokens", f"{run['total_input_tokens']} / "
                                        f"{run['total_output_tokens']}"),
        ("Request throughput (req/s)", _number(run["request_throughput"], 2)),
        ("Output token throughput (tok/s)", _number(run["output_throughput"], 2)),
        ("Total token throughput (tok/s)", _number(run["total_token_throughput"], 2)),
    ]
    if run["request_goodput"] is not None:
        slos = " ".join(f"{m}<={v:g}ms" for m, v in run["goodput_slos_ms"].items())
        rows.append((f"Goodput, {slos} (req/s)", _number(run["request_goodput"], 2)))
    if run["metrics_available"]:
        rows.append(("Speculation (server /metrics)", str(run["spec_method"])))
        rows.append(("Acceptance rate α", _number(run["acceptance_rate"], 3)))
        rows.append(("Block efficiency τ", _number(run["mean_acceptance_length"], 2)))
        rows.append(("Prefix cache hit rate", _number(run["prefix_cache_hit_rate"], 3)))
    else:
        rows.append(("Speculation", "no /metrics on the server"))
    lines = [f"{title:=^{TABLE_WIDTH}}"] + [f"{name + ':':<46}{value}" for name, value in rows]
    lines.append(f"{'Latency (ms)':<16}{'mean':>13}{'p50':>13}{'p90':>13}{'p99':>13}")
    for metric in LATENCY_METRICS:
        values = [run[f"{stat}_{metric}_ms"] for stat in ("mean", "p50", "p90", "p99")]
        lines.append(f"{metric.upper():<16}" + "".join(f"{_number(v):>13}" for v in values))
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)


SUMMARY_COLUMNS = (
    # header, width, how to read the run
    ("label", 12, lambda r: str(r["label"])[:12]),
    ("QPS", 6, lambda r: format_rate(r["request_rate"])),
    ("conc", 5, lambda r: str(r["max_concurrency"] or "-")),
    ("ok/sent", 8, lambda r: f"{r['completed']}/{r['sent']}"),
    ("req/s", 7, lambda r: _number(r["request_throughput"], 2)),
    ("tok/s", 7, lambda r: _number(r["output_throughput"], 1)),
    ("good/s", 7, lambda r: _number(r["request_goodput"], 2)),
    ("TTFT p50", 9, lambda r: _number(r["p50_ttft_ms"], 0)),
    ("TTFT p99", 9, lambda r: _number(r["p99_ttft_ms"], 0)),
    ("TPOT p50", 9, lambda r: _number(r["p50_tpot_ms"], 1)),
    ("ITL p50", 8, lambda r: _number(r["p50_itl_ms"], 1)),
    ("E2E p50", 8, lambda r: _number(r["p50_e2el_ms"], 0)),
    ("E2E p99", 8, lambda r: _number(r["p99_e2el_ms"], 0)),
    ("α", 6, lambda r: _number(r["acceptance_rate"], 3)),
    ("τ", 5, lambda r: _number(r["mean_acceptance_length"], 2)),
)


def format_summary(runs: list[dict[str, Any]]) -> str:
    """One row per run (latencies in ms), for sweeps and comparisons."""
    header = " ".join(f"{name:>{width}}" for name, width, _ in SUMMARY_COLUMNS)
    rows = [" ".join(f"{read(run):>{width}}" for _, width, read in SUMMARY_COLUMNS)
            for run in runs]
    return "\n".join([header, "-" * len(header), *rows])
