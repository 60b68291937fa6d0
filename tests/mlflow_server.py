"""A real MLflow tracking server (sqlite store) for tests, from the venv scripts/install.sh makes
beside the project's (.venv/mlflow-server): the trackers' tests talk to it on loopback, and the
real-node tier's pods through the node's bridge."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from ports import free_port

ROOT = Path(__file__).resolve().parent.parent
MLFLOW_SERVER = ROOT / ".venv" / "mlflow-server" / "bin" / "mlflow"


class MlflowServer:
    """Started at construction (its imports take 40-100 s on 2 busy cores: start it early);
    `uri()` waits until it answers."""

    def __init__(self, home: Path, host: str = "127.0.0.1"):
        if not MLFLOW_SERVER.exists():
            raise RuntimeError(f"{MLFLOW_SERVER} is missing: run scripts/install.sh (it installs it there)")
        self.home = home
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.proc = subprocess.Popen(
            [str(MLFLOW_SERVER), "server", "--host", host, "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{home}/mlflow.db", "--default-artifact-root", str(home / "artifacts"),
             # Pods reach it by the node's address: MLflow's host-header check allows loopback only.
             "--allowed-hosts", "*"],
            cwd=home, stdout=open(home / "server.log", "w"), stderr=subprocess.STDOUT,
            env={**os.environ, "MLFLOW_TRACKING_URI": ""}, start_new_session=True,
        )  # fmt: skip

    def uri(self, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the MLflow server did not start: {(self.home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def mlflow_server(home: Path, host: str = "127.0.0.1") -> Iterator[str]:
    server = MlflowServer(home, host)
    try:
        yield server.uri()
    finally:
        server.stop()
