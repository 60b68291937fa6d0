"""What `kubedistill run` does next: a pure function of what it observed, like the operator's
`policy.plan` (kubedistill.operator.policy), and through the same gang policy
(kubedistill.api.failures), so spec.backoffLimit, restarts and disruptions mean the same in both.

The loop in local.py observes (the launcher's process exits, trainer rank 0's /status, the
clock), calls `decide`, and carries out its actions; nothing here starts, stops or reads anything.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kubedistill.api.failures import GangDecision, GangFailure, GangOutcome, decide_gang_failure
from kubedistill.api.progress import TrainerProgress


@dataclass(frozen=True)
class ActorLost:
    """The Ray actor hosting a process died: its worker process or its node went away, and the
    process with it (launch.spawn). What the cluster would call a disruption: nothing the process did."""

    reason: str
    """CamelCase, as a disruption reason: NodePreempted (Ray drained the node to preempt it) or RayActorDied."""
    detail: str
    """Ray's own word on why."""


Exit = int | None | ActorLost
"""A process as one poll sees it: running (None), exited with this code, or lost with its actor."""


def exit_text(code: Exit) -> str:
    """How a process ended, for messages: "exited with -9 (SIGKILL)", "lost its Ray actor (...)"."""
    if isinstance(code, ActorLost):
        return f"lost its Ray actor ({code.reason}: {code.detail})"
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"exited with {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exited with {code}"


def gang_failures(gang: Sequence[str], exits: Mapping[str, Exit]) -> list[GangFailure]:
    """The stopped members of the trainer gang (`gang`: process names in rank order), as the
    failure policy's causes.

    Any exit of the process itself, whatever the code or signal (a crash, the OOM killer's
    SIGKILL, a `kill` by hand), is the job's own failure: the supervisor cannot tell who sent a
    signal, and the operator likewise counts a pod deleted by hand. Only the host of the process
    going away (a Ray actor) is a disruption. Ranks >= 1 exit 0 when rank 0 closes the gang, and
    rank 0's exit 0 is the job's success, after which nothing counts as a failure."""
    if exits.get(gang[0]) == 0:
        return []
    out = []
    for name in gang:
        code = exits.get(name)
        if isinstance(code, ActorLost):
            out.append(GangFailure("trainer process", name, "is gone", code.reason))
        elif code not in (None, 0):
            out.append(GangFailure("trainer process", name, exit_text(code)))
    return out


def gang_record(decision: GangDecision, code: Exit, history_lines: int, seconds: float) -> dict[str, Any]:
    """The report's entry for a gang restart (outcome["restarts"]) or a disruption (outcome["disruptions"])."""
    record: dict[str, Any] = {"process": decision.cause.name}
    if decision.outcome is GangOutcome.disrupted:
        record["reason"] = decision.cause.disruption
        record["detail"] = code.detail if isinstance(code, ActorLost) else exit_text(code)
    else:
        record["exitCode"] = code if not isinstance(code, ActorLost) else None
    record.update(historyLines=history_lines, seconds=seconds, message=decision.message)
    return record


@dataclass(frozen=True)
class Supervised:
    """What the supervisor knows of the job, fixed for the run."""

    gang: tuple[str, ...]
    """The trainer processes in rank order; the first is rank 0, whose exit 0 is the job's success."""
    backoff_limit: int
    active_deadline_seconds: int | None
    started: float
    """When the processes were started: activeDeadlineSeconds counts from here."""


@dataclass(frozen=True)
class SupervisorStatus:
    """What the supervisor carries from one decision to the next (the operator keeps the same in
    the job's status)."""

    restarts: int = 0
    disruptions: int = 0
    last_checkpoint: str | None = None
    """The newest checkpoint the trainer reported, across gang restarts."""


@dataclass(frozen=True)
class Observed:
    job: Supervised
    status: SupervisorStatus
    exits: Mapping[str, Exit]
    """Every process the launcher runs, as its last poll saw it."""
    retiring: frozenset[str] = frozenset()
    """Removed rollout replicas still draining: their end is expected, not a failure."""


@dataclass(frozen=True)
class Finish:
    code: int
    """The exit code of `kubedistill run`."""
    reason: str
    """CamelCase, as the operator's condition reasons: TrainerSucceeded, DeadlineExceeded, ..."""
    result: str
    """The report's result: "succeeded", or why the job failed."""


@dataclass(frozen=True)
class Actions:
    status: SupervisorStatus
    restart_gang: GangDecision | None = None
    """Stop every trainer process and start the gang again (the servers keep running)."""
    finish: Finish | None = None
    """Stop every process and end the run."""


def decide(observed: Observed, progress: TrainerProgress | None, now: float) -> Actions:
    """The next actions. `progress`: trainer rank 0's /status this time, None when it did not
    answer; `now`: time.time()."""
    job, exits = observed.job, observed.exits
    status = observed.status
    if progress is not None and progress.last_checkpoint:
        status = replace(status, last_checkpoint=progress.last_checkpoint)
    deadline = job.active_deadline_seconds
    if deadline is not None and now - job.started >= deadline:
        why = f"the job ran longer than activeDeadlineSeconds ({deadline} s)"
        return Actions(status, finish=Finish(1, "DeadlineExceeded", why))
    rank0 = job.gang[0]
    if exits.get(rank0) == 0:
        return Actions(status, finish=Finish(0, "TrainerSucceeded", "succeeded"))
    decision = decide_gang_failure(
        gang_failures(job.gang, exits),
        restarts=status.restarts,
        disruptions=status.disruptions,
        backoff_limit=job.backoff_limit,
        last_checkpoint=status.last_checkpoint,
    )
    if decision is not None and decision.outcome is GangOutcome.failed:
        code = exits.get(rank0)
        own = code if isinstance(code, int) and code != 0 else 1
        return Actions(status, finish=Finish(own, decision.reason, decision.message))
    if decision is not None:
        status = replace(status, restarts=decision.restarts, disruptions=decision.disruptions)
        return Actions(status, restart_gang=decision)
    # Ranks >= 1 end (exit 0) when rank 0 closes the gang, a moment before rank 0 exits; any other
    # end of a trainer rank went through the gang policy above. A server's end ends the run.
    failed = [n for n, c in exits.items() if c is not None and n not in job.gang and n not in observed.retiring]
    if failed:
        return Actions(status, finish=Finish(1, "ProcessFailed", f"{failed[0]} {exit_text(exits[failed[0]])}"))
    return Actions(status)
