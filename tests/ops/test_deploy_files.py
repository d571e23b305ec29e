"""Dockerfiles, compose file and dashboard: parsed offline (no docker engine here)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest
from dockerfile_parse import DockerfileParser

from engine.observability.metrics import EngineMetrics
from engine.server.health import SERVICE_NAME
from tests.ops.deploy_files import DEPLOY, REPO_ROOT, load_yaml, parse_smg, smg_pin, tool
from tests.ops.test_manifests import parse_serve, serve_defaults

DOCKERFILES = ["Dockerfile.cpu", "Dockerfile.cuda"]
GATEWAY = "Dockerfile.gateway"
DASHBOARD = DEPLOY / "grafana" / "specserve.json"
_METRIC = re.compile(r"\bspecserve_[a-z0-9_]+")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",), "info": ("_info",)}  # fmt: skip


def exported_sample_names() -> set[str]:
    """Every series name the exporter can produce (label sets aside)."""
    families = EngineMetrics().registry.collect()
    return {
        f.name + suffix
        for f in families
        if f.name.startswith("specserve_")
        for suffix in _SUFFIXES[f.type]
    }


def instructions(name: str) -> list[dict]:
    with open(DEPLOY / "docker" / name, "rb") as f:
        return DockerfileParser(fileobj=f).structure


def last(structure: list[dict], instruction: str) -> str:
    found = [i["value"] for i in structure if i["instruction"] == instruction]
    assert found, f"no {instruction}"
    return found[-1]


def stages(structure: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    for item in structure:
        if item["instruction"] == "FROM":
            out.append([])
        if out:
            out[-1].append(item)
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_shape(name: str) -> None:
    structure = instructions(name)
    parts = stages(structure)
    assert len(parts) >= 2, "multi-stage: build and runtime"
    runtime = parts[-1]
    user = last(runtime, "USER").split(":")[0]
    assert user not in ("root", "0") and user
    assert json.loads(last(runtime, "ENTRYPOINT")) == ["specserve", "serve"]
    healthcheck = last(runtime, "HEALTHCHECK")
    assert "healthcheck.py" in healthcheck and "--start-period" in healthcheck
    env = " ".join(i["value"] for i in runtime if i["instruction"] == "ENV")
    assert "SPECSERVE_CACHE_DIR=/opt/specserve/cache" in env
    build_runs = " ".join(i["value"] for i in parts[0] if i["instruction"] == "RUN")
    assert "load_model(None)" in build_runs, "the default model is baked in at build time"
    copies = [i["value"] for i in runtime if i["instruction"] == "COPY"]
    assert any("/opt/specserve/cache" in c and "--from=" in c for c in copies)
    assert any("deploy/docker/healthcheck.py" in c for c in copies)
    ports = last(runtime, "EXPOSE").split()
    defaults = serve_defaults()
    assert ports == [str(defaults.port), str(defaults.metrics_port)]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_cmd_flags_are_real(name: str) -> None:
    parse_serve(json.loads(last(instructions(name), "CMD")))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_exist(name: str) -> None:
    for item in instructions(name):
        if item["instruction"] == "COPY" and "--from=" not in item["value"]:
            *sources, _dest = shlex.split(item["value"])
            for source in sources:
                assert (REPO_ROOT / source).exists() or source == "README.md", source


def test_healthcheck_defaults_match_the_server() -> None:
    text = (DEPLOY / "docker" / "healthcheck.py").read_text()
    assert f'SERVICE = "{SERVICE_NAME}"' in text
    assert f"default={serve_defaults().port}" in text


def compose_workers(services: dict) -> list[str]:
    """The services that run specserve (built from Dockerfile.cpu)."""
    cpu = "deploy/docker/Dockerfile.cpu"
    return [n for n, svc in services.items() if svc.get("build", {}).get("dockerfile") == cpu]


def test_compose_wires_workers_gateway_prometheus_grafana() -> None:
    compose = load_yaml(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert {"specserve", "specserve-2", "gateway", "prometheus", "grafana"} <= services.keys()
    workers = compose_workers(services)
    assert workers == ["specserve", "specserve-2"]
    args = parse_serve(services["specserve"]["command"])
    assert f"{args.metrics_port}:{args.metrics_port}" in services["specserve"]["ports"]
    assert (REPO_ROOT / services["specserve"]["build"]["dockerfile"]).exists()
    for name in workers:
        assert parse_serve(services[name]["command"]) == args, name
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (DEPLOY / source).exists(), source
    prometheus = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs.keys() == {"specserve", "gateway"}
    (targets,) = (c["targets"] for c in jobs["specserve"]["static_configs"])
    assert targets == [f"{name}:{args.metrics_port}" for name in workers]
    gateway = parse_smg(services["gateway"]["command"])
    assert jobs["gateway"]["static_configs"][0]["targets"] == [f"gateway:{gateway.prometheus_port}"]
    assert jobs["gateway"]["metrics_path"] == "/metrics"


def test_compose_gateway_routes_to_every_worker() -> None:
    services = load_yaml(DEPLOY / "docker-compose.yml")["services"]
    gateway, workers = services["gateway"], compose_workers(services)
    args = parse_smg(gateway["command"])
    worker_port = parse_serve(services["specserve"]["command"]).port
    assert args.worker_urls == [f"grpc://{name}:{worker_port}" for name in workers]
    assert (args.backend, args.policy) == ("vllm", "cache_aware")
    assert f"{args.port}:{args.port}" in gateway["ports"]
    assert f"{args.prometheus_port}:{args.prometheus_port}" in gateway["ports"]
    assert gateway["depends_on"] == {name: {"condition": "service_healthy"} for name in workers}
    assert gateway["read_only"] is True and gateway["tmpfs"] == ["/tmp"]
    build = DEPLOY / gateway["build"]["context"]
    assert (build / gateway["build"]["dockerfile"]).samefile(DEPLOY / "docker" / GATEWAY)
    assert gateway["image"] == f"specserve-gateway:{smg_pin()}"


def test_gateway_dockerfile() -> None:
    """python:3.11-slim with the pinned smg wheel, non-root, `smg launch` with real flags,
    the ports it exposes are the ones it binds, and the health check asks /readiness on
    the probe listener."""
    structure = instructions(GATEWAY)
    assert [i["value"] for i in structure if i["instruction"] == "FROM"] == ["python:3.11-slim"]
    build_args = dict(i["value"].split("=", 1) for i in structure if i["instruction"] == "ARG")
    assert build_args["SMG_VERSION"] == smg_pin()
    runs = " ".join(i["value"] for i in structure if i["instruction"] == "RUN")
    assert '"smg==${SMG_VERSION}"' in runs
    user = last(structure, "USER").split(":")[0]
    assert user not in ("root", "0") and user
    assert json.loads(last(structure, "ENTRYPOINT")) == ["smg", "launch"]
    args = parse_smg(json.loads(last(structure, "CMD")))
    assert (args.host, args.backend) == ("0.0.0.0", "vllm")
    ports = last(structure, "EXPOSE").split()
    assert ports == [str(args.port), str(args.health_check_port), str(args.prometheus_port)]
    healthcheck = last(structure, "HEALTHCHECK")
    assert f"http://127.0.0.1:{args.health_check_port}/readiness" in healthcheck


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def test_dashboard_only_queries_exported_metrics() -> None:
    exported = exported_sample_names()
    queries = dashboard_queries()
    assert len(queries) >= 20
    for expr in queries:
        names = set(_METRIC.findall(expr))
        assert names, f"query uses no specserve metric: {expr}"
        assert names <= exported, f"{expr}: {sorted(names - exported)} not exported"


def test_dashboard_covers_the_issue() -> None:
    text = " ".join(dashboard_queries())
    for needle in (
        "histogram_quantile(0.99, sum by (le) (rate(specserve_time_to_first_token_seconds",
        "specserve_inter_token_latency_seconds_bucket",
        "rate(specserve_generation_tokens_total",
        "specserve_spec_decode_num_accepted_tokens_total",
        "specserve_kv_cache_usage_perc",
        "specserve_num_requests_waiting",
        "specserve_grpc_errors_total",
    ):
        assert needle in text, needle
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    assert "Acceptance rate" in titles


def test_dockerfiles_pass_hadolint() -> None:
    """Every Dockerfile, the CUDA one included (it cannot be built here: its base image
    is not reachable), passes hadolint with the project's .hadolint.yaml."""
    hadolint = tool("hadolint")
    files = sorted(str(p) for p in (DEPLOY / "docker").glob("Dockerfile.*"))
    files = [f for f in files if not f.endswith(".dockerignore")]
    result = subprocess.run(
        [hadolint, "--config", str(REPO_ROOT / ".hadolint.yaml"), "--no-color", *files],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_build_from_arguments_and_use_python3(name: str) -> None:
    """Both images take their base as a build argument, run python3 (a plain Debian base
    has no `python`), bake the kernels for every CPU level, and keep the compiler out of
    the runtime stage."""
    structure = instructions(name)
    parts = stages(structure)
    froms = [i["value"].split()[0] for i in structure if i["instruction"] == "FROM"]
    assert froms and all(f == "${BASE_IMAGE}" for f in froms), froms
    executed = ("RUN", "CMD", "HEALTHCHECK", "ENTRYPOINT")
    commands = [i["value"] for i in structure if i["instruction"] in executed]
    assert not [c for c in commands if re.search(r"(^|[\s\"'\[])python(\s|\"|')", c)], commands
    build_runs = " ".join(i["value"] for i in parts[0] if i["instruction"] == "RUN")
    assert "prebuild(" in build_runs and "gcc" in build_runs
    runtime_runs = " ".join(i["value"] for i in parts[-1] if i["instruction"] == "RUN")
    assert "gcc" not in runtime_runs and "libc6-dev" not in runtime_runs
    args = {i["value"].split("=")[0] for i in structure if i["instruction"] == "ARG"}
    assert {"BASE_IMAGE", "TORCH_PIP_ARGS"} <= args, args


def test_build_image_help_prints_the_usage_and_no_code() -> None:
    """--help is the comment block under the shebang: every line printed is one of its
    comment lines, and it stops before the first line of code (`set -euo pipefail`)."""
    script = REPO_ROOT / "scripts" / "build_image.sh"
    result = subprocess.run(
        ["bash", str(script), "--help"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Build specserve's CPU container image")
    assert lines[-1] == "Progress goes to stderr; the last line on stdout is the image's tag."
    comments = {line.removeprefix("#").removeprefix(" ") for line in
                script.read_text().splitlines() if line.startswith("#")}  # fmt: skip
    assert [line for line in lines if line not in comments] == []
    assert "  --engine E          docker or podman, instead of detecting" in lines


def test_the_operations_guide_says_the_cpu_image_has_no_compiler() -> None:
    """The runtime stages install no gcc (test_dockerfiles_build_from_arguments_...);
    the guide must not say they do, and says where their kernels come from instead."""
    guide = " ".join((REPO_ROOT / "docs" / "operations.md").read_text().split())
    assert "ships gcc" not in guide
    assert "The images have no compiler" in guide and "prebuilds the kernels" in guide
