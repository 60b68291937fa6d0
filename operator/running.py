"""The decisions about a job that runs, one pure function per phase of a reconcile pass.

policy.plan calls them in this order: deadline, success, gang, replacement, drain, creates,
phase. Each reads what was observed and returns what to do; policy applies it to the Plan.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from kubedistill.api.failures import GangDecision, GangFailure, decide_gang_failure
from kubedistill.api.roleconfig import Role
from kubedistill.api.spec import DistillationJobSpec, ResumePolicy
from kubedistill.api.status import DistillationJobStatus, Phase
from kubedistill.operator import render
from kubedistill.operator.observed import ChildRef, Observed, PodPhase, PodView, parse_time, rfc3339

ROLLOUT_DRAIN_SECONDS = 300.0
"""The shortest drain deadline: see rollout_drain_seconds."""


def rollout_drain_seconds(spec: DistillationJobSpec) -> float:
    """How long a rollout pod beyond spec.rollout.replicas is kept while the trainer may still hold
    it: a server leaves the weight-sync group at a sync, so deleting it during one would hold that
    sync up until its timeout."""
    return max(ROLLOUT_DRAIN_SECONDS, float(spec.weight_sync.timeout_seconds))


@dataclass(frozen=True)
class Event:
    type: str
    """Normal or Warning."""
    reason: str
    message: str


def base_url(url: str) -> str:
    return url.strip().rstrip("/")


def is_surplus(spec: DistillationJobSpec, q: PodView) -> bool:
    """A rollout pod beyond spec.rollout.replicas (left by a scale-down): drained, then deleted,
    never recreated."""
    return q.role is Role.rollout and q.replica >= spec.rollout.replicas


# --- deadline ---------------------------------------------------------------------------------


def deadline_left(spec: DistillationJobSpec, start_time: str | None, now: datetime) -> float | None:
    """Seconds until activeDeadlineSeconds runs out (<= 0: it has); None when none applies yet."""
    started = parse_time(start_time)
    if spec.active_deadline_seconds is None or started is None:
        return None
    return (started + timedelta(seconds=spec.active_deadline_seconds) - now).total_seconds()


# --- success ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gang:
    """The pods of one reconcile pass, sorted by their place in the trainer gang."""

    attempt: int
    live: list[PodView]
    """Every pod not being deleted."""
    members: list[PodView]
    """Live pods of the roles that restart with the gang (render.in_gang)."""
    current: list[PodView]
    """Members of this attempt."""
    stale: list[PodView]
    """Members to delete: of an earlier attempt, or every member once the gang restarts."""

    def restarted(self, attempt: int) -> Gang:
        return Gang(attempt, self.live, self.members, self.current, list(self.members))


def gang_of(spec: DistillationJobSpec, observed: Observed, attempt: int) -> Gang:
    live = [q for q in observed.pods.values() if not q.deleting]
    members = [q for q in live if q.role is not None and render.in_gang(spec, q.role)]
    current = [q for q in members if q.attempt == attempt]
    stale = [q for q in members if q.attempt != attempt]
    return Gang(attempt, live, members, current, stale)


def succeeded_rank0(gang: Gang) -> PodView | None:
    """Trainer pod 0 of this attempt, once it has exited 0: the job is done."""
    rank0 = next((q for q in gang.current if q.replica == 0), None)
    return rank0 if rank0 is not None and rank0.phase is PodPhase.succeeded else None


# --- gang -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GangCheck:
    failed: list[PodView]
    """Trainer pods of this attempt that failed, by rank."""
    lost: list[str]
    """Trainer pods of a started gang that vanished."""
    decision: GangDecision | None
    """What the failures mean for the gang (kubedistill.api.failures); None when there are none."""


def check_gang(
    job: str, spec: DistillationJobSpec, observed: Observed, gang: Gang, status: DistillationJobStatus
) -> GangCheck:
    failed = sorted(
        (q for q in gang.current if q.role is Role.trainer and q.phase is PodPhase.failed), key=lambda q: q.replica
    )
    lost = lost_trainers(job, spec, observed, status.phase)
    # The job's own failure (non-zero exit, OOM, a pod deleted by hand) counts against
    # backoffLimit; the cluster taking a pod away (preemption, eviction, drain) does not.
    causes = [GangFailure("trainer pod", q.name, _failed_why(q), q.disruption) for q in failed]
    causes += [GangFailure("trainer pod", n, "is gone", _disruption_of(n, observed, gang.attempt)) for n in lost]
    decision = decide_gang_failure(
        causes,
        restarts=status.restarts,
        disruptions=status.disruptions,
        backoff_limit=spec.backoff_limit,
        last_checkpoint=status.last_checkpoint,
        resumes=spec.checkpoint.resume is ResumePolicy.auto,
    )
    return GangCheck(failed, lost, decision)


def lost_trainers(job: str, spec: DistillationJobSpec, observed: Observed, phase: Phase) -> list[str]:
    """Trainer pods of a started gang that vanished (deleted, evicted, node lost).

    Once the job is Initializing or Running every rank has joined the gang, so losing one stops
    the others, as a failed pod does. Before that a missing pod is one not created yet."""
    if phase not in (Phase.initializing, Phase.running):
        return []
    out = []
    for slot in render.slots(spec):
        if slot.role is Role.trainer:
            name = slot.pod_name(job)
            pod = observed.pods.get(name)
            if pod is None or pod.deleting:
                out.append(name)
    return out


def _failed_why(q: PodView) -> str:
    return "failed" + (f" ({q.reason})" if q.reason else "")


def _disruption_of(name: str, observed: Observed, attempt: int) -> str:
    """Why the cluster took a vanished trainer pod of this attempt away, if it did."""
    pod = observed.pods.get(name)
    if pod is not None and pod.disruption:
        return pod.disruption
    seen = observed.disrupted.get(name)
    return seen.disruption if seen is not None and seen.attempt == attempt else ""


# --- replacement ------------------------------------------------------------------------------


def replacements(
    spec: DistillationJobSpec, live: list[PodView], deleting: Collection[ChildRef]
) -> list[tuple[ChildRef, Event]]:
    """Failed rollout, teacher and environment pods, deleted alone (creates makes them again, unless
    surplus)."""
    out: list[tuple[ChildRef, Event]] = []
    for q in live:
        ref = ChildRef("Pod", q.name)
        if q.role is Role.trainer or q.phase is not PodPhase.failed or ref in deleting:
            continue
        why = f" ({q.reason})" if q.reason else ""
        if is_surplus(spec, q):
            msg = (
                f"rollout pod {q.name} failed{why} while draining; deleted, not replaced "
                f"(spec.rollout.replicas is {spec.rollout.replicas})"
            )
            out.append((ref, Event("Normal", "RolloutScaled", msg)))
        else:
            out.append((ref, Event("Warning", "ServerReplaced", f"{q.group} pod {q.name} failed{why}; replacing it")))
    return out


# --- drain ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drain:
    delete: list[ChildRef]
    events: list[Event]
    start_time: str | None
    """status.rolloutDrainStartTime after this pass: None once nothing is left to drain."""
    wake_after: float | None
    """Seconds until the drain deadline, while a surplus pod waits for it."""


def drain(
    job: str,
    namespace: str,
    spec: DistillationJobSpec,
    gang: Gang,
    held: tuple[str, ...] | None,
    start_time: str | None,
    deleting: Collection[ChildRef],
    now: datetime,
) -> Drain:
    """Delete each rollout pod beyond spec.rollout.replicas once the trainer no longer holds it:
    its URL is missing from `held` (the rolloutServers trainer pod 0 of this attempt reports, None
    when it does not say), or that trainer is not running, or the drain deadline has passed. Until
    then it stays, and counts in no role's status (role_counts)."""
    surplus = sorted(
        (q for q in gang.live if is_surplus(spec, q) and ChildRef("Pod", q.name) not in deleting),
        key=lambda q: q.replica,
    )
    if not surplus:
        return Drain([], [], None, None)
    started = parse_time(start_time)
    if started is None:
        started, start_time = now, rfc3339(now)
    deadline = rollout_drain_seconds(spec)
    left = (started + timedelta(seconds=deadline) - now).total_seconds()
    trainer = next(
        (q for q in gang.live if q.role is Role.trainer and q.replica == 0 and q.attempt == gang.attempt), None
    )
    running = trainer is not None and trainer.phase is PodPhase.running
    delete: list[ChildRef] = []
    events: list[Event] = []
    waiting = False
    for q in surplus:
        url = base_url(render.server_url(job, namespace, render.PodSlot(Role.rollout, q.replica)))
        if not running:
            why = "the trainer is not running"
        elif held is not None and url not in held:
            why = "the trainer has drained it"
        elif left <= 0:
            why = f"the drain deadline ({deadline:.0f} s) passed before the trainer let go of it"
        else:
            waiting = True
            continue
        delete.append(ChildRef("Pod", q.name))
        msg = f"deleted rollout pod {q.name} (beyond spec.rollout.replicas {spec.rollout.replicas}): {why}"
        events.append(Event("Normal", "RolloutScaled", msg))
    return Drain(delete, events, start_time, left if waiting else None)


