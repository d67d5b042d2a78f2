"""The Kubernetes manifests (deploy/k8s), checked offline as CI can (no cluster): each overlay
renders with `kubectl kustomize`, every built-in resource validates strictly against the
Kubernetes API's schemas (kubernetes-validate bundles them; its command line too, as
`kubectl kustomize ... | kubernetes-validate`), the autoscaler reads a metric the gateway exports,
from a Prometheus the manifests point at the gateway with the read-only metrics credential, and
scales the StatefulSet the gateway follows; the sites' readiness survives a slow answer; and
the gateway's own files in the ConfigMap are what its parsers accept."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.federation import parse_federation
from gateway.metrics import SCALING_GAUGES, ModelCapacity
from gateway.scaling.config import parse_scaling
from tests.conftest import REPO_ROOT

K8S = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ("keda", "hpa")
# The oldest Kubernetes the manifests are for (gRPC probes are GA from 1.27), and the newest.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
NOT_BUILT_IN = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
}
# The command line kubernetes-validate installs, beside this interpreter.
VALIDATE_CLI = Path(sys.executable).with_name("kubernetes-validate")


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl is missing: .ci/run installs it (Debian: kubernetes-client)")
        pytest.skip("no kubectl here (Debian: apt-get install kubernetes-client)")
    return found


@cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return render(K8S / "overlays" / overlay)


def render(directory: Path) -> tuple[dict[str, Any], ...]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, [d["kind"] for d in docs])
    return found[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_built_in_resource_validates_strictly(overlay: str, version: str) -> None:
    docs = rendered(overlay)
    checked = 0
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in NOT_BUILT_IN:
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 7
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"fedllm"}


def test_a_mistake_is_caught() -> None:
    """The validation is not vacuous: a misspelt field in the StatefulSet is refused."""
    sites = dict(one(rendered("hpa"), "StatefulSet"))
    sites["spec"] = {**sites["spec"], "replica": 2}
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(sites, VERSIONS[0], strict=True)


def piped(overlay_dir: Path, version: str) -> subprocess.CompletedProcess[str]:
    """`kubectl kustomize <overlay> | kubernetes-validate --strict` as CI's shell runs it."""
    command = (
        f"set -o pipefail; {kubectl()} kustomize {overlay_dir} | "
        f"{VALIDATE_CLI} --strict --quiet --kubernetes-version {version} -"
    )
    return subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", VERSIONS)
def test_kustomize_piped_into_kubernetes_validate_passes(overlay: str, version: str) -> None:
    done = piped(K8S / "overlays" / overlay, version)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "did not validate" not in done.stdout + done.stderr


@pytest.mark.parametrize("version", VERSIONS)
def test_deploy_k8s_itself_renders_the_hpa_overlay_and_validates(version: str) -> None:
    """`kubectl kustomize deploy/k8s | kubernetes-validate`, as issue 58 writes it: the
    directory's own kustomization is the default deployment, the hpa overlay."""
    done = piped(K8S, version)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "did not validate" not in done.stdout + done.stderr
    assert render(K8S) == rendered("hpa")


