"""The load tester against a real `specserve serve` (embedded model, n-gram speculation) on
127.0.0.1 for a few seconds: the CLI as a user runs it, then compare mode's orchestration."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from live_server import LiveServer

import loadtest.cli
from loadtest.report import PER_REQUEST_FIELDS, RUN_FIELDS

# a live embedded server under load: the full suite's
pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
ROOT = Path(__file__).resolve().parents[2]
# names a `vllm bench serve` reader expects, beside our own list
VLLM_FIELDS = ("duration", "completed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
               "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
               "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
               "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


@pytest.fixture(scope="module")
def server():
    with LiveServer(["--speculative-config", json.dumps(NGRAM)]) as live:
        yield live


def check_run(run: dict) -> None:
    """Every field present and the numbers consistent with each other."""
    missing = (set(RUN_FIELDS) | set(PER_REQUEST_FIELDS) | set(VLLM_FIELDS)) - set(run)
    assert not missing, missing
    assert run["completed"] + run["failed"] == run["sent"]
    assert run["sent"] <= run["max_requests"]
    assert len(run["errors"]) == run["failed"]
    for name in PER_REQUEST_FIELDS:
        assert len(run[name]) == run["completed"], name
    assert run["total_output_tokens"] == sum(run["output_lens"])
    assert run["total_input_tokens"] == sum(run["input_lens"])
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration"])
    assert run["request_throughput"] == pytest.approx(run["completed"] / run["duration"])
    assert 0 < run["duration"] <= run["duration_limit_s"] + 5
    for metric in ("ttft", "tpot", "itl", "e2el"):
        p50, p90, p99 = (run[f"p{p}_{metric}_ms"] for p in (50, 90, 99))
        assert p50 <= p90 <= p99, metric
    for ttft, e2el, itls, output_len in zip(run["ttfts"], run["e2els"], run["itls"],
                                            run["output_lens"]):
        assert 0 < ttft <= e2el
        assert len(itls) <= output_len - 1  # a chunk may carry several (speculated) tokens


def test_a_short_run_against_specserve(server, tmp_path):
    result_path = tmp_path / "result.json"
    completed = subprocess.run(
        [sys.executable, "-m", "loadtest", "--base-url", server.api, "--num-requests", "6",
         "--max-tokens", "16", "--qps", "4", "--duration", "25", "--goodput", "ttft:60000",
         "--result-json", str(result_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert completed.returncode == 0, completed.stderr
    assert "Requests sent / completed / failed" in completed.stdout
    (run,) = json.loads(result_path.read_text())["runs"]
    check_run(run)
    assert run["completed"] >= 1
    assert run["spec_method"] == "ngram" and run["label"] == "ngram"
    assert run["num_draft_tokens"] > 0
    assert 0.0 <= run["acceptance_rate"] <= 1.0
    assert 1.0 <= run["mean_acceptance_length"] <= NGRAM["num_speculative_tokens"] + 1
    assert all(0.0 <= share <= 1.0 for share in run["acceptance_rate_per_position"])
    assert run["request_goodput"] <= run["request_throughput"]


def test_compare_mode_sends_the_same_requests_to_each_configuration(server, tmp_path,
                                                                     monkeypatch):
    """Launching a server per configuration costs ~30 s each here, so this test stands the live
    server in for every launch; test_compare.py covers the launch and SIGTERM themselves."""
    launched = []

    @contextmanager
    def stand_in(config, serve_args):
        launched.append((config, serve_args))
        yield type("Launched", (), {"base_url": server.url})()

    monkeypatch.setattr(loadtest.cli, "LaunchedServer", stand_in)
    result_path, plot_dir = tmp_path / "compare.json", tmp_path / "plots"
    exit_code = loadtest.cli.main([
        "--compare", "none", "ngram", "--serve-args", "--num-threads 1", "--num-requests", "2",
        "--max-tokens", "8", "--qps", "inf", "--concurrency", "2", "--duration", "25",
        "--result-json", str(result_path), "--plot-dir", str(plot_dir)])
    assert exit_code == 0
    assert [(config.label, args) for config, args in launched] == [
        ("none", ["--num-threads", "1"]), ("ngram", ["--num-threads", "1"])]
    runs = json.loads(result_path.read_text())["runs"]
    assert [run["label"] for run in runs] == ["none", "ngram"]
    assert runs[1]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    for run in runs:
        check_run(run)
        assert run["completed"] == 2
    assert runs[0]["input_lens"] == runs[1]["input_lens"]  # the same requests each time
    for name in ("latency.png", "throughput.png", "acceptance.png", "summary.png"):
        assert (plot_dir / name).read_bytes()[:4] == b"\x89PNG"
