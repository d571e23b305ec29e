"""Running a script of scripts/ as a user does: its own process, from the repository
root, with this interpreter; output captured for the tests of the script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python scripts/<name> args...``; the completed process (stdout, stderr, code)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
