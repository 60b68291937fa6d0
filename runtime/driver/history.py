"""The per-step history of a run: one JSON line per train step, appended by trainer rank 0 to the
file named by HISTORY_ENV (set by `kubedistill run`). Each line is the step's /status document
(kubedistill.api.progress.TrainerProgress) plus per-step extras: `time` (seconds since the
driver started, at the step's end), `runId` (the driver process: a restarted trainer appends to the
same file), losses, sync and wait times, `phases` (the step's time budget,
docs/design.md#step-time-budget), the groups trained, `lagHistogram` and `offPolicy`
(docs/algorithms.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubedistill.api.progress import HISTORY_ENV

HistoryLine = dict[str, Any]


@dataclass
class HistoryWriter:
    """Appends one JSON line per train step to a file (nothing when path is None), and hands each
    line to the sinks (the experiment trackers, runtime/trackers.py)."""

    path: Path | None = None
    _lines: list[HistoryLine] = field(default_factory=list)
    sinks: list[Callable[[HistoryLine], None]] = field(default_factory=list)
    closed: bool = False
    """Set when the process is ending (SIGTERM): later steps are recorded nowhere, so the file
    and the trackers agree on what this run trained (a resume trains those steps again)."""

    @classmethod
    def from_env(cls, sinks: list[Callable[[HistoryLine], None]] | None = None) -> HistoryWriter:
        p = os.environ.get(HISTORY_ENV)
        return cls(Path(p) if p else None, sinks=list(sinks or []))

    def write(self, line: HistoryLine) -> None:
        if self.closed:
            return
        self._lines.append(line)
        for sink in self.sinks:
            sink(line)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    @property
    def lines(self) -> list[HistoryLine]:
        return list(self._lines)


def read_history(path: Path) -> list[HistoryLine]:
    """The lines a HistoryWriter wrote to `path` ([] before the first step)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
