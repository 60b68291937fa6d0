"""Let PyPI's CUDA torchvision import on the CPU build of torch (CI, laptops, the CPU quickstart).

Why: every Qwen-VL processor in transformers needs torchvision (its video processor), and so do
vLLM's Qwen-VL model files. The only torchvision wheel matching torch 2.13.0 is PyPI's 0.28.0, a
CUDA build. Its compiled ops (torchvision::nms, roi_align, ...) cannot load against the CPU torch.
torchvision copes with that everywhere (`torchvision.extension._has_ops()` is then False) except in
`torchvision._meta_registrations`, which registers the fake kernels of nms and qnms regardless:
`torch.library.register_fake("torchvision::nms")` raises `operator torchvision::nms does not
exist`, so `import torchvision` fails, and with it `import vllm`.

What: `install()` puts a finder at the front of `sys.meta_path` that answers one import only,
`torchvision._meta_registrations`, and only when torchvision's compiled ops did not load: it then
gives an empty module instead. Fake kernels of absent ops have nothing to describe, so nothing is
lost: the pure-Python transforms (all an image or video processor uses) work, and the detection
ops (nms, roi_align, ...) raise as they would anyway. Where the ops load (GPU images, which install
the real torchvision and never run this) the finder steps aside and torchvision imports unchanged.

How it is activated: scripts/install.sh writes PTH_NAME into the venv's site-packages, one line
(PTH_LINE) that calls `install()` at every interpreter start (the engine's subprocesses and Ray
workers too). Re-running the script rewrites the same file; `pip install` of torchvision or vLLM
leaves it alone; without kubedistill installed the line does nothing. Standard library only: it
runs at every start of the venv's Python, so it stays cheap: no typing, no importlib.abc.
"""

from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

TARGET = "torchvision._meta_registrations"
PTH_NAME = "kubedistill-torchvision-cpu.pth"
PTH_LINE = (
    'import sys; exec("try:\\n from kubedistill.runtime import torchvision_cpu\\n'
    ' torchvision_cpu.install()\\nexcept ImportError:\\n pass")'
)
"""The .pth line: site.py executes lines that start with `import`; a missing package is no error."""


class SkipFakeOpsFinder:
    """Meta-path finder and loader of an empty `torchvision._meta_registrations` when torchvision's
    compiled ops are absent."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if fullname != TARGET:
            return None
        extension = sys.modules.get("torchvision.extension")  # torchvision/__init__ imports it first
        if extension is None or extension._has_ops():
            return None
        # The loader by duck typing (importlib.abc.Loader would import typing at every start).
        return ModuleSpec(fullname, self, origin=__name__)  # type: ignore[arg-type]

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = f"Left empty by {__name__}: torchvision's compiled ops did not load on this torch."
        module.SKIPPED_BY = __name__  # type: ignore[attr-defined]


def installed() -> bool:
    return any(isinstance(f, SkipFakeOpsFinder) for f in sys.meta_path)


def install() -> None:
    """Put the finder first on sys.meta_path (once). Must run before torchvision is imported."""
    if not installed():
        sys.meta_path.insert(0, SkipFakeOpsFinder())


def write_pth(site_packages: str) -> str:
    """Write PTH_NAME into `site_packages` (what scripts/install.sh calls); returns its path."""
    from pathlib import Path

    path = Path(site_packages) / PTH_NAME
    path.write_text(PTH_LINE + "\n")
    return str(path)