def test_the_pipeline_fails_on_a_mistake(tmp_path: Path) -> None:
    """The pipeline's verdict is not vacuous: a misspelt field fails it, naming the field."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    sites = copy / "base" / "sites.yaml"
    text = sites.read_text()
    sites.write_text(
        text.replace("  serviceName: fed-site\n  replicas:", "  serviceName: fed-site\n  replica:")
    )
    assert sites.read_text() != text
    done = piped(copy / "overlays" / "hpa", VERSIONS[0])
    assert done.returncode != 0
    assert "'replica' was unexpected" in done.stdout + done.stderr


def gateway_files(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    data = one(docs, "ConfigMap", "fedllm-gateway")["data"]
    return {key: json.loads(value) for key, value in data.items()}


def scaling_rule(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    (model,) = gateway_files(docs)["scaling.json"]["models"]
    return dict(model)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_files_parse_and_name_the_statefulset(overlay: str) -> None:
    docs = rendered(overlay)
    files = gateway_files(docs)
    raw = {key: json.dumps(value).encode() for key, value in files.items()}
    federation = parse_federation(raw["federation.json"], Path("/var/lib/fedllm"))
    served = frozenset(m.name for m in federation.models)
    scaling = parse_scaling(raw["scaling.json"], Path("/etc/fedllm"), served)
    assert set(files["models.json"]) == served
    (model,) = scaling.models
    actuator = model.actuator
    assert actuator.kind == "kubernetes"
    sites = one(docs, "StatefulSet")
    headless = one(docs, "Service", sites["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    namespace = sites["metadata"]["namespace"]
    # Pod i of the StatefulSet is <name>-<i>.<service>.<namespace>.svc...: what the gateway
    # resolves, and the federation file's one site is pod 0.
    expected = f"{sites['metadata']['name']}-{{i}}.{headless['metadata']['name']}.{namespace}.svc"
    assert actuator.host_pattern is not None
    assert actuator.host_pattern.startswith(expected)
    assert actuator.name_prefix == sites["metadata"]["name"]
    (first,) = federation.sites
    assert first.name == f"{actuator.name_prefix}-0"
    assert first.endpoint == f"{actuator.host_pattern.format(i=0)}:{actuator.port}"
    container = sites["spec"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in container["ports"]} == {actuator.port}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SITE_MODEL_NAME"] == model.rule.model
    gateway = one(docs, "Deployment", "fedllm-gateway")["spec"]["template"]["spec"]
    gateway_env = {e["name"]: e for e in gateway["containers"][0]["env"]}
    assert gateway_env["GATEWAY_SCALING_FILE"]["value"] == "/etc/fedllm/scaling.json"


def test_keda_scales_the_statefulset_on_the_desired_pods() -> None:
    docs = rendered("keda")
    scaled = one(docs, "ScaledObject")
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "StatefulSet")
    sites = one(docs, "StatefulSet", target["name"])
    assert scaled["metadata"]["namespace"] == sites["metadata"]["namespace"]
    rule = scaling_rule(docs)
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == replica_bounds(rule)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metricType"] == "AverageValue"
    metadata = trigger["metadata"]
    assert set(metadata) >= {"serverAddress", "query", "threshold"}
    assert metadata["threshold"] == "1"  # replicas = the gateway's number
    exported = {f"fedllm_gateway_scaling_{name}" for name, _, _ in SCALING_GAUGES}
    assert "fedllm_gateway_scaling_desired_pods" in exported
    assert metadata["query"] == (
        f'max(fedllm_gateway_scaling_desired_pods{{model="{rule["model"]}"}})'
    )


def test_the_hpa_scales_the_statefulset_on_the_external_metric() -> None:
    docs = rendered("hpa")
    spec = one(docs, "HorizontalPodAutoscaler")["spec"]
    target = spec["scaleTargetRef"]
    one(docs, "StatefulSet", target["name"])
    rule = scaling_rule(docs)
    assert (spec["minReplicas"], spec["maxReplicas"]) == replica_bounds(rule)
    (metric,) = spec["metrics"]
    external = metric["external"]
    assert external["metric"]["name"] == "fedllm_gateway_scaling_desired_pods"
    assert external["metric"]["selector"]["matchLabels"] == {"model": rule["model"]}
    assert external["target"] == {"type": "AverageValue", "averageValue": "1"}


def test_only_the_gateway_reaches_the_sites() -> None:
    docs = rendered("keda")
    policy = one(docs, "NetworkPolicy")["spec"]
    sites = one(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    gateway = one(docs, "Deployment", "fedllm-gateway")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= sites.items()
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= gateway.items()


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_the_gateway_with_the_metrics_credential(overlay: str) -> None:
    """Issue 58: nothing told Prometheus to scrape the gateway, and scraping took the admin
    token, so the autoscaler's number never reached it. The rendered manifests hold a
    ServiceMonitor on the gateway's Service, at the port and path /metrics is served on, with
    the Secret key the gateway reads as its read-only metrics credential (not the admin
    token's)."""
    docs = rendered(overlay)
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["namespace"] == "fedllm"
    service = one(docs, "Service", "fedllm-gateway")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    deployment = one(docs, "Deployment", "fedllm-gateway")
    assert service["spec"]["selector"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    gateway = deployment["spec"]["template"]["spec"]["containers"][0]
    (served,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert served["targetPort"] in {p["name"] for p in gateway["ports"]}
    auth = endpoint["authorization"]
    assert auth["type"] == "Bearer"
    credential = auth["credentials"]
    env = env_of(gateway)
    metrics_ref = env["GATEWAY_ADMIN_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]
    admin_ref = env["GATEWAY_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (credential["name"], credential["key"]) == (metrics_ref["name"], metrics_ref["key"])
    assert credential["key"] != admin_ref["key"]
    if overlay == "keda":
        # KEDA asks the Prometheus the operator runs (its `prometheus-operated` Service).
        trigger = one(docs, "ScaledObject")["spec"]["triggers"][0]["metadata"]
        assert "://prometheus-operated." in trigger["serverAddress"]


def test_a_slow_answer_does_not_make_a_site_unready() -> None:
    """Issue 58: one probe answered late (failureThreshold 1, the default 1 s timeout) took
    the site out of DNS, and the gateway drained it. One answer may now take seconds, and one
    miss is not enough."""
    sites = one(rendered("keda"), "StatefulSet")
    probe = sites["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe.get("timeoutSeconds", 1) >= 5
    assert probe.get("failureThreshold", 3) >= 3
    # Still taken out within half a minute when it really stops answering.
    most_s = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    assert most_s <= 30


def replica_bounds(rule: dict[str, Any]) -> tuple[int, int]:
    """The autoscaler's replica bounds for a scaling rule: its sites' plus the warm pool's."""
    pool = int(rule["actuator"].get("pool_size", 0))
    return int(rule["min_sites"]) + pool, int(rule["max_sites"]) + pool


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_autoscaler_runs_the_warm_pool_beyond_the_desired_sites(overlay: str) -> None:
    """Issue 62: the kubernetes actuator's pool is pods the StatefulSet runs beyond the sites
    the gateway wants serving. The manifests configure one, the autoscaler reads the gauge that
    counts it (desired sites + pool_size, not the desired sites alone), and its bounds make room
    for it above min_sites and max_sites; the initial replicas are min_sites + the pool."""
    docs = rendered(overlay)
    rule = scaling_rule(docs)
    pool = rule["actuator"]["pool_size"]
    assert pool >= 1
    gauges = {name: value for name, _, value in SCALING_GAUGES}
    capacity = ModelCapacity(rule["model"], 2, 0, 3, 0.0, 0.0, pool_pods=pool)
    assert gauges["desired_pods"](capacity) == 3 + pool
    assert gauges["desired_sites"](capacity) == 3
    if overlay == "keda":
        spec = one(docs, "ScaledObject")["spec"]
        bounds = (spec["minReplicaCount"], spec["maxReplicaCount"])
        read = spec["triggers"][0]["metadata"]["query"]
    else:
        spec = one(docs, "HorizontalPodAutoscaler")["spec"]
        bounds = (spec["minReplicas"], spec["maxReplicas"])
        read = spec["metrics"][0]["external"]["metric"]["name"]
    assert "fedllm_gateway_scaling_desired_pods" in read
    assert "desired_sites" not in read
    assert bounds == (rule["min_sites"] + pool, rule["max_sites"] + pool)
    sites = one(docs, "StatefulSet")["spec"]
    assert sites["replicas"] == rule["min_sites"] + pool
