"""The product holds no code that exists only for tests or benches."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from unittest.mock import MagicMock

import pytest

from kubedistill.api.roleconfig import Identity, Role
from kubedistill.runtime.engines.base import Engine
from kubedistill.runtime.entrypoints.roles import add_commands
from kubedistill.runtime.servers.rollout import build_rollout_app
from server_fixtures import job_config

DEBUG_ROUTES = {"/weights/checksums"}


@pytest.mark.parametrize("debug", [False, True])
def test_checksums_are_served_only_with_debug_endpoints(tmp_path: Path, debug: bool) -> None:
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
"""pyproject's package-dir: the product's packages and the folders they install from."""
IMAGE_ENTRIES = [
    "kubedistill.cli",  # the images' ENTRYPOINT: `kubedistill role ...`, `kubedistill operator`
    "kubedistill.runtime.entrypoints.roles",
    "kubedistill.runtime.entrypoints.trainer",
    "kubedistill.runtime.servers.rollout",
    "kubedistill.runtime.servers.teacher",
    "kubedistill.operator.main",
]
_TEST_AND_BENCH = {p.stem for p in (ROOT / "tests").glob("*.py")} | {p.stem for p in (ROOT / "bench").glob("*.py")}


def _source(module: str, dirs: Mapping[str, Path] = PACKAGE_DIRS) -> Path | None:
    for package, folder in sorted(dirs.items(), key=lambda kv: -len(kv[0])):
        if module == package or module.startswith(package + "."):
            rel = module.removeprefix(package).lstrip(".").replace(".", "/")
            base = folder / rel if rel else folder
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    return path
    return None


def _imports(path: Path, roots: Collection[str]) -> set[str]:
    """Every module under `roots` the file names: import statements anywhere (lazy ones and
    TYPE_CHECKING ones included), and kubedistill.* names in strings (importlib.import_module, `python -m`
    argv, vLLM's worker_extension_cls)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("kubedistill."):
            out.add(node.value.split(":")[0])
    return {m for m in out if m.split(".")[0] in roots}


def closure(entries: Iterable[str], dirs: Mapping[str, Path] = PACKAGE_DIRS, skip: Collection[str] = ()) -> set[str]:
    """The modules of `dirs` that `entries` can import, lazily or not (never through `skip`), with
    the packages above each (importing a module runs its packages' __init__ first)."""
    roots = {package.split(".")[0] for package in dirs} | _TEST_AND_BENCH
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _source(module, dirs)
        if path is not None:
            todo += [m for m in _imports(path, roots) if m not in skip]
            todo += [module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)]
        elif "." in module:  # a name inside a module (from m import name, "m.Class" strings)
            todo.append(module.rsplit(".", 1)[0])
    return seen


def modules_in(dirs: Mapping[str, Path] = PACKAGE_DIRS) -> set[str]:
    """Every module the product's packages hold, by its installed name."""
    out = set()
    for package, folder in dirs.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            out.add(".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)]))
    return out


def product_entries() -> list[str]:
    """Where the product starts: its console scripts (pyproject), and the modules the images'
    Dockerfiles run (the runtime image's build runs kubedistill.runtime.torchvision_cpu). A role
    started as `python -m kubedistill.cli ...` is named as a string in the module that starts it."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entries = [target.split(":")[0] for target in scripts.values()]
    for dockerfile in sorted((ROOT / "images").glob("*/Dockerfile")):
        entries += [m for m in re.findall(r"kubedistill(?:\.\w+)+", dockerfile.read_text()) if _source(m)]
    return entries


def image_closure() -> set[str]:
    """The modules the runtime and operator images' commands can import, lazily or not, except the
    demo commands (kubedistill.cli.DEMO_COMMANDS), which load their package only when they run."""
    from kubedistill.cli import DEMO_COMMANDS

    return closure(IMAGE_ENTRIES, skip={module for module, _ in DEMO_COMMANDS.values()})


def _importers(module: str) -> list[str]:
    """The test and bench files that import `module` (for the failure message)."""
    files = sorted([*(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py")])
    return [str(f.relative_to(ROOT)) for f in files if module in _imports(f, {"kubedistill"})]


def test_every_product_module_is_reached_from_the_products_entry_points() -> None:
    """Nothing in kubedistill/, operator/ or runtime/ exists only for tests or benches (issue 49):
    a module the product never imports goes to tests/ or bench/, beside its users."""
    reached = closure(product_entries())
    assert {"kubedistill.runtime.engines.vllm_worker", "kubedistill.demo.quickstart"} <= reached
    stray = {m: _importers(m) for m in sorted(modules_in() - reached)}
    assert stray == {}, f"product modules no entry point reaches (module: the tests/benches importing it): {stray}"


def test_the_reachability_check_finds_a_module_only_tests_import(tmp_path: Path) -> None:
    """The check above on a tree of its own: lazy imports, packages and names in strings count as
    reached; a module only a test imports does not."""
    pkg = tmp_path / "kubedistill"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "cli.py": "def main():\n    from kubedistill.sub import lazy\n    start('kubedistill.named:run')\n",
        "sub/__init__.py": "",
        "sub/lazy.py": "",
        "named.py": "",
        "stray.py": "",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    (tmp_path / "test_x.py").write_text("from kubedistill import stray\n")
    dirs = {"kubedistill": pkg}
    reached = closure(["kubedistill.cli"], dirs)
    assert modules_in(dirs) - reached == {"kubedistill.stray"}


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
