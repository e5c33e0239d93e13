"""Readers for the deployment files (Dockerfile, Grafana dashboard, pyproject), given to the tests
in this folder as fixtures, so each test states a property rather than how to parse a file.
(Fixtures, not imports: under --import-mode=importlib a conftest is not an importable module.)"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Instruction:
    keyword: str  # upper case, e.g. "RUN"
    arguments: str  # the rest of the logical line, continuations joined


@dataclass
class Stage:
    name: str
    base_image: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [i.arguments for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> str:
        [arguments] = self.all(keyword)
        return arguments

    def exec_form(self, keyword: str) -> list[str]:
        """A JSON-array instruction (ENTRYPOINT, CMD) as its argv."""
        return json.loads(self.one(keyword))

    def build_args(self) -> dict[str, str]:
        """`ARG NAME=default` values declared in this stage."""
        return dict(arg.split("=", 1) for arg in self.all("ARG") if "=" in arg)

    def specserve_args(self) -> list[str]:
        """The ENTRYPOINT's arguments to the `specserve` program (after any init such as tini)."""
        entrypoint = self.exec_form("ENTRYPOINT")
        return entrypoint[entrypoint.index("specserve") + 1:]

    def healthcheck_command(self) -> list[str]:
        """The argv of `HEALTHCHECK [options] CMD [...]`."""
        _, _, command = self.one("HEALTHCHECK").partition("CMD ")
        return json.loads(command)

    def healthcheck_options(self) -> dict[str, str]:
        options, _, _ = self.one("HEALTHCHECK").partition("CMD ")
        return dict(option.removeprefix("--").split("=", 1) for option in shlex.split(options))


@dataclass
class Dockerfile:
    global_args: dict[str, str]  # ARG defaults declared before the first FROM
    stages: list[Stage]  # in file order; the last is what `docker build .` builds

    def stage(self, name: str) -> Stage:
        [found] = [stage for stage in self.stages if stage.name == name]
        return found


def read_dockerfile(path: Path) -> Dockerfile:
    """Comments dropped, `\\` continuations joined, instructions grouped by stage."""
    logical_lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        logical_lines.append(pending + line)
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines:
        keyword, _, arguments = line.partition(" ")
        keyword, arguments = keyword.upper(), arguments.strip()
        if keyword == "FROM":
            parts = re.split(r"\s+as\s+", arguments, flags=re.IGNORECASE)
            image, name = parts[0], parts[1] if len(parts) > 1 else str(len(stages))
            stages.append(Stage(name=name, base_image=image))
        elif not stages:
            if keyword == "ARG" and "=" in arguments:
                arg_name, default = arguments.split("=", 1)
                global_args[arg_name] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, arguments))
    return Dockerfile(global_args, stages)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def dockerfile() -> Dockerfile:
    return read_dockerfile(ROOT / "Dockerfile")


@pytest.fixture(scope="session")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    return json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "specserve.json").read_text())


@pytest.fixture(scope="session")
def dashboard_targets(dashboard) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every query of every panel, rows included."""
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            found += [(inner["title"], target) for target in inner.get("targets", [])]
    return found


@pytest.fixture(scope="session")
def load_yaml():
    """`load_yaml(path)` -> the documents of a YAML file (empty ones dropped)."""
    def load(path: Path) -> list[Any]:
        return [document for document in yaml.safe_load_all(path.read_text()) if document]
    return load


@pytest.fixture(scope="session")
def exported_metric_names() -> set[str]:
    """Every sample name /metrics can show: a fresh ServerMetrics after one of each event, so that
    series created on first use (rejections by code) appear too."""
    from engine.messages import StepStats
    from server.metrics import ServerMetrics

    metrics = ServerMetrics("m", "ngram", num_speculative_tokens=3)
    metrics.observe_step(StepStats(num_running=1, num_generation_tokens=2, num_drafts=1,
                                   num_draft_tokens=3, num_accepted_tokens=1,
                                   accepted_per_position=[1, 0, 0], accepted_lengths=[1]))
    metrics.request_finished(ttft=0.1, inter_token_latencies=[0.01], e2e=0.2, num_prompt_tokens=5,
                             num_generation_tokens=2, finish_reason="stop")
    metrics.request_rejected(429)
    body, _ = metrics.render()
    return {line.split("{")[0].split(" ")[0] for line in body.decode().splitlines()
            if line and not line.startswith("#")}
