"""OpenEnv environment servers for the tests: `uvicorn APP` in a venv of OpenEnv's own (made by
examples/environments/install-openenv.sh), a real process as an environment's image runs it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ports import free_port
from served_process import ServedProcess

ROOT = Path(__file__).resolve().parent.parent
INSTALL_OPENENV = ROOT / "examples" / "environments" / "install-openenv.sh"
OPENENV_VENVS = {
    "openenv-core==0.3.0": ROOT / ".venv" / "openenv-core-0.3.0",
    "openenv==0.10.0": ROOT / ".venv" / "openenv-0.10.0",
}


def openenv_python(spec: str) -> Path:
    """The python of the venv holding `spec`, installed first if it is not there (the script is
    idempotent, and fast when it is)."""
    venv = OPENENV_VENVS[spec]
    marker = venv / "installed"
    if not (marker.exists() and marker.read_text().strip() == spec):
        subprocess.run(["bash", str(INSTALL_OPENENV)], check=True)
    return venv / "bin" / "python"


class OpenEnvServer(ServedProcess):
    """`uvicorn APP` (module:attribute, imported from `cwd`) in an OpenEnv venv, on loopback: a
    real process, as an environment's image runs it. Started at construction (openenv imports
    gradio: 6 s of CPU, 30-40 s on 2 busy cores: start servers early and together); `url()` waits
    until /health answers."""

    def __init__(self, spec: str, cwd: Path, app: str, log: Path, env: dict[str, str] | None = None):
        self.spec = spec
        self.port = free_port()
        python = openenv_python(spec)
        super().__init__(
            spec,
            [str(python), "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(self.port)],
            f"http://127.0.0.1:{self.port}",
            cwd,
            log,
            {**os.environ, "PYTHONPATH": str(cwd), **(env or {})},
        )

    def url(self, timeout: float = 300) -> str:
        return self.wait(timeout)
