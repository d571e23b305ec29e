"""The CPU container image, built and run (marker ``container``).

The image is built from deploy/docker/Dockerfile.cpu by scripts/build_image.sh (or taken
from $SPECSERVE_TEST_IMAGE) and started the way the Kubernetes manifests start it: the
cpu overlay's args, user, read-only root filesystem, dropped capabilities, tmpfs /tmp
and the API-key secret. Everything is checked from the host, as a kubelet and a client
would, except the two things only the inside can show (the user id, the read-only root).

    pytest -m container                                   # podman or docker, a registry
    SPECSERVE_IMAGE_BUILD_ARGS="--local-base --torch-wheels /opt/wheels \
        --ca-bundle /etc/ssl/certs/ca-certificates.crt" pytest -m container   # no registry

Without podman or a running docker engine the module is one skip line; .ci/run sets
SPECSERVE_REQUIRE_CONTAINER_TESTS=1, which turns that skip into a failure.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest

from engine.client import SpecserveClient
from tests.ops.deploy_files import REPO_ROOT, expand, one, render_overlay

pytestmark = pytest.mark.container

_OVERLAY = "cpu"
_BUILD_TIMEOUT_S = 900
_START_TIMEOUT_S = 180
# 1.31 GB today (1.84 GB while it baked the fp32 safetensors of the default model): torch
# ~0.8 GB, the default model's .gguf served as stored 0.1 GB.
_MAX_IMAGE_BYTES = 1.5e9
_PROMPT = "The capital of France is"


def _engine() -> str | None:
    wanted = os.environ.get("SPECSERVE_CONTAINER_ENGINE")
    if wanted:
        return wanted if shutil.which(wanted) else None
    if shutil.which("docker"):
        ok = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
        if ok:
            return "docker"
    return "podman" if shutil.which("podman") else None


ENGINE = _engine()
if ENGINE is None:
    _WHY = (
        "container tests need podman or a running docker engine "
        "(Debian: apt-get install podman runc debootstrap; see docs/deploy.md)"
    )
    if os.environ.get("SPECSERVE_REQUIRE_CONTAINER_TESTS") == "1":
        pytest.fail(_WHY, pytrace=False)
    pytest.skip(_WHY, allow_module_level=True)


def _run(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"{ENGINE} {shlex.join(args)} failed: {result.stderr.strip()[-2000:]}")
    return result


@pytest.fixture(scope="module")
def image() -> str:
    given = os.environ.get("SPECSERVE_TEST_IMAGE")
    if given:
        return given
    extra = shlex.split(os.environ.get("SPECSERVE_IMAGE_BUILD_ARGS", ""))
    script = str(REPO_ROOT / "scripts" / "build_image.sh")
    cmd = ["bash", script, "--engine", ENGINE, "--tag", "specserve:cpu-test", *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    if result.returncode != 0:
        pytest.fail(f"image build failed:\n{result.stderr[-4000:]}", pytrace=False)
    print(result.stderr.strip().splitlines()[-1])  # "[build_image] built ... in N s, M MB"
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def image_config(image) -> dict:
    return json.loads(_run("image", "inspect", image).stdout)[0]["Config"]


@pytest.fixture(scope="module")
def deployment() -> dict:
    """The cpu overlay's Deployment (kubectl kustomize), and its container's args with
    the ConfigMap's $(ARG_X) values substituted, as the kubelet would."""
    resources = render_overlay(_OVERLAY)
    spec = one(resources, "Deployment")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    config = one(resources, "ConfigMap")["data"]
    return {"pod": spec, "container": container, "args": expand(container["args"], config)}


