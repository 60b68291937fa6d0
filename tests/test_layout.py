"""Packaging rules from the project's design card."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_checkout_never_shadows_stdlib_operator() -> None:
    # `python -c` from the repository root puts the checkout first on sys.path.
    r = subprocess.run(
        [sys.executable, "-S", "-c", "import operator, sys; print(operator.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert not r.stdout.strip().startswith(str(ROOT))
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "runtime" / "__init__.py").exists()


def test_operator_package_does_not_import_torch() -> None:
    code = (
        "import sys, pkgutil, importlib, kubedistill.operator as op, kubedistill.cli\n"
        "for m in pkgutil.walk_packages(op.__path__, 'kubedistill.operator.'):\n"
        "    importlib.import_module(m.name)\n"
        "kubedistill.cli.build_parser()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT / "tests")


def test_every_package_dir_is_declared() -> None:
    """Wheels install only the packages pyproject lists: every folder holding Python code is one."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(cfg["packages"])
    mapping = cfg["package-dir"]
    found = set()
    for package, folder in mapping.items():
        for py in (ROOT / folder).rglob("*.py"):
            rel = py.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    assert found <= declared, f"add to [tool.setuptools] packages: {sorted(found - declared)}"
