"""deploy/kubernetes: every built-in object validated offline against the Kubernetes JSON schemas
(kubernetes-validate ships them), and the objects' wiring checked against each other, the image and
the metrics the server really exports; the tensor-parallel Deployment (tensor-parallel/) checked as a
drop-in for the one-GPU one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engine.spec_config import SpeculativeConfig
from server.cli import build_parser, main

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# the oldest release we claim to support, and the newest the validator knows
KUBERNETES_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
CUSTOM_RESOURCE_KINDS = {"ServiceMonitor"}  # CRDs: no schema in kubernetes-validate
# applied instead of deployment.yaml, so kept out of `kubectl apply -f deploy/kubernetes/`
TENSOR_PARALLEL = KUBERNETES / "tensor-parallel" / "deployment-tensor-parallel.yaml"
BINARY_UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def manifests() -> dict[str, dict]:
    """kind -> object, over every YAML file `kubectl apply -f deploy/kubernetes/` would apply."""
    objects = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            assert document["kind"] not in objects, f"two {document['kind']} objects"
            objects[document["kind"]] = document
    return objects


def pod_spec() -> dict:
    return manifests()["Deployment"]["spec"]["template"]["spec"]


def container() -> dict:
    [only] = pod_spec()["containers"]
    return only


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_built_in_objects_match_the_kubernetes_schemas(version):
    objects = manifests()
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim",
            "ServiceMonitor"} <= set(objects)
    for kind, document in objects.items():
        if kind not in CUSTOM_RESOURCE_KINDS:
            # strict: an unknown or misspelt field fails too
            kubernetes_validate.validate(document, version, strict=True)


def test_the_validator_rejects_a_broken_deployment():
    """Guards the test above against a validator that accepts anything."""
    broken = json.loads(json.dumps(manifests()["Deployment"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)
    broken = json.loads(json.dumps(manifests()["Deployment"]))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=False)


def test_deployment_runs_the_image_user_with_a_gpu_and_the_model_volume(dockerfile):
    gpu = dockerfile.stage("gpu")
    uid, _, gid = gpu.all("USER")[-1].partition(":")
    security = pod_spec()["securityContext"]
    assert security["runAsNonRoot"] is True
    assert (str(security["runAsUser"]), str(security["runAsGroup"])) == (uid, gid)
    assert container()["resources"]["limits"]["nvidia.com/gpu"] == 1
    [mount] = container()["volumeMounts"]
    assert mount["mountPath"] == "/models" and mount["readOnly"] is True
    [volume] = pod_spec()["volumes"]
    assert volume["name"] == mount["name"]
    assert volume["persistentVolumeClaim"]["claimName"] == manifests()[
        "PersistentVolumeClaim"]["metadata"]["name"]
    args = container()["args"]
    assert flag_value(args, "--model").startswith(mount["mountPath"] + "/")


def test_deployment_args_pass_every_check_before_loading(dockerfile, capsys):
    """`args` follow the image's ENTRYPOINT: the real CLI accepts them up to the model folder,
    which only the cluster's volume holds."""
    args = container()["args"]
    SpeculativeConfig.from_json(flag_value(args, "--speculative-config"))
    assert main([*dockerfile.stage("gpu").specserve_args(), *args]) == 2
    assert f"--model {flag_value(args, '--model')}: no such file" in capsys.readouterr().err


def test_probes_hit_health_on_the_served_port_and_the_drain_fits_the_grace_period(dockerfile):
    served = build_parser().parse_args([*dockerfile.stage("gpu").specserve_args(),
                                        *container()["args"]])
    [port] = container()["ports"]
    assert port["containerPort"] == served.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http_get = container()[probe]["httpGet"]
        assert http_get["path"] == "/health" and http_get["port"] == port["name"], probe
    # SIGTERM comes after preStop; the server then drains for up to --drain-timeout seconds
    pre_stop = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert int(pre_stop[1]) + served.drain_timeout < pod_spec()["terminationGracePeriodSeconds"]
    # the API key comes from a Secret (the CLI reads SPECSERVE_API_KEY), and fails closed: a pod
    # whose Secret is missing does not start (an empty key is refused by the CLI, see
    # tests/server/test_api_key_config.py)
    [api_key] = container()["env"]
    assert api_key["name"] == "SPECSERVE_API_KEY"
    secret_ref = api_key["valueFrom"]["secretKeyRef"]
    assert secret_ref["optional"] is False
    assert (secret_ref["name"], secret_ref["key"]) == ("specserve-api-key", "api-key")


