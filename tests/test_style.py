"""The tree is clean under ruff (lint, format) and mypy, as configured in pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUFF = [sys.executable, "-m", "ruff"]


def test_ruff_lint() -> None:
    r = subprocess.run([*RUFF, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff check (fix with `ruff check --fix .`):\n{r.stdout}{r.stderr}"


def test_ruff_format() -> None:
    r = subprocess.run([*RUFF, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff format (fix with `ruff format .`):\n{r.stdout}{r.stderr}"


@pytest.mark.standalone
def test_mypy() -> None:
    """Strict on kubedistill/, operator/ and runtime/driver/, default elsewhere (pyproject.toml)."""
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "typecheck.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=900,
    )
    assert r.returncode == 0, f"mypy (bash scripts/typecheck.sh):\n{r.stdout}{r.stderr}"


MAX_FUNCTION_LINES = 80


def test_no_product_function_is_over_80_lines() -> None:
    """Long functions in the operator and the runtime get split into named steps (issue 37)."""
    import ast

    long = []
    for folder in ("operator", "runtime", "kubedistill"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)
