"""The tree is clean under ruff (lint, format) and mypy, as configured in pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUFF = [sys.executable, "-m", "ruff"]


def test_ruff_lint() -> None:
    r = subprocess.run([*RUFF, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff check (fix with `ruff check --fix .`):\n{r.stdout}{r.stderr}"


def test_ruff_format() -> None:
    r = subprocess.run([*RUFF, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff format (fix with `ruff format .`):\n{r.stdout}{r.stderr}"


def test_mypy() -> None:
    """Strict on kubedistill/, operator/ and runtime/driver/, default elsewhere (pyproject.toml)."""
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "typecheck.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=600,
    )
    assert r.returncode == 0, f"mypy (bash scripts/typecheck.sh):\n{r.stdout}{r.stderr}"