def test_service_and_service_monitor_select_the_pods():
    objects = manifests()
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selector = objects["Deployment"]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    service = objects["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [service_port] = service["spec"]["ports"]
    assert service_port["targetPort"] == container()["ports"][0]["name"]

    monitor = objects["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    monitor_selector = monitor["spec"]["selector"]["matchLabels"]
    assert monitor_selector.items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"]
    assert endpoint["path"] == "/metrics"
    assert re.fullmatch(r"\d+s", endpoint["interval"])


def test_autoscaler_scales_the_deployment_on_a_metric_the_adapter_serves(exported_metric_names):
    objects = manifests()
    hpa = objects["HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    deployment_name = objects["Deployment"]["metadata"]["name"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment_name)
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    hpa_metric_name = metric["pods"]["metric"]["name"]

    # prometheus-adapter renames the Prometheus series into the custom metrics API name
    values = yaml.safe_load((KUBERNETES / "prometheus-adapter" / "values.yaml").read_text())
    [rule] = values["rules"]["custom"]
    series = re.match(r"[\w:]+", rule["seriesQuery"]).group(0)
    assert series == "specserve:num_requests_waiting"
    assert series in exported_metric_names
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert renamed == hpa_metric_name
    assert rule["resources"]["overrides"]["pod"]["resource"] == "pod"


# ---------------------------------------------------------------- tensor-parallel/: -tp 8 per pod


def tp_deployment() -> dict:
    [document] = yaml.safe_load_all(TENSOR_PARALLEL.read_text())
    return document


def tp_pod_spec() -> dict:
    return tp_deployment()["spec"]["template"]["spec"]


def tp_container() -> dict:
    [only] = tp_pod_spec()["containers"]
    return only


def tp_served(dockerfile):
    """The TP container's command line as `specserve serve` parses it (image ENTRYPOINT + args)."""
    return build_parser().parse_args([*dockerfile.stage("gpu").specserve_args(),
                                      *tp_container()["args"]])


def quantity_bytes(quantity: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(quantity))
    assert match, f"not a binary quantity: {quantity!r}"
    return int(match.group(1)) * BINARY_UNITS[match.group(2) or ""]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_tensor_parallel_deployment_matches_the_kubernetes_schemas(version):
    deployment = tp_deployment()
    assert deployment["kind"] == "Deployment"
    kubernetes_validate.validate(deployment, version, strict=True)


def test_tensor_parallel_deployment_replaces_the_one_gpu_deployment():
    """Same name, labels and port as deployment.yaml, so the Service, ServiceMonitor and autoscaler
    serve it unchanged; and outside deploy/kubernetes/'s top level, where a second Deployment of
    that name would silently override (or be overridden by) the first one on `kubectl apply -f`."""
    assert TENSOR_PARALLEL.parent != KUBERNETES
    assert TENSOR_PARALLEL.name not in {path.name for path in KUBERNETES.glob("*.yaml")}
    objects = manifests()
    one_gpu, tp = objects["Deployment"], tp_deployment()
    assert tp["metadata"] == one_gpu["metadata"]
    assert tp["spec"]["selector"] == one_gpu["spec"]["selector"]
    pod_labels = tp["spec"]["template"]["metadata"]["labels"]
    assert tp["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert objects["Service"]["spec"]["selector"].items() <= pod_labels.items()
    [service_port] = objects["Service"]["spec"]["ports"]
    [port] = tp_container()["ports"]
    assert service_port["targetPort"] == port["name"]
    target = objects["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", tp["metadata"]["name"])


def test_tensor_parallel_pod_runs_one_rank_per_gpu_on_one_node(dockerfile):
    served = tp_served(dockerfile)
    gpus = tp_container()["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == 8
    assert served.tensor_parallel_size == gpus
    # one pod is one node: all ranks are local, meeting over loopback on a free port
    assert (served.nnodes, served.node_rank, served.master_port) == (1, 0, None)
    spec = SpeculativeConfig.from_json(flag_value(tp_container()["args"], "--speculative-config"))
    assert spec.draft_tensor_parallel_size == 1


def test_tensor_parallel_args_pass_every_check_before_loading(dockerfile, capsys):
    """The real CLI takes `-tp 8` with the rest (the parallel config is checked before the model
    path), up to the model folder, which only the cluster's volume holds."""
    args = tp_container()["args"]
    assert main([*dockerfile.stage("gpu").specserve_args(), *args]) == 2
    assert f"--model {flag_value(args, '--model')}: no such file" in capsys.readouterr().err


def test_tensor_parallel_pod_mounts_memory_backed_dev_shm_and_the_models():
    mounts = {mount["mountPath"]: mount for mount in tp_container()["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in tp_pod_spec()["volumes"]}
    assert set(mounts) == {"/models", "/dev/shm"}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"  # NCCL needs more than a container's 64Mi
    assert not mounts["/dev/shm"].get("readOnly", False)
    # a memory-backed emptyDir counts against the container's memory limit
    shm_bytes = quantity_bytes(shm["emptyDir"]["sizeLimit"])
    assert 1 * 2**30 <= shm_bytes < quantity_bytes(tp_container()["resources"]["limits"]["memory"])
    models = volumes[mounts["/models"]["name"]]
    assert mounts["/models"]["readOnly"] is True
    assert models["persistentVolumeClaim"]["claimName"] == manifests()[
        "PersistentVolumeClaim"]["metadata"]["name"]
    assert flag_value(tp_container()["args"], "--model").startswith("/models/")


def test_tensor_parallel_probes_hit_health_on_the_served_port(dockerfile):
    served = tp_served(dockerfile)
    [port] = tp_container()["ports"]
    assert port["containerPort"] == served.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http_get = tp_container()[probe]["httpGet"]
        assert http_get["path"] == "/health" and http_get["port"] == port["name"], probe
    pre_stop = tp_container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert int(pre_stop[1]) + served.drain_timeout < tp_pod_spec()["terminationGracePeriodSeconds"]


def test_tensor_parallel_pod_keeps_the_one_gpu_pods_security_and_secret():
    """What TP does not change stays as deployment.yaml has it (tested there)."""
    for key in ("securityContext", "tolerations", "terminationGracePeriodSeconds"):
        assert tp_pod_spec()[key] == pod_spec()[key], key
    for key in ("image", "env", "ports", "readinessProbe", "livenessProbe", "lifecycle",
                "securityContext"):
        assert tp_container()[key] == container()[key], key
    assert tp_deployment()["spec"]["strategy"] == manifests()["Deployment"]["spec"]["strategy"]
