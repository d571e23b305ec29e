"""Manifests validate offline and agree with the server's real CLI, ports and health names."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess

import pytest

from engine.entrypoints.cli import build_parser
from engine.server.health import SERVICE_NAME
from tests.ops.deploy_files import (
    DEPLOY,
    OVERLAYS,
    REPO_ROOT,
    expand,
    load_yaml,
    one,
    render_overlay,
    tool,
)

ADAPTER_VALUES = DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml"


def parse_serve(args: list[str]) -> argparse.Namespace:
    """Parse as `specserve serve ARGS` does; a rejected flag fails with argparse's reason."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(["serve", *args])
    except SystemExit:
        pytest.fail(f"`specserve serve` rejects {args}: {stderr.getvalue().strip()}")


def serve_defaults() -> argparse.Namespace:
    return parse_serve([])


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render_overlay(request.param)


def container(resources: list[dict]) -> dict:
    (c,) = one(resources, "Deployment", "specserve")["spec"]["template"]["spec"]["containers"]
    return c


def container_args(resources: list[dict]) -> list[str]:
    config_map = one(resources, "ConfigMap")
    return expand(container(resources)["args"], config_map["data"])


def has_gateway(resources: list[dict]) -> bool:
    """The overlay adds components/gateway (overlays/cpu-gateway)."""
    return any(r["kind"] == "Deployment" and r["metadata"]["name"] == "specserve-gateway"
               for r in resources)  # fmt: skip


def test_validate_manifests_script() -> None:
    tool("kubectl"), tool("kubernetes-validate")
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "validate_manifests.sh")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(f"ok   {name}" in result.stdout for name in OVERLAYS)


def test_overlays_exist() -> None:
    assert {"cpu", "gpu", "cpu-gateway"} <= set(OVERLAYS)


def test_args_are_real_serve_flags(overlay) -> None:
    _, resources = overlay
    args = parse_serve(container_args(resources))
    if has_gateway(resources):  # smg sends no key: a NetworkPolicy guards the workers
        assert args.api_key_file is None and args.api_key is None
    else:
        assert args.api_key_file.startswith("/var/run/secrets/specserve/")


def test_ports_match_the_server_defaults(overlay) -> None:
    _, resources = overlay
    defaults, args = serve_defaults(), parse_serve(container_args(resources))
    assert (args.port, args.metrics_port) == (defaults.port, defaults.metrics_port)
    ports = {p["name"]: p["containerPort"] for p in container(resources)["ports"]}
    assert ports == {"grpc": defaults.port, "metrics": defaults.metrics_port}
    workers = [
        r
        for r in resources
        if r["kind"] == "Service"
        and r["spec"]["selector"].get("app.kubernetes.io/component") == "server"
    ]
    assert {s["metadata"]["name"] for s in workers} == {"specserve", "specserve-headless"}
    for service in workers:
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]
            if port["name"] == "grpc":
                assert port["appProtocol"] == "kubernetes.io/h2c"


def test_probes_use_the_grpc_health_service(overlay) -> None:
    _, resources = overlay
    c = container(resources)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc = c[probe]["grpc"]
        assert grpc == {"port": serve_defaults().port, "service": SERVICE_NAME}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model loading


def test_termination_outlasts_the_drain(overlay) -> None:
    _, resources = overlay
    pod = one(resources, "Deployment", "specserve")["spec"]["template"]["spec"]
    args = parse_serve(container_args(resources))
    pre_stop_s = container(resources)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + args.shutdown_grace + 5


def test_pod_hardening_and_volumes(overlay) -> None:
    name, resources = overlay
    pod = one(resources, "Deployment", "specserve")["spec"]["template"]["spec"]
    c = container(resources)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert "model-cache" in volumes
    assert volumes["api-key"]["secret"]["secretName"] == "specserve-api-key"
    gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert (gpus is not None) == (name == "gpu")


def test_services_hpa_pdb_servicemonitor(overlay) -> None:
    _, resources = overlay
    assert one(resources, "Service", "specserve-headless")["spec"]["clusterIP"] == "None"
    assert one(resources, "Service", "specserve")["spec"]["type"] == "ClusterIP"
    hpa = one(resources, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == "specserve"
    assert one(resources, "PodDisruptionBudget", "specserve")["apiVersion"] == "policy/v1"
    monitor = one(resources, "ServiceMonitor", "specserve")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    selected = [
        s for s in resources
        if s["kind"] == "Service"
        and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]  # fmt: skip
    assert [s["metadata"]["name"] for s in selected] == ["specserve"]  # scraped once


def test_hpa_metric_comes_from_the_adapter_rule(overlay) -> None:
    from engine.observability.metrics import EngineMetrics

    _, resources = overlay
    (metric,) = one(resources, "HorizontalPodAutoscaler")["spec"]["metrics"]
    (rule,) = load_yaml(ADAPTER_VALUES)["rules"]["custom"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = rule["seriesQuery"].split("{")[0]
    gauges = {f.name for f in EngineMetrics().registry.collect() if f.type == "gauge"}
    assert series in gauges
