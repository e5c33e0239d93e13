"""Run a built image and check it as a user would (README "Docker"): `docker run` starts the server,
/health turns 200, the openai SDK gets a completion and a streamed chat answer, /metrics scrapes,
the container runs as its non-root user, Docker's HEALTHCHECK reports healthy, and SIGTERM drains a
request in flight before the container exits 0. Prints the image's size and the time from
`docker run` to the first answer. Needs a Docker engine; not part of the test suite.

    python deploy/check_image.py specserve:cpu [--network host] [--port 8000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import httpx
import openai

MODEL = "SmolLM2-135M-Instruct"


def docker(*args: str, check: bool = True) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout.strip()


def wait_for(what: str, ready, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def health(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def check(image: str, network: str, port: int) -> dict:
    report: dict = {"image": image,
                    "size_mb": round(int(docker("image", "inspect", image, "--format",
                                                "{{.Size}}")) / 1e6)}
    # NOTE: with --network host the server's own port is the host's: it is given --port, which
    # the HEALTHCHECK follows (server/healthcheck.py)
    publish = [] if network == "host" else ["-p", f"127.0.0.1:{port}:8000"]
    port_flag = ["--port", str(port)] if network == "host" else []
    start = time.monotonic()
    container = docker("run", "-d", "--network", network, *publish, image,
                       "--drain-timeout", "30", *port_flag)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        wait_for("/health 200", lambda: health(url), 300)
        report["health_200_s"] = round(time.monotonic() - start, 1)
        completion = client.completions.create(model=MODEL, prompt="The capital of France is",
                                               max_tokens=8, temperature=0)
        report["start_to_first_answer_s"] = round(time.monotonic() - start, 1)
        report["completion"] = completion.choices[0].text
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello in French."}],
            max_tokens=16, temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        report["streamed_chat"] = {"chunks": len(pieces), "text": "".join(pieces)}
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        report["metrics_scraped"] = {name: name in metrics for name in (
            "specserve:num_requests_running", "specserve:spec_decode_num_draft_tokens_total")}
        report["user"] = {"configured": docker("inspect", container, "--format",
                                               "{{.Config.User}}"),
                          "running_uid": docker("exec", container, "id", "-u")}
        report["healthcheck"] = wait_for(
            "HEALTHCHECK healthy", lambda: _healthy(container), 120, interval=2)
        report["sigterm"] = _stop_during_a_request(container, client)
    finally:
        report["logs_tail"] = docker("logs", "--tail", "5", container, check=False)
        docker("rm", "-f", container, check=False)
    return report


def _healthy(container: str) -> str | None:
    status = docker("inspect", container, "--format", "{{.State.Health.Status}}")
    return status if status == "healthy" else None


def _stop_during_a_request(container: str, client: openai.OpenAI) -> dict:
    """SIGTERM (docker stop) while a streamed answer is being written: it finishes or ends with an
    error, and the container exits 0 once drained."""
    outcome: dict = {}

    def stream() -> None:
        try:
            chunks = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Write a long story."}],
                max_tokens=200, temperature=0, stream=True)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices]
            outcome["in_flight"] = f"finished: {[f for f in finish if f]}"
        except Exception as error:  # the server may cut it short: it must say so
            outcome["in_flight"] = f"error: {type(error).__name__}: {error}"

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(1.0)
    stopped = time.monotonic()
    docker("stop", "--time", "40", container)
    outcome["stop_s"] = round(time.monotonic() - stopped, 1)
    thread.join(timeout=60)
    outcome["exit_code"] = int(docker("inspect", container, "--format", "{{.State.ExitCode}}"))
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image")
    parser.add_argument("--network", default="bridge",
                        help="host where Docker has no bridge network (dockerd --bridge=none)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    report = check(args.image, args.network, args.port)
    print(json.dumps(report, indent=2, ensure_ascii=False))
    ok = (report["user"]["running_uid"] != "0" and report["healthcheck"] == "healthy"
          and all(report["metrics_scraped"].values()) and report["sigterm"]["exit_code"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
