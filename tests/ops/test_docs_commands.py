"""Every command the README, docs/ and scripts/ tell a user to run works after the
README install, which puts specserve and its Python in .venv/bin/ and nothing on PATH;
every repository path they (and the code's docstrings and comments) name exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
SCRIPTS = sorted((REPO_ROOT / "scripts").glob("*.sh"))

# A bare `specserve <subcommand>` or `python[3] -m <module>` (making a venv aside): not
# after a path (.venv/bin/...), a variable ("$PY" -m) or a quote, and not in prose.
BARE = re.compile(r"(?<![\w./$\"'-])(specserve (?:serve|generate|bench)\b|python3? -m (?!venv\b))")
_FENCE = re.compile(r"^\s*```(\w*)")
_SHELL_LANGS = ("", "bash", "sh", "shell", "console")


def shell_code_lines(markdown: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a shell (or unlabelled) fenced block."""
    lines, fence = [], None
    for number, line in enumerate(markdown.splitlines(), 1):
        match = _FENCE.match(line)
        if match:
            fence = None if fence is not None else match.group(1)
        elif fence in _SHELL_LANGS:
            lines.append((number, line))
    return lines


def bare_invocations(path: Path) -> list[str]:
    """'line: text' of each bare invocation: in a markdown file's shell blocks, or
    anywhere in a script (its comments included: they show how to run it)."""
    text = path.read_text()
    lines = shell_code_lines(text) if path.suffix == ".md" else enumerate(text.splitlines(), 1)
    return [f"{number}: {line.strip()}" for number, line in lines if BARE.search(line)]


@pytest.mark.parametrize("path", DOCS + SCRIPTS, ids=lambda p: p.name)
def test_no_bare_commands_that_the_install_leaves_off_path(path):
    assert bare_invocations(path) == [], "use .venv/bin/specserve or .venv/bin/python -m"


def test_the_checker_flags_bare_commands_and_nothing_else(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "Run `specserve serve` in prose, or python -m pytest in prose.\n"
        "```bash\n"
        "specserve generate --chat hi\n"
        "  python3 -m pytest -q\n"
        ".venv/bin/specserve bench step      # fine\n"
        ".venv/bin/python -m pytest -q       # fine\n"
        'python3 -m venv .venv && "$PY" -m pip install .   # fine\n'
        "```\n"
        "```python\n"
        "import specserve  # specserve serve, but in Python\n"
        "```\n"
        "```\n"
        "python -m engine.benchmarks.blocks\n"
        "```\n"
    )
    found = [line.split(": ", 1)[1] for line in bare_invocations(doc)]
    assert found == [
        "specserve generate --chat hi",
        "python3 -m pytest -q",
        "python -m engine.benchmarks.blocks",
    ]


# A repository path in prose: engine/..., scheduler/..., tests/... (deploy/ needs a second
# level or a suffix: `kubectl logs deploy/specserve` names a Deployment, not a file).
REPO_PATH = re.compile(
    r"(?<![\w./$-])((?:engine|block_manager|scheduler|tests|scripts|proto|docs)/[\w./*-]*[\w*]"
    r"|deploy/[\w-]+(?:/[\w./*-]*[\w*]|\.\w+))"
)
CODE = sorted(
    path
    for top in ("engine", "block_manager", "scheduler", "scripts", "tests", "deploy")
    for path in (REPO_ROOT / top).rglob("*")
    if path.suffix in (".py", ".sh", ".c")
    and "_pb2" not in path.name
    # this file names stale paths on purpose, to test the checker
    and path != Path(__file__).resolve()
)


def missing_paths(path: Path) -> list[str]:
    """'line: path' of each repository path ``path`` names that does not exist."""
    missing = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for match in REPO_PATH.finditer(line):
            named = match.group(1).rstrip(".")
            if not any(REPO_ROOT.glob(named)) if "*" in named else not (REPO_ROOT / named).exists():
                missing.append(f"{number}: {named}")
    return missing


@pytest.mark.parametrize("path", DOCS + CODE, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_named_repository_path_exists(path):
    assert missing_paths(path) == []


def test_the_path_checker_finds_stale_paths(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "The loop is in engine/core/llm_engine.py, once engine/llm_engine.py.\n"
        "See `block_manager/bench.py`, tests/engine/*.py and deploy/k8s/base.\n"
        "kubectl logs deploy/specserve; scheduler/nowhere/.\n"
    )
    assert missing_paths(doc) == [
        "1: engine/llm_engine.py",
        "2: block_manager/bench.py",
        "3: scheduler/nowhere",
    ]


def test_gpu_check_uses_the_venv_without_python_on_path(tmp_path):
    """After the README install no python3 need be on PATH: the script finds .venv's."""
    if not (REPO_ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("needs the README install's .venv")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    env = {"PATH": str(bin_dir), "CUDA_VISIBLE_DEVICES": "", "HOME": str(tmp_path)}
    result = subprocess.run(
        [shutil.which("bash"), str(REPO_ROOT / "scripts" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().endswith("torch sees no CUDA device; nothing to check")