def _mounts(deployment: dict, api_key_file: Path) -> list[str]:
    """Each of the container's volume mounts as the run flag a kubelet's would give:
    emptyDir -> tmpfs, the API-key secret -> the key file, read-only."""
    volumes = {v["name"]: v for v in deployment["pod"]["volumes"]}
    flags = []
    for mount in deployment["container"]["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            flags += ["--tmpfs", f"{mount['mountPath']}:rw,mode=1777"]
        elif "secret" in volume:
            flags += ["-v", f"{api_key_file.parent}:{mount['mountPath']}:ro"]
        else:
            pytest.fail(f"no stand-in for volume {mount['name']} ({sorted(volume)})")
    return flags


class Server:
    def __init__(self, name: str, grpc_target: str, metrics_url: str, api_key: str) -> None:
        self.name = name
        self.grpc_target = grpc_target
        self.metrics_url = metrics_url
        self.api_key = api_key

    def client(self, api_key: str | None = "") -> SpecserveClient:
        return SpecserveClient(self.grpc_target, api_key=self.api_key if api_key == "" else api_key)

    def logs(self) -> str:
        result = _run("logs", self.name, check=False)
        return result.stdout + result.stderr

    def exec(self, *cmd: str) -> subprocess.CompletedProcess:
        return _run("exec", self.name, *cmd, check=False)


def _host_port(name: str, port: int) -> str:
    out = _run("port", name, f"{port}/tcp").stdout.strip().splitlines()[0]
    return out.replace("0.0.0.0", "127.0.0.1")


@pytest.fixture(scope="module")
def server(image, deployment, tmp_path_factory) -> Server:
    container = deployment["container"]
    pod_security = deployment["pod"]["securityContext"]
    security = container["securityContext"]
    secret_dir = tmp_path_factory.mktemp("secret")
    api_key = uuid.uuid4().hex
    (secret_dir / "api-key").write_text(api_key)
    (secret_dir / "api-key").chmod(0o444)
    secret_dir.chmod(0o755)  # the kubelet's secret volume is readable by the pod's group
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    name = f"specserve-test-{uuid.uuid4().hex[:8]}"
    flags = [
        "--name", name, "--user", f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "-p", f"127.0.0.1::{ports['grpc']}", "-p", f"127.0.0.1::{ports['metrics']}",
        *_mounts(deployment, secret_dir / "api-key"),
    ]  # fmt: skip
    if security.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    _run("run", "-d", *flags, image, *deployment["args"])
    srv = Server(
        name,
        _host_port(name, ports["grpc"]),
        f"http://{_host_port(name, ports['metrics'])}/metrics",
        api_key,
    )
    _wait_serving(srv)
    yield srv
    _run("rm", "-f", "-t", "0", name, check=False)


def _wait_serving(srv: Server) -> None:
    """Until health answers SERVING; fails at once, with the log, if the container exits."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    with srv.client() as client:
        while True:
            try:
                client.wait_serving(timeout=2.0)
                return
            except TimeoutError as exc:
                running = _run("inspect", "--format", "{{.State.Running}}", srv.name).stdout
                if running.strip() != "true" or time.monotonic() > deadline:
                    why = "exited" if running.strip() != "true" else str(exc)
                    pytest.fail(f"{why}; container log:\n{srv.logs()[-3000:]}", pytrace=False)


def test_image_is_small_and_has_no_compiler(image, image_config):
    size = json.loads(_run("image", "inspect", image).stdout)[0]["Size"]
    print(f"{image}: {size / 1e6:.0f} MB")
    assert size < _MAX_IMAGE_BYTES, f"{size / 1e6:.0f} MB"
    found = _run(
        "run", "--rm", "--entrypoint", "sh", image, "-c", "command -v cc gcc c99 clang", check=False
    )
    assert found.returncode != 0 and not found.stdout.strip(), found.stdout


def test_health_becomes_serving(server):
    with server.client() as client:
        assert client.health() == "SERVING"
    # the image's HEALTHCHECK command, run where the container runtime runs it
    probe = server.exec("python3", "/opt/specserve/healthcheck.py", "--port", "50051")
    assert probe.returncode == 0, probe.stderr


def test_generate_streams_tokens_from_the_baked_model(server):
    with server.client() as client:
        deltas = list(client.generate(_PROMPT, max_tokens=12, temperature=0, ignore_eos=True))
    assert len(deltas) >= 2, "streamed, not one answer"
    assert sum(len(d.token_ids) for d in deltas) == 12
    assert deltas[-1].finish_reason == "length" and "".join(d.text for d in deltas).strip()
    with server.client(api_key=None) as anonymous, pytest.raises(grpc.RpcError) as refused:
        list(anonymous.generate(_PROMPT, max_tokens=2))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the secret's key is on
    # the prebuilt kernels were found (no compiler in the image, no torch fallback)
    assert "using the prebuilt CPU kernels" in server.logs()
    assert "CPU kernels unavailable" not in server.logs()


def test_metrics_port_answers(server):
    with server.client() as client:
        client.generate_complete(_PROMPT, max_tokens=3, temperature=0)
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    generated = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("specserve_generation_tokens_total")
    ]
    assert generated and sum(generated) >= 3


def test_runs_as_the_manifests_non_root_user(server, image_config, deployment):
    uid = deployment["pod"]["securityContext"]["runAsUser"]
    assert deployment["pod"]["securityContext"]["runAsNonRoot"] is True
    assert image_config["User"].split(":")[0] == str(uid), "image and manifest agree"
    status = server.exec("cat", "/proc/1/status").stdout
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert uids == [str(uid)] * 4, status  # real, effective, saved, filesystem


def test_root_filesystem_is_read_only(server, deployment):
    assert deployment["container"]["securityContext"]["readOnlyRootFilesystem"] is True
    write = server.exec("sh", "-c", "echo x > /opt/specserve/probe")
    assert write.returncode != 0 and "Read-only file system" in write.stderr, write.stderr


def test_entrypoint_and_ports_match_the_manifests(image_config, deployment):
    container = deployment["container"]
    assert "command" not in container, "the manifests keep the image's entrypoint"
    assert image_config["Entrypoint"] == ["specserve", "serve"]
    exposed = sorted(int(p.split("/")[0]) for p in image_config["ExposedPorts"])
    assert exposed == sorted(p["containerPort"] for p in container["ports"])
    # the manifest's args are the image's CMD plus settings, with the same ports and host
    cmd = dict(a.split("=", 1) for a in _flag_pairs(image_config["Cmd"]))
    args = dict(a.split("=", 1) for a in deployment["args"])
    for flag in ("--host", "--port", "--metrics-port"):
        assert args[flag] == cmd[flag], flag
    probes = [container[k]["grpc"]["port"] for k in ("startupProbe", "readinessProbe")]
    assert set(probes) == {int(args["--port"])}


def _flag_pairs(cmd: list[str]) -> list[str]:
    """["--a", "1", "--b=2"] -> ["--a=1", "--b=2"]."""
    out, it = [], iter(cmd)
    for item in it:
        out.append(item if "=" in item else f"{item}={next(it)}")
    return out


def test_runs_with_no_network(image, server):
    """No network at all at run time: the model, tokenizer and kernels are all baked in,
    and greedy output equals the served container's."""
    result = _run(
        "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp:rw,mode=1777",
        "--entrypoint", "specserve", image, "generate", _PROMPT,
        "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
        timeout=_START_TIMEOUT_S,
    )  # fmt: skip
    with server.client() as client:
        served = client.generate_complete(_PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert result.stdout.strip() == served.text.strip()


def test_sigterm_drains_the_in_flight_stream_and_exits_0(server):
    """Last: it stops the container. SIGTERM (what the kubelet sends after preStop)
    lets the running stream finish every token, then the process exits 0."""
    with server.client() as client:
        stream = iter(client.generate(_PROMPT, max_tokens=48, temperature=0, ignore_eos=True))
        first = next(stream)
        started = time.monotonic()
        _run("kill", "--signal", "TERM", server.name)
        rest = list(stream)
    tokens = len(first.token_ids) + sum(len(d.token_ids) for d in rest)
    assert tokens == 48 and rest[-1].finish_reason == "length"
    code = _run("wait", server.name, timeout=90).stdout.strip().splitlines()[-1]
    took = time.monotonic() - started
    assert code == "0", f"exit {code} after {took:.1f} s:\n{server.logs()[-2000:]}"
    assert "drain" in server.logs()
