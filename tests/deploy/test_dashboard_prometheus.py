"""Every PromQL query of the Grafana dashboard, run by a real Prometheus that scraped a live
specserve (started with deploy/compose.yaml's command line), must return finite series: a typo in a
metric or label name, or a ratio that never has data, fails here rather than as an empty panel."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from live_server import LiveServer
from prometheus_server import PrometheusServer, find_prometheus_binary

# NOTE: CI sets SPECSERVE_REQUIRE_PROMETHEUS=1 (.ci/run installs the package), so there a missing
# binary fails instead of skipping
# a live server of its own: the full suite's
pytestmark = [
    pytest.mark.skipif(
        find_prometheus_binary() is None and not os.environ.get("SPECSERVE_REQUIRE_PROMETHEUS"),
        reason="needs the prometheus binary (apt-get install -y prometheus; .ci/run installs it)"),
    pytest.mark.slow,
]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# What Grafana puts in for its built-in variables on a short time range. Any window works as long
# as it holds two scrapes; one minute covers everything this test sends.
GRAFANA_INTERVALS = {"$__rate_interval": "1m", "$__range": "1m"}
# prompts that invite the model to repeat itself, so n-gram drafts get proposed and accepted
PROMPTS = ["Repeat exactly, twice: the quick brown fox jumps over the lazy dog.",
           "Copy this list exactly: red, green, blue, red, green, blue, red, green, blue.",
           "Count from one to ten in words, then count from one to ten again."]
QUERY_DEADLINE_S = 60.0


def grafana_regex_value(value: str) -> str:
    """A single selected value of a regex-matched variable, escaped as Grafana's Prometheus data
    source does (the backslash doubled inside the PromQL string)."""
    return re.sub(r"[$^*{}\[\]'+?.()|\\]", lambda m: "\\\\" + m.group(0), value)


def interpolate(expr: str, model: str) -> str:
    for variable, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(variable, value)
    expr = expr.replace("$model", grafana_regex_value(model))
    assert "$" not in expr, f"a variable this test does not fill: {expr}"
    return expr


def chat(server: LiveServer, model: str, content: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{server.api}/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0})


def provoke_queue_full(server: LiveServer, model: str) -> None:
    """Bursts of concurrent requests against a one-request waiting queue, until one gets 429, so
    the rejection series exists (it is created on the first rejection)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(5):
            codes = list(pool.map(lambda n: chat(server, model, f"Say {n}.", 4).status_code,
                                  range(8)))
            if 429 in codes:
                return
    pytest.fail(f"no 429 from a waiting queue of one under 8 concurrent requests: {codes}")


def finite_series(result: list[dict]) -> bool:
    return bool(result) and all(math.isfinite(float(s["value"][1])) for s in result)


def test_every_dashboard_query_returns_series_from_a_scraped_server(dashboard, dashboard_targets,
                                                                    dockerfile):
    command = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["specserve"][
        "command"]
    # NOTE: a waiting queue of one, so a burst can provoke the 429s the QPS panel plots
    with LiveServer([*command, "--max-waiting-requests", "1"]) as server, \
            PrometheusServer(f"127.0.0.1:{server.port}", scrape_interval_s=1.0) as prometheus:
        # the image's HEALTHCHECK command, pointed at this server, passes
        healthcheck = [part.replace(":8000/", f":{server.port}/")
                       for part in dockerfile.stage("cpu").healthcheck_command()]
        assert subprocess.run([sys.executable, *healthcheck[1:]], timeout=10).returncode == 0

        [model] = [entry["id"] for entry in httpx.get(f"{server.api}/models").json()["data"]]
        # a scrape before any traffic, so every rate() sees the counters grow from there
        prometheus.wait_for_number("sum(specserve:request_success_total)", timeout_s=15)
        for prompt in PROMPTS:
            chat(server, model, prompt, max_tokens=32).raise_for_status()
        # the first prompt again: its blocks are cached, so the hit-rate panel has hits to plot
        chat(server, model, PROMPTS[0], max_tokens=4).raise_for_status()
        assert server.metric("specserve:prefix_cache_hits_total") > 0, \
            "a repeated prompt found nothing in the prefix cache"
        assert server.metric("specserve:spec_decode_num_draft_tokens_total") > 0, \
            "no drafts proposed: α, τ and the per-position panels would have no data"
        provoke_queue_full(server, model)
        prometheus.wait_for_number("sum(specserve:request_rejected_total)", timeout_s=15)
        time.sleep(2.5)  # two more scrapes, so every counter has two samples after the traffic

        # the `model` variable: label_values(metric, model_name), as Grafana asks for it
        [variable] = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
        metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)",
                                     variable["definition"]).groups()
        values = {s["metric"][label] for s in prometheus.query(f"group by ({label}) ({metric})")}
        assert values == {model}

        failures = {}
        deadline = time.monotonic() + QUERY_DEADLINE_S
        for title, target in dashboard_targets:
            expr = interpolate(target["expr"], model)
            while not finite_series(result := prometheus.query(expr)) and \
                    time.monotonic() < deadline:
                time.sleep(0.5)
            if not finite_series(result):
                failures[f"{title} [{target['refId']}]"] = (expr, result)
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