# --- creates ----------------------------------------------------------------------------------


def gang_gone(spec: DistillationJobSpec, observed: Observed, gang: Gang) -> bool:
    """No pod of an earlier (or restarting) gang is left: a new gang starts only then."""
    return not gang.stale and not any(
        q.role is not None and render.in_gang(spec, q.role) and q.deleting for q in observed.pods.values()
    )


def creates(
    job: str, namespace: str, spec: DistillationJobSpec, observed: Observed, attempt: int, gone: bool
) -> list[dict[str, Any]]:
    """The missing pods; gang pods only once the old gang is `gone`, and every pod only once its
    PodGroup exists (Volcano and coscheduling place a pod by its group)."""
    if not pod_group_ready(job, spec, observed):
        return []
    return [
        render.render_pod(job, namespace, spec, slot, attempt=attempt)
        for slot in render.slots(spec)
        if slot.pod_name(job) not in observed.pods and (gone or not render.in_gang(spec, slot.role))
    ]


def pod_group_ready(job: str, spec: DistillationJobSpec, observed: Observed) -> bool:
    if spec.scheduling.gang_scheduler not in render.POD_GROUP_API:
        return True
    return ChildRef("PodGroup", render.pod_group_name(job)) in observed.others


# --- phase ------------------------------------------------------------------------------------


