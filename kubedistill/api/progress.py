"""What trainer rank 0 reports about a run: the JSON of its GET /status.

The trainer's driver writes it (kubedistill.runtime.driver), the operator reads it to fill the
job's status (kubedistill.operator.policy) and `kubedistill run` to show progress
(kubedistill.runtime.entrypoints.local). The per-step history lines the trainer appends to the
file named by HISTORY_ENV hold the same fields plus per-step extras (runtime/driver/history.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import ConfigDict

from kubedistill.api.base import ApiModel
from kubedistill.api.status import HeldOutEvaluation

TERMINATION_LOG = "/dev/termination-log"
"""Where a Kubernetes container's last words go (the kubelet's default terminationMessagePath):
the kubelet copies the file, up to TERMINATION_LIMIT bytes, into the pod's status."""
TERMINATION_LIMIT = 4096

HISTORY_ENV = "KUBEDISTILL_HISTORY"
"""Set on trainer rank 0: the file it appends one JSON line to per train step."""

TrainerPhase = Literal["starting", "running", "done", "failed"]
PHASES: tuple[TrainerPhase, ...] = get_args(TrainerPhase)


class TrainerProgress(ApiModel):
    """GET /status of trainer rank 0. Every key is present in the JSON, null while unknown,
    except `message`, which appears only when the run failed."""

    # A reader may meet a trainer of another version: it takes the fields it knows and ignores
    # the rest, and every field has a default so that an older trainer's subset reads too.
    model_config = ConfigDict(extra="ignore")

    step: int = 0
    """Train steps completed."""
    total_steps: int = 0
    """spec.trainer.totalSteps."""
    weight_version: int = 0
    """Weight version of the last sync to the rollout servers."""
    last_checkpoint: str | None = None
    """Path of the newest checkpoint."""
    phase: TrainerPhase = "starting"
    samples_per_second: float | None = None
    """Samples trained on per second since the driver started."""
    reward_mean: float | None = None
    """Mean task reward of the last step's samples."""
    kl_student_teacher: float | None = None
    """Estimated reverse KL(student || teacher) per token, last step."""
    staleness_mean: float | None = None
    """Mean version lag of the last step's samples."""
    trainer_idle_ratio: float | None = None
    """Fraction of wall time the trainer waited for samples."""
    rollout_servers: list[str] | None = None
    """Base URLs of the rollout servers the driver holds: in its rotation, joining its weight-sync
    group, or still draining. A rollout pod whose URL is listed must not be taken away yet (a
    scale-down waits for it to leave the list). None: not reported (an older trainer)."""
    evaluation: HeldOutEvaluation | None = None
    """The last held-out evaluation (spec.evaluation); None before the first one."""
    message: str | None = None
    """Why the run failed (phase failed)."""

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TrainerProgress:
        """Read a /status document (or a history line). Raises pydantic.ValidationError, a
        ValueError, on a malformed one."""
        return cls.model_validate(doc)

    def to_json(self) -> dict[str, Any]:
        """The /status document, keys in field order."""
        return self.model_dump(by_alias=True, exclude={"message"} if self.message is None else None)

    def set_phase(self, phase: TrainerPhase, message: str | None = None) -> None:
        # Attribute assignment is not validated, and the phase reaches the operator.
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        self.phase = phase
        self.message = message


def termination_message(progress: TrainerProgress, limit: int = TERMINATION_LIMIT) -> str:
    """The trainer's final /status document as compact JSON of at most `limit` bytes, for the
    container's termination message: the operator reads the last step and held-out evaluation
    from the pod's status once the trainer has exited, where a last GET /status would have come
    too late. What does not fit goes, least needed first: the rollout servers and the message,
    then the evaluation's per-source results, then the evaluation."""
    doc = progress.to_json()
    for drop in ((), ("rolloutServers", "message"), ("evaluation.sources",), ("evaluation",)):
        for key in drop:
            head, _, tail = key.partition(".")
            if tail and isinstance(doc.get(head), dict):
                doc[head] = {k: v for k, v in doc[head].items() if k != tail}
            else:
                doc.pop(key, None)
        text = json.dumps(doc, separators=(",", ":"))
        if len(text.encode()) <= limit:
            return text
    return json.dumps({"step": progress.step, "weightVersion": progress.weight_version}, separators=(",", ":"))
