"""Checks that need only the source tree, started in the background as soon as pytest has collected
them: mypy is one single-threaded process of about a minute, and the suite, which mostly waits on
its role processes, leaves a core free for it (tests/test_style.py collects the result)."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TYPECHECK_TEST = "tests/test_style.py::test_mypy"

_typecheck: tuple[subprocess.Popen[bytes], Path] | None = None


def start_typecheck() -> None:
    """Start `scripts/typecheck.sh` (once), its output to a file."""
    global _typecheck
    if _typecheck is not None:
        return
    out = Path(tempfile.mkstemp(prefix="kubedistill-mypy-", suffix=".log")[1])
    with out.open("wb") as f:
        proc = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "typecheck.sh")],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHON": sys.executable},
        )
    _typecheck = (proc, out)
    atexit.register(_stop, proc, out)  # a session ended early (-x, ^C) leaves no mypy behind


def _stop(proc: subprocess.Popen[bytes], out: Path) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    out.unlink(missing_ok=True)


def typecheck_result(timeout: float = 600) -> tuple[int, str]:
    """mypy's exit code and output: of the run started early, else of one started now."""
    start_typecheck()
    assert _typecheck is not None
    proc, out = _typecheck
    code = proc.wait(timeout=timeout)
    return code, out.read_text()