def next_phase(
    job: str, spec: DistillationJobSpec, observed: Observed, attempt: int, previous: Phase, restarting: bool
) -> Phase:
    """The phase of a job that neither finished nor is suspended. `restarting`: this pass found a
    failed, lost or stale gang member, or the old gang is not gone yet."""
    desired = render.slots(spec)
    pods = [observed.pods.get(s.pod_name(job)) for s in desired]
    present = [q for q in pods if q is not None and not q.deleting]
    trainers = [q for s, q in zip(desired, pods) if s.role is Role.trainer]
    if restarting or (previous is Phase.restarting and not _trainers_in(trainers, attempt, (PodPhase.running,))):
        return Phase.restarting
    # A running job stays Running while a server is added or replaced, as long as every role keeps
    # a ready pod; so it does while its ranks exit (a rank > 0 may show Succeeded before rank 0).
    trainers_on = _trainers_in(trainers, attempt, (PodPhase.running, PodPhase.succeeded))
    serving = previous is Phase.running and trainers_on and _every_group_ready(desired, pods)
    if serving or (len(present) == len(desired) and all(q.ready for q in present)):
        return Phase.running
    if len(present) == len(desired) and all(q.phase is PodPhase.running for q in present):
        return Phase.initializing
    return Phase.pending


def _trainers_in(trainers: list[PodView | None], attempt: int, phases: tuple[PodPhase, ...]) -> bool:
    return all(q is not None and not q.deleting and q.attempt == attempt and q.phase in phases for q in trainers)


def _every_group_ready(desired: list[render.PodSlot], pods: list[PodView | None]) -> bool:
    """Every role group (trainer, rollout, each teacher and environment) has at least one ready pod."""
    ready: dict[str, bool] = {}
    for s, q in zip(desired, pods):
        ready[s.group] = ready.get(s.group, False) or (q is not None and not q.deleting and q.ready)
    return all(ready.values())
