"""A server a test runs as a real process (MLflow's, an OpenEnv environment's): started in a
session of its own at construction, waited for on its GET /health, stopped with its group."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path


class ServedProcess:
    def __init__(self, name: str, argv: Sequence[str], base: str, cwd: Path, log: Path, env: Mapping[str, str]) -> None:
        self.name, self.base, self.log = name, base, log
        self.proc = subprocess.Popen(
            list(argv), cwd=cwd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=dict(env),
            start_new_session=True,
        )  # fmt: skip

    def wait(self, timeout: float = 300) -> str:
        """The base URL once /health answers 200; the log's tail if the process ends or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.base
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} server did not start: {self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        self.proc.wait(timeout=30)
