"""What trainer rank 0 reports about the run: the JSON of GET /status (polled by the operator and
`kubedistill run`) and the per-step history lines (env KUBEDISTILL_HISTORY). Pure data."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("starting", "running", "done", "failed")
HISTORY_ENV = "KUBEDISTILL_HISTORY"


@dataclass
class DriverStatus:
    total_steps: int
    step: int = 0
    weight_version: int = 0
    last_checkpoint: str | None = None
    phase: str = "starting"
    samples_per_second: float | None = None
    reward_mean: float | None = None
    kl_student_teacher: float | None = None
    staleness_mean: float | None = None
    trainer_idle_ratio: float | None = None
    message: str | None = None
    """Why the run failed (phase failed)."""

    def set_phase(self, phase: str, message: str | None = None) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        self.phase = phase
        self.message = message

    def to_json(self) -> dict[str, Any]:
        out = {
            "step": self.step,
            "totalSteps": self.total_steps,
            "weightVersion": self.weight_version,
            "lastCheckpoint": self.last_checkpoint,
            "phase": self.phase,
            "samplesPerSecond": self.samples_per_second,
            "rewardMean": self.reward_mean,
            "klStudentTeacher": self.kl_student_teacher,
            "stalenessMean": self.staleness_mean,
            "trainerIdleRatio": self.trainer_idle_ratio,
        }
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass
class HistoryWriter:
    """Appends one JSON line per train step to a file (nothing when path is None)."""

    path: Path | None = None
    _lines: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_env(cls) -> HistoryWriter:
        p = os.environ.get(HISTORY_ENV)
        return cls(Path(p) if p else None)

    def write(self, line: dict[str, Any]) -> None:
        self._lines.append(line)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    @property
    def lines(self) -> list[dict[str, Any]]:
        return list(self._lines)
