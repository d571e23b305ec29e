"""deploy/k8s/components/gateway, as overlays render it: the gateway's args are real
`smg launch` flags, discovery finds exactly the worker pods at their gRPC port, RBAC
grants what discovery needs and nothing more, probes hit the gateway's real health
routes, and the pod is hardened like the workers'."""

from __future__ import annotations

import pytest

from tests.ops.deploy_files import (
    DEPLOY,
    OVERLAYS,
    expand,
    one,
    parse_smg,
    render_overlay,
    smg_pin,
)
from tests.ops.test_manifests import container_args, has_gateway, parse_serve, serve_defaults

# What the API server puts in the gateway's $(VAR)s at start.
ENV = {"POD_NAMESPACE": "inference", "API_KEY": "k3y"}


def _kustomization(overlay: str) -> str:
    return (DEPLOY / "k8s" / "overlays" / overlay / "kustomization.yaml").read_text()


# The overlays that add components/gateway (rendered and checked by test_manifests.py too).
GATEWAY_OVERLAYS = [n for n in OVERLAYS if "components/gateway" in _kustomization(n)]


@pytest.fixture(scope="module", params=GATEWAY_OVERLAYS)
def gateway_overlay(request) -> list[dict]:
    return render_overlay(request.param)


def test_an_overlay_ships_the_gateway() -> None:
    assert GATEWAY_OVERLAYS == ["cpu-gateway"]
    assert has_gateway(render_overlay("cpu-gateway"))
    assert not has_gateway(render_overlay("cpu"))  # opt-in: the plain overlays stay as they were


def pod_spec(resources: list[dict], name: str) -> dict:
    return one(resources, "Deployment", name)["spec"]["template"]["spec"]


def pod_labels(resources: list[dict], name: str) -> dict:
    return one(resources, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


def gateway_container(resources: list[dict]) -> dict:
    (c,) = pod_spec(resources, "specserve-gateway")["containers"]
    return c


def gateway_args(resources: list[dict]):
    return parse_smg(expand(gateway_container(resources)["args"], ENV))


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_args_are_real_smg_flags(gateway_overlay) -> None:
    args = gateway_args(gateway_overlay)
    assert (args.backend, args.policy, args.host) == ("vllm", "cache_aware", "0.0.0.0")
    assert args.selected_discovery_provider() == "kubernetes" and not args.worker_urls
    assert args.service_discovery_namespace == ENV["POD_NAMESPACE"]
    assert args.api_key == ENV["API_KEY"]
    env = {e["name"]: e["valueFrom"] for e in gateway_container(gateway_overlay)["env"]}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # The clients' key is the Secret the workers read theirs from.
    worker_secret = next(v["secret"]["secretName"] for v in pod_spec(gateway_overlay, "specserve")
                         ["volumes"] if v["name"] == "api-key")  # fmt: skip
    assert env["API_KEY"] == {"secretKeyRef": {"name": worker_secret, "key": "api-key"}}


def test_the_checker_rejects_what_smg_rejects() -> None:
    with pytest.raises(pytest.fail.Exception, match="smg launch` rejects"):
        parse_smg(["--policy", "fastest"])


def test_discovery_finds_the_worker_pods_at_their_grpc_port(gateway_overlay) -> None:
    args = gateway_args(gateway_overlay)
    workers, gateway = (pod_labels(gateway_overlay, n) for n in ("specserve", "specserve-gateway"))
    assert selects(args.selector, workers) and not selects(args.selector, gateway)
    (worker,) = pod_spec(gateway_overlay, "specserve")["containers"]
    grpc_port = {p["name"]: p["containerPort"] for p in worker["ports"]}["grpc"]
    served = parse_serve(container_args(gateway_overlay)).port
    assert args.service_discovery_port == grpc_port == served == serve_defaults().port


def test_ports_probes_service_and_monitor(gateway_overlay) -> None:
    args, c = gateway_args(gateway_overlay), gateway_container(gateway_overlay)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.port, "health": args.health_check_port,
                     "metrics": args.prometheus_port}  # fmt: skip
    # The probe listener (--health-check-port) serves /liveness and /readiness; readiness
    # is 503 until a worker is healthy, liveness only says the process is up.
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "health"}
    service = one(gateway_overlay, "Service", "specserve-gateway")
    gateway_pods = pod_labels(gateway_overlay, "specserve-gateway")
    assert selects(service["spec"]["selector"], gateway_pods)
    assert not selects(service["spec"]["selector"], pod_labels(gateway_overlay, "specserve"))
    for port in service["spec"]["ports"]:
        assert port["port"] == ports[port["targetPort"]]
    monitor = one(gateway_overlay, "ServiceMonitor", "specserve-gateway")
    services = [s for s in gateway_overlay if s["kind"] == "Service"]
    chosen = [
        s["metadata"]["name"]
        for s in services
        if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert chosen == ["specserve-gateway"]  # fmt: skip
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    pdb = one(gateway_overlay, "PodDisruptionBudget", "specserve-gateway")
    assert selects(pdb["spec"]["selector"]["matchLabels"], gateway_pods)


def test_rbac_grants_exactly_what_discovery_needs(gateway_overlay) -> None:
    """Watching pods in its own namespace: get, list, watch; no cluster-wide rights."""
    assert not [r for r in gateway_overlay if r["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = one(gateway_overlay, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip
    binding = one(gateway_overlay, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}  # fmt: skip
    pod = pod_spec(gateway_overlay, "specserve-gateway")
    account = one(gateway_overlay, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert pod["serviceAccountName"] == account and pod["automountServiceAccountToken"] is True
    assert pod_spec(gateway_overlay, "specserve")["automountServiceAccountToken"] is False


def test_gateway_pod_is_hardened(gateway_overlay) -> None:
    pod, c = pod_spec(gateway_overlay, "specserve-gateway"), gateway_container(gateway_overlay)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}  # fmt: skip
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[mounts["/tmp"]]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= c["resources"][kind].keys(), kind
    pre_stop_s = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = gateway_args(gateway_overlay).shutdown_grace_period_secs
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + grace + 5


def test_workers_take_no_key_and_only_the_gateways_grpc(gateway_overlay) -> None:
    """smg sends gRPC workers no credentials: the workers drop their key and a
    NetworkPolicy lets only gateway pods reach the gRPC port (metrics stay open)."""
    policy = one(gateway_overlay, "NetworkPolicy")
    workers = pod_labels(gateway_overlay, "specserve")
    gateway = pod_labels(gateway_overlay, "specserve-gateway")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], workers)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if "grpc" in ports:
            (peer,) = rule["from"]
            assert selects(peer["podSelector"]["matchLabels"], gateway)
            assert not selects(peer["podSelector"]["matchLabels"], workers)
        else:
            assert ports == {"metrics"}
    assert any("grpc" in {p["port"] for p in r["ports"]} for r in policy["spec"]["ingress"])


def test_image_is_the_pinned_smg(gateway_overlay) -> None:
    image = gateway_container(gateway_overlay)["image"]
    assert image == f"specserve-gateway:{smg_pin()}"
