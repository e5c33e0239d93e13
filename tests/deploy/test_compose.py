"""deploy/compose.yaml (+ compose.gpu.yaml) parsed, and its wiring followed end to end: the image
it builds, the address Prometheus scrapes, the data source and dashboards Grafana is given."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from server.cli import build_parser, main

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def compose_file(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def interpolate(value: str, environment: dict[str, str]) -> str:
    """Compose's ${NAME}, ${NAME:-default} and ${NAME:?error} substitution."""

    def substitute(match: re.Match) -> str:
        name, operator, operand = match.group(1), match.group(2), match.group(3)
        if name in environment:
            return environment[name]
        if operator == ":?":
            raise KeyError(f"{name}: {operand}")
        return operand or ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", substitute, value)


def volume_mounts(service: dict) -> dict[str, str]:
    """container path -> host path (relative to deploy/) for bind mounts; named volumes skipped."""
    mounts = {}
    for volume in service.get("volumes", []):
        host, container = interpolate(volume, {}).split(":")[:2]
        if host.startswith((".", "/", "$")):
            mounts[container] = host
    return mounts


def published_container_ports(service: dict) -> set[int]:
    return {int(str(port).rsplit(":", 1)[1]) for port in service.get("ports", [])}


def test_specserve_is_built_from_the_repository_dockerfile(dockerfile):
    service = compose_file("compose.yaml")["services"]["specserve"]
    context = (DEPLOY / service["build"]["context"]).resolve()
    assert (context / service["build"]["dockerfile"]).resolve() == DEPLOY.parent / "Dockerfile"
    assert service["build"]["target"] == "cpu"
    assert dockerfile.stage("cpu")  # the target exists
    gpu_override = compose_file("compose.gpu.yaml")["services"]["specserve"]
    assert dockerfile.stage(gpu_override["build"]["target"]).base_image
    assert gpu_override["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == [
        "gpu"]
    # the drain (--drain-timeout) fits in the time compose waits after SIGTERM
    for command in (service["command"], gpu_override["command"]):
        drain_s = float(command[command.index("--drain-timeout") + 1])
        assert drain_s < float(service["stop_grace_period"].removesuffix("s"))


def test_prometheus_scrapes_the_specserve_service(dockerfile):
    compose = compose_file("compose.yaml")
    prometheus = compose["services"]["prometheus"]
    config_flag = next(flag for flag in prometheus["command"] if flag.startswith("--config.file="))
    config_path = volume_mounts(prometheus)[config_flag.split("=", 1)[1]]
    config = yaml.safe_load((DEPLOY / config_path).read_text())
    [job] = config["scrape_configs"]
    [target] = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in compose["services"]
    specserve = compose["services"][host]
    served = build_parser().parse_args(
        dockerfile.stage(specserve["build"]["target"]).specserve_args())
    assert int(port) == served.port
    assert int(port) in published_container_ports(specserve)
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert "specserve" in prometheus["depends_on"]


def test_grafana_gets_the_prometheus_data_source_and_the_dashboard(dashboard):
    compose = compose_file("compose.yaml")
    grafana = compose["services"]["grafana"]
    mounts = volume_mounts(grafana)
    provisioning = DEPLOY / mounts["/etc/grafana/provisioning"]

    [datasource] = yaml.safe_load(
        (provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    url = urlparse(datasource["url"])
    assert url.hostname in compose["services"] and url.hostname == "prometheus"
    assert url.port in published_container_ports(compose["services"][url.hostname])
    # the dashboard's data source variable defaults to the provisioned uid
    [variable] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["current"]["value"] == datasource["uid"]
    scrape_interval = yaml.safe_load(
        (DEPLOY / "prometheus" / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == scrape_interval

    [provider] = yaml.safe_load(
        (provisioning / "dashboards" / "specserve.yaml").read_text())["providers"]
    dashboards_on_host = DEPLOY / mounts[provider["options"]["path"]]
    assert (dashboards_on_host / "specserve.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/specserve.json"
    assert "prometheus" in grafana["depends_on"]


def test_every_bind_mount_and_named_volume_exists():
    for name in ("compose.yaml", "compose.gpu.yaml"):
        compose = compose_file(name)
        for service in compose["services"].values():
            for volume in service.get("volumes", []):
                host = interpolate(volume, {}).split(":")[0]
                if host == "./models":
                    continue  # the default home of the GPU user's own model folders
                if host.startswith((".", "/")):
                    assert (DEPLOY / host).exists(), f"{name}: {host}"
                else:
                    assert host in compose_file("compose.yaml")["volumes"], f"{name}: {host}"


def test_gpu_command_line_passes_every_check_before_loading(dockerfile, capsys):
    """The override's command, interpolated as compose would, goes through the real CLI up to the
    model folder that exists only on the GPU host."""
    command = compose_file("compose.gpu.yaml")["services"]["specserve"]["command"]
    argv = [interpolate(part, {"SPECSERVE_MODEL": "Llama-3.1-8B-Instruct"}) for part in command]
    with pytest.raises(KeyError, match="SPECSERVE_MODEL"):
        [interpolate(part, {}) for part in command]  # compose refuses to start without it
    assert main([*dockerfile.stage("gpu").specserve_args(), *argv]) == 2
    assert "--model /models/Llama-3.1-8B-Instruct: no such file" in capsys.readouterr().err


def test_prometheus_config_passes_promtool():
    promtool = shutil.which("promtool")  # ships with the Debian prometheus package
    if promtool is None and not os.environ.get("SPECSERVE_REQUIRE_PROMETHEUS"):
        pytest.skip("needs promtool (apt-get install -y prometheus; .ci/run installs it)")
    assert promtool, "promtool missing although SPECSERVE_REQUIRE_PROMETHEUS is set"
    config = DEPLOY / "prometheus" / "prometheus.yml"
    result = subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
