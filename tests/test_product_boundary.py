"""The product holds no code that exists only for tests or benches."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import MagicMock

import pytest

from kubedistill.api.roleconfig import Identity, Role
from kubedistill.runtime.engines.base import Engine
from kubedistill.runtime.entrypoints.roles import add_commands
from kubedistill.runtime.servers.rollout import build_rollout_app
from server_fixtures import job_config

DEBUG_ROUTES = {"/weights/checksums", "/weights/probe"}


@pytest.mark.parametrize("debug", [False, True])
def test_checksums_and_the_transport_probe_are_served_only_with_debug_endpoints(tmp_path: Path, debug: bool) -> None:
    config = job_config(
        tmp_path / "student",
        tmp_path / "teacher",
        engine="hf",
        rollout_urls=["http://127.0.0.1:1"],
        teacher_urls=["http://127.0.0.1:2"],
        weight_sync_port=3,
    )
    app = build_rollout_app(config, Identity(role=Role.rollout), MagicMock(spec=Engine), debug_endpoints=debug)
    paths = {getattr(r, "path", "") for r in app.routes}
    assert "/weights/begin" in paths
    assert (DEBUG_ROUTES <= paths) is debug and (DEBUG_ROUTES & paths == set()) is not debug


def test_debug_endpoints_are_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    def parse(*args: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_commands(parser.add_subparsers())
        return parser.parse_args(["role", "rollout", *args])

    monkeypatch.delenv("KUBEDISTILL_DEBUG_ENDPOINTS", raising=False)
    assert parse().debug_endpoints is False
    assert parse("--debug-endpoints").debug_endpoints is True
    monkeypatch.setenv("KUBEDISTILL_DEBUG_ENDPOINTS", "1")
    assert parse().debug_endpoints is True


ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {
    "kubedistill": ROOT / "kubedistill",
    "kubedistill.operator": ROOT / "operator",
    "kubedistill.runtime": ROOT / "runtime",
}
IMAGE_ENTRIES = [
    "kubedistill.cli",  # the images' ENTRYPOINT: `kubedistill role ...`, `kubedistill operator`
    "kubedistill.runtime.entrypoints.roles",
    "kubedistill.runtime.entrypoints.trainer",
    "kubedistill.runtime.servers.rollout",
    "kubedistill.runtime.servers.teacher",
    "kubedistill.operator.main",
]


def _source(module: str) -> Path | None:
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if module == package or module.startswith(package + "."):
            rel = module.removeprefix(package).lstrip(".").replace(".", "/")
            base = folder / rel if rel else folder
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    return path
    return None


def _imports(path: Path) -> set[str]:
    """Every kubedistill module the file names: import statements anywhere (lazy ones included),
    and module names in strings (importlib.import_module)."""
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("kubedistill."):
            out.add(node.value.split(":")[0])
    return {m for m in out if m.split(".")[0] == "kubedistill" or m.split(".")[0] in _TEST_AND_BENCH}


_TEST_AND_BENCH = {p.stem for p in (ROOT / "tests").glob("*.py")} | {p.stem for p in (ROOT / "bench").glob("*.py")}


def image_closure() -> set[str]:
    """The modules the runtime and operator images' commands can import, lazily or not, except the
    demo commands (kubedistill.cli.DEMO_COMMANDS), which load their package only when they run."""
    from kubedistill.cli import DEMO_COMMANDS

    demo_entries = {module for module, _ in DEMO_COMMANDS.values()}
    seen: set[str] = set()
    todo = list(IMAGE_ENTRIES)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _source(module)
        if path is not None:
            todo += [m for m in _imports(path) if m not in demo_entries]
        elif "." in module:  # a name inside a module (from m import name, "m.Class" strings)
            todo.append(module.rsplit(".", 1)[0])
    return seen


def test_the_runtime_image_imports_no_demo_test_or_bench_module() -> None:
    closure = image_closure()
    assert "kubedistill.runtime.trainer.trainer" in closure and "kubedistill.runtime.engines.hf" in closure
    found = sorted(m for m in closure if m.startswith("kubedistill.demo") or m.split(".")[0] in _TEST_AND_BENCH)
    assert found == []


def test_the_runtime_image_ships_no_test_or_bench_folder() -> None:
    for image in ("runtime", "operator"):
        copied = [
            line.split()[1]
            for line in (ROOT / f"images/{image}/Dockerfile").read_text().splitlines()
            if line.startswith("COPY ") and "--from" not in line
        ]
        assert not {c.rstrip("/") for c in copied} & {"tests", "bench", "examples"}, (image, copied)


def test_the_demo_commands_load_the_demo_package_only_when_they_run() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kubedistill.cli as c\n"
        "c.build_parser().parse_args(['role', 'rollout'])\n"
        "assert not [m for m in sys.modules if m.startswith('kubedistill.demo')], 'demo imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT / "tests")
