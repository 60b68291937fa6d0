"""`kubedistill run`'s end of a failed job (runtime/entrypoints/local.py, Supervisor.finish)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

from kubedistill.runtime.entrypoints.local import Supervisor
from kubedistill.runtime.entrypoints.supervisor import Finish


def test_a_failure_before_the_trainer_started_reports_the_failed_process(tmp_path: Path) -> None:
    # Environment servers start in a wave of their own: when one exits, the trainer was never
    # started, so the exits the launcher reports do not name it.
    (tmp_path / "env-calc-0.log").write_text("ImportError: no module named openenv\n")
    local: Any = SimpleNamespace(gang=[SimpleNamespace(name="trainer-0")], logs=tmp_path)
    lines: list[str] = []
    loop = Supervisor(local, MagicMock(), {}, lines.append, False, http=MagicMock())
    code = loop.finish(Finish(1, "ProcessFailed", "env-calc-0 exited with 1"), {"env-calc-0": 1})
    assert code == 1
    assert any("last lines of env-calc-0" in line and "no module named openenv" in line for line in lines)
    assert not any("trainer-0" in line for line in lines)
