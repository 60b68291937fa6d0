"""A real MLflow tracking server (sqlite store) for tests, from the venv scripts/install.sh makes
beside the project's (.venv/mlflow-server): the trackers' tests talk to it on loopback, and the
real-node tier's pods through the node's bridge."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ports import free_port
from served_process import ServedProcess

ROOT = Path(__file__).resolve().parent.parent
MLFLOW_SERVER = ROOT / ".venv" / "mlflow-server" / "bin" / "mlflow"


class MlflowServer(ServedProcess):
    """Started at construction (its imports take 40-100 s on 2 busy cores: start it early);
    `uri()` waits until it answers."""

    def __init__(self, home: Path, host: str = "127.0.0.1"):
        if not MLFLOW_SERVER.exists():
            raise RuntimeError(f"{MLFLOW_SERVER} is missing: run scripts/install.sh (it installs it there)")
        self.home = home
        self.port = free_port(host)
        super().__init__(
            "MLflow",
            [str(MLFLOW_SERVER), "server", "--host", host, "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{home}/mlflow.db", "--default-artifact-root", str(home / "artifacts"),
             # Pods reach it by the node's address: MLflow's host-header check allows loopback only.
             "--allowed-hosts", "*"],
            f"http://{host}:{self.port}",
            home,
            home / "server.log",
            {**os.environ, "MLFLOW_TRACKING_URI": ""},
        )  # fmt: skip

    def uri(self, timeout: float = 300) -> str:
        return self.wait(timeout)


@contextlib.contextmanager
def mlflow_server(home: Path, host: str = "127.0.0.1") -> Iterator[str]:
    server = MlflowServer(home, host)
    try:
        yield server.uri()
    finally:
        server.stop()
