"""The GPU ids a local run may hand its role processes, found without importing torch (the
`kubedistill` command line decides with it before any heavy import)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path


def visible_gpus(environ: Mapping[str, str], dev: Path = Path("/dev")) -> list[str]:
    """The GPU ids child processes may use: CUDA_VISIBLE_DEVICES when set, else one per
    /dev/nvidiaN (a container sees only its own, renumbered from 0 by CUDA)."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        count = sum(1 for p in dev.iterdir() if re.fullmatch(r"nvidia\d+", p.name))
    except OSError:
        count = 0
    return [str(i) for i in range(count)]
