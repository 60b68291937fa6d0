"""One reconcile decision: (job, its children as observed, the time) -> what to do.

Pure and level-triggered: the same inputs give the same plan, whatever happened before, so the
operator can run it after every watch event, on a timer, and after a restart.

Failure policy (docs/operator.md; the trainer gang's decision is kubedistill.api.failures, which
`kubedistill run` shares):
  * a failed trainer pod restarts the whole gang (every trainer pod deleted, then recreated with
    the next attempt label) while status.restarts < spec.backoffLimit; then the job is Failed;
    so does a trainer pod that vanished (deleted by hand) once the gang had started;
  * a trainer pod the cluster took away (preempted, evicted, drained: a DisruptionTarget
    condition or reason Preempted/Evicted) restarts the gang too, counted in status.disruptions,
    not against backoffLimit, with the Disrupted condition saying why;
  * with gangScheduler kueue the gang is the whole job (one Kueue pod group per attempt);
  * a gang scheduler whose API the cluster does not serve holds the pods back: Blocked;
  * a failed rollout or teacher pod is deleted and recreated alone;
  * spec.rollout.replicas may change while the job runs (kubectl scale, an HPA): the ConfigMap is
    updated first (the trainer reads its endpoints as the rollout servers it should have), new
    rollout pods are created, and a rollout pod beyond the new count is deleted once the trainer
    no longer holds it (its /status rolloutServers), the trainer is not running, or the drain
    deadline (rollout_drain_seconds) has passed; never a gang restart, never counted as a failure;
  * activeDeadlineSeconds after startTime the job is Failed;
  * trainer pod 0 Succeeded -> the job is Succeeded and the pods still running are deleted;
  * spec.suspend deletes the pods (phase Suspended) and clearing it recreates them;
  * ttlSecondsAfterFinished after completionTime the job itself is deleted;
  * a child the API server refuses to create (PodSecurity, quota, an admission webhook) makes
    the job Blocked, with the server's reason and message in the Created condition and
    status.message; it is retried with exponential backoff, and the job goes on once it is made.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from kubedistill.api.failures import GangFailure, GangOutcome, decide_gang_failure
from kubedistill.api.job import API_VERSION, KIND, DistillationJob
from kubedistill.api.progress import TrainerProgress
from kubedistill.api.roleconfig import Role
from kubedistill.api.spec import DistillationJobSpec, GangScheduler
from kubedistill.api.status import (
    ConditionStatus,
    ConditionType,
    DistillationJobStatus,
    Phase,
    ReadySummary,
    RoleStatus,
)
from kubedistill.api.validate import problems_of
from kubedistill.operator import render
from kubedistill.operator.observed import (
    ChildRef,
    Observed,
    PodPhase,
    PodView,
    condition,
    parse_time,
    ready_summary,
    rfc3339,
    role_counts,
    set_condition,
)

TERMINAL = (Phase.succeeded, Phase.failed)


@dataclass(frozen=True)
class GangApi:
    """The API a gang scheduler's objects live in, as discovery shows it."""

    group_version: str
    """e.g. scheduling.volcano.sh/v1beta1; a bare group (kueue.x-k8s.io) checks the group."""
    plural: str | None
    """The resource the operator creates there, or None when it creates none (Kueue)."""
    project: str


GANG_APIS: dict[GangScheduler, GangApi] = {
    GangScheduler.kueue: GangApi("kueue.x-k8s.io", None, "Kueue"),
    GangScheduler.volcano: GangApi(render.POD_GROUP_API[GangScheduler.volcano], "podgroups", "Volcano"),
    GangScheduler.coscheduling: GangApi(
        render.POD_GROUP_API[GangScheduler.coscheduling], "podgroups", "scheduler-plugins (coscheduling)"
    ),
}


ROLLOUT_DRAIN_SECONDS = 300.0
"""The shortest drain deadline: see rollout_drain_seconds."""


def rollout_drain_seconds(spec: DistillationJobSpec) -> float:
    """How long after a scale-down a rollout pod beyond spec.rollout.replicas is kept while the
    trainer still holds it (or does not say whether it does): ROLLOUT_DRAIN_SECONDS, or one weight
    sync's timeout if longer. A server leaves the trainer's weight-sync group at a sync, and a
    server deleted during one would hold that sync up until its timeout."""
    return max(ROLLOUT_DRAIN_SECONDS, float(spec.weight_sync.timeout_seconds))


def gang_attempt(status: DistillationJobStatus) -> int:
    """The current gang attempt: every restart, counted (restarts) or not (disruptions)."""
    return status.restarts + status.disruptions


@dataclass(frozen=True)
class Event:
    type: str
    """Normal or Warning."""
    reason: str
    message: str


@dataclass(frozen=True)
class TrainerReport:
    """The part of trainer pod 0's GET /status (TrainerProgress) that goes into the job's status:
    a change of it is worth a reconcile, a new samples/s figure is not."""

    step: int
    weight_version: int
    last_checkpoint: str | None
    rollout_servers: tuple[str, ...] | None = None
    """Base URLs of the rollout servers the trainer's driver still holds (in rotation, joining or
    draining); None when it does not say (an older trainer)."""
    attempt: int | None = None
    """The gang attempt of the trainer pod that reported it: a report of an earlier attempt says
    nothing about the servers the current trainer holds."""

    @classmethod
    def of(cls, doc: Mapping[str, Any], attempt: int | None = None) -> TrainerReport:
        """Raises ValueError (pydantic's ValidationError) on a malformed document."""
        reported = TrainerProgress.from_json(doc)
        servers = reported.rollout_servers
        held = None if servers is None else tuple(sorted({_base_url(u) for u in servers}))
        return cls(reported.step, reported.weight_version, reported.last_checkpoint or None, held, attempt)


def _base_url(url: str) -> str:
    return url.strip().rstrip("/")


@dataclass(frozen=True)
class Refusal:
    """The API server refused to create a child: why, how often in a row, when to try again."""

    reason: str
    """CamelCase cause (refusal_reason)."""
    message: str
    """The API server's message."""
    attempts: int
    retry_at: datetime


RefusalKey = tuple[str, str]
"""(kind, name) of a refused child."""


def is_refusal(http_status: int) -> bool:
    """A create the API server answered with a decision about this object (PodSecurity, quota,
    webhook, validation): retried with backoff. Conflicts mean it exists; 429, 5xx and network
    errors are the server's own trouble and are retried at the next pass."""
    return 400 <= http_status < 500 and http_status not in (409, 429)


def refusal_reason(http_status: int, message: str) -> str:
    """The condition reason for a refused create, from the server's status and message."""
    text = message.lower()
    if "podsecurity" in text:
        return "PodSecurity"
    if "exceeded quota" in text:
        return "QuotaExceeded"
    if "failed quota" in text:
        # A quota on requests.cpu (memory, ...) refuses a pod that does not state that request:
        # the server answers 403 "failed quota: NAME: must specify requests.cpu for: CONTAINER",
        # which read as plain Forbidden points at the operator's RBAC instead of the quota.
        return "QuotaRequiresResources"
    if "admission webhook" in text and "denied" in text:
        return "AdmissionWebhookDenied"
    if "no priorityclass with name" in text:
        # The Priority admission plugin's 403 for scheduling.priorityClassName naming no class:
        # a plain Forbidden would point at the operator's RBAC.
        return "PriorityClassNotFound"
    return {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 422: "Invalid"}.get(http_status, "Refused")


def create_backoff(attempts: int, base_seconds: float, max_seconds: float) -> float:
    """Seconds before creating a refused child again: base, 2 x base, 4 x base ... up to max."""
    # The exponent stops growing once the cap is reached: 2.0 ** 1024 would overflow.
    return min(max_seconds, base_seconds * 2.0 ** min(max(attempts - 1, 0), 60))


@dataclass
class Plan:
    status: DistillationJobStatus
    update: list[dict[str, Any]] = field(default_factory=list)
    """Children whose content the operator keeps current (render.KEPT_CURRENT) that differ from
    the spec: their owned field is patched, before `create` is carried out (a new rollout pod reads
    the updated config when it starts)."""
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[ChildRef] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False
    wake_after: float | None = None
    """Seconds until a time-based decision is due (TTL, deadline), if any."""


@dataclass(frozen=True)
class JobView:
    name: str
    namespace: str
    generation: int
    spec: Mapping[str, Any]
    """The raw spec as stored (it may predate the installed CRD's rules)."""
    status: Mapping[str, Any]


def parse_spec(job: JobView) -> tuple[DistillationJobSpec | None, str]:
    """The validated spec, or None and a one-line summary naming the bad fields.

    Cached by content: a job's loop plans after every watch event about it or its children while
    the spec rarely changes, and validating it (problems_of, then the model) each time is wasted.
    The result is shared: never mutate it."""
    return _parse_spec(job.name, _spec_json(job))


def _spec_json(job: JobView) -> str:
    return json.dumps(job.spec, sort_keys=True)


@functools.lru_cache(maxsize=1024)
def _parse_spec(name: str, spec_json: str) -> tuple[DistillationJobSpec | None, str]:
    doc = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": json.loads(spec_json)}
    problems = problems_of(doc, name)
    if problems:
        return None, "; ".join(f"{p.field}: {p.message}" if p.field else p.message for p in problems)
    return DistillationJob.model_validate(doc).spec, ""


def current_status(raw: Mapping[str, Any]) -> DistillationJobStatus:
    """The stored status; a status this version cannot read starts over rather than crash."""
    known = {k: v for k, v in raw.items() if k in _STATUS_KEYS}
    try:
        return DistillationJobStatus.model_validate(known)
    except Exception:
        return DistillationJobStatus()


_STATUS_KEYS = {f.alias or n for n, f in DistillationJobStatus.model_fields.items()}


def plan(
    job: JobView,
    observed: Observed,
    now: datetime,
    report: TrainerReport | None = None,
    refusals: Mapping[RefusalKey, Refusal] | None = None,
    missing_apis: Collection[GangScheduler] = (),
) -> Plan:
    """`missing_apis`: gang schedulers whose API the cluster does not serve (discovery)."""
    status = current_status(job.status)
    previous = status.phase
    rollout_before = status.roles.get(Role.rollout.value)
    status.observed_generation = job.generation
    status.rollout_selector = render.rollout_selector(job.name)
    status.rollout_replicas = sum(
        1 for q in observed.pods.values() if q.role is Role.rollout and not q.deleting and not q.finished
    )
    p = Plan(status=status)
    spec, problem = parse_spec(job)
    if spec is None:
        _finish(p, observed, Phase.failed, "InvalidSpec", f"the spec is invalid: {problem}", now)
        _conditions(p, None, observed, now)
        _phase_event(p, previous)
        return p
    if report is not None:
        status.step = report.step
        status.weight_version = report.weight_version
        status.last_checkpoint = report.last_checkpoint or status.last_checkpoint

    if previous not in TERMINAL:
        _sync_static(p, job, spec, observed)
        _rollout_scaled(p, job, spec, observed, rollout_before)
    if previous in TERMINAL:
        _cleanup_finished(p, observed, status.phase)
        _ttl(p, spec, now)
        status.rollout_drain_start_time = None
    elif spec.suspend:
        _delete_pods(p, observed.pods.values())
        status.phase = Phase.suspended
        status.start_time = None  # the deadline counts from the next resume, as for a batch Job
        status.rollout_drain_start_time = None
    else:
        _run(p, job, spec, observed, now, report)
        if status.phase in TERMINAL:
            p.wake_after = None
            status.rollout_drain_start_time = None
            _ttl(p, spec, now)
    if status.phase not in TERMINAL:
        status.message = ""
        _hold_unscheduled(p, spec, missing_apis, now)
        _hold_refused(p, refusals or {}, now)
        _blocked_by_volumes(p, observed, now)
    _conditions(p, spec, observed, now)
    _phase_event(p, previous)
    return p


def _hold_unscheduled(p: Plan, spec: DistillationJobSpec, missing: Collection[GangScheduler], now: datetime) -> None:
    """Pods of a job whose gang scheduler is not installed would run unqueued and ungrouped, which
    is what the user asked to avoid: hold them (and the PodGroup) until its API appears."""
    gang = spec.scheduling.gang_scheduler
    if gang not in missing:
        return
    held = [o for o in p.create if o["kind"] in ("Pod", "PodGroup")]
    if not held:
        return
    p.create = [o for o in p.create if o["kind"] not in ("Pod", "PodGroup")]
    api = GANG_APIS[gang]
    what = f"{api.group_version} {api.plural}" if api.plural else f"the {api.group_version} API"
    message = (
        f"spec.scheduling.gangScheduler is {gang.value}, but this cluster does not serve {what}: install "
        f"{api.project} or set gangScheduler none; the pods are created once it is there"
    )
    p.status.phase = Phase.blocked
    p.status.message = message
    set_condition(p.status, ConditionType.created, False, "GangSchedulerMissing", message, now)


def _hold_refused(p: Plan, refusals: Mapping[RefusalKey, Refusal], now: datetime) -> None:
    """Children the API server refused are not created again before their backoff ends; while
    any is still missing, the job is Blocked and says why."""
    blocking: list[tuple[dict[str, Any], Refusal]] = []
    due: list[dict[str, Any]] = []
    for obj in p.create:
        refusal = refusals.get((obj["kind"], obj["metadata"]["name"]))
        if refusal is None:
            due.append(obj)
            continue
        blocking.append((obj, refusal))
        wait = (refusal.retry_at - now).total_seconds()
        if wait > 0:
            p.wake_after = wait if p.wake_after is None else min(p.wake_after, wait)
        else:
            due.append(obj)
    p.create = due
    if not blocking:
        return
    obj, first = blocking[0]
    more = f" (and {len(blocking) - 1} more refused)" if len(blocking) > 1 else ""
    message = f"creating {obj['kind']} {obj['metadata']['name']} was refused: {first.message}{more}"
    p.status.phase = Phase.blocked
    p.status.message = message[:4096]
    set_condition(p.status, ConditionType.created, False, first.reason, message, now)


def _blocked_by_volumes(p: Plan, observed: Observed, now: datetime) -> None:
    """A pod the scheduler cannot place for want of a volume (a claim missing or unbound) waits
    for the user, not for time: the job is Blocked and says which pod and claim."""
    if p.status.phase is Phase.blocked:
        return  # a refused creation already says why
    stuck = sorted((q.name, q.volume_problem) for q in observed.pods.values() if q.volume_problem and not q.deleting)
    if not stuck:
        return
    name, why = stuck[0]
    more = f" (and {len(stuck) - 1} more pods)" if len(stuck) > 1 else ""
    message = f"pod {name} cannot be scheduled: {why}{more}"
    p.status.phase = Phase.blocked
    p.status.message = message[:4096]
    set_condition(p.status, ConditionType.created, False, "VolumeUnavailable", message, now)


def _run(
    p: Plan, job: JobView, spec: DistillationJobSpec, observed: Observed, now: datetime, report: TrainerReport | None
) -> None:
    st = p.status
    started = parse_time(st.start_time)
    if spec.active_deadline_seconds is not None and started is not None:
        left = (started + timedelta(seconds=spec.active_deadline_seconds) - now).total_seconds()
        if left <= 0:
            msg = f"the job ran longer than activeDeadlineSeconds ({spec.active_deadline_seconds} s)"
            _finish(p, observed, Phase.failed, "DeadlineExceeded", msg, now)
            return
        p.wake_after = left

    attempt = gang_attempt(st)
    live = [q for q in observed.pods.values() if not q.deleting]
    gang = [q for q in live if q.role is not None and render.in_gang(spec, q.role)]
    current = [q for q in gang if q.attempt == attempt]
    stale = [q for q in gang if q.attempt != attempt]

    rank0 = next((q for q in current if q.replica == 0), None)
    if rank0 is not None and rank0.phase is PodPhase.succeeded:
        # The trainer exits 0 only after its last step, usually between two /status polls: the
        # last steps it reported may lag (36 of 40 was seen).
        st.step = max(st.step or 0, spec.trainer.total_steps)
        _finish(p, observed, Phase.succeeded, "TrainerSucceeded", f"trainer pod {rank0.name} completed", now)
        return

    failed = sorted(
        (q for q in current if q.role is Role.trainer and q.phase is PodPhase.failed), key=lambda q: q.replica
    )
    lost = _lost_trainers(job, spec, observed, st.phase)
    # The job's own failure (non-zero exit, OOM, a pod deleted by hand) counts against
    # backoffLimit; the cluster taking a pod away (preemption, eviction, drain) does not.
    causes = [GangFailure("trainer pod", q.name, _failed_why(q), q.disruption) for q in failed]
    causes += [GangFailure("trainer pod", n, "is gone", _disruption_of(n, observed, attempt)) for n in lost]
    decision = decide_gang_failure(
        causes,
        restarts=st.restarts,
        disruptions=st.disruptions,
        backoff_limit=spec.backoff_limit,
        last_checkpoint=st.last_checkpoint,
    )
    if decision is not None:
        if decision.outcome is GangOutcome.failed:
            _finish(p, observed, Phase.failed, decision.reason, decision.message, now)
            return
        st.restarts, st.disruptions = decision.restarts, decision.disruptions
        if decision.outcome is GangOutcome.disrupted:
            set_condition(st, ConditionType.disrupted, True, decision.cause.disruption, decision.message, now)
        p.events.append(Event("Warning", decision.reason, decision.message))
        attempt = gang_attempt(st)
        stale = gang
    _delete_pods(p, stale)

    for q in live:
        if q.role is not Role.trainer and q.phase is PodPhase.failed and ChildRef("Pod", q.name) not in p.delete:
            p.delete.append(ChildRef("Pod", q.name))
            why = f" ({q.reason})" if q.reason else ""
            if is_surplus(spec, q):
                msg = (
                    f"rollout pod {q.name} failed{why} while draining; deleted, not replaced "
                    f"(spec.rollout.replicas is {spec.rollout.replicas})"
                )
                p.events.append(Event("Normal", "RolloutScaled", msg))
            else:
                p.events.append(Event("Warning", "ServerReplaced", f"{q.group} pod {q.name} failed{why}; replacing it"))
    _drain_surplus(p, job, spec, live, attempt, report, now)

    # Pods to (re)create: missing ones; a restarted gang starts only once the old one is gone.
    gang_gone = not stale and not any(
        q.role is not None and render.in_gang(spec, q.role) and q.deleting for q in observed.pods.values()
    )
    pod_group_ready = _pod_group_ready(job, spec, observed)
    for slot in render.slots(spec):
        name = slot.pod_name(job.name)
        if name in observed.pods:
            continue
        if render.in_gang(spec, slot.role) and not gang_gone:
            continue
        if not pod_group_ready:
            continue
        p.create.append(render.render_pod(job.name, job.namespace, spec, slot, attempt=attempt))
    if p.create and st.start_time is None:
        st.start_time = rfc3339(now)

    desired = render.slots(spec)
    pods = [observed.pods.get(s.pod_name(job.name)) for s in desired]
    present = [q for q in pods if q is not None and not q.deleting]
    current_trainers_running = all(
        q is not None and not q.deleting and q.attempt == attempt and q.phase is PodPhase.running
        for s, q in zip(desired, pods)
        if s.role is Role.trainer
    )
    restarting = (
        bool(stale)
        or not gang_gone
        or (st.phase in (Phase.restarting,) and not current_trainers_running)
        or bool(failed)
        or bool(lost)
    )
    # A running job stays Running while a server is added (a scale-up) or replaced, as long as
    # every role still has a ready pod: the trainer goes on with the others meanwhile. So it does
    # while its trainer ranks exit: each pod's kubelet reports on its own, a rank > 0 may show
    # Succeeded before rank 0 does, and that is the job finishing, not a job back to Pending.
    trainers_on = all(
        q is not None and not q.deleting and q.attempt == attempt and q.phase in (PodPhase.running, PodPhase.succeeded)
        for s, q in zip(desired, pods)
        if s.role is Role.trainer
    )
    serving = st.phase is Phase.running and trainers_on and _every_group_ready(desired, pods)
    if restarting:
        st.phase = Phase.restarting
    elif serving or (len(present) == len(desired) and all(q.ready for q in present)):
        st.phase = Phase.running
    elif len(present) == len(desired) and all(q.phase is PodPhase.running for q in present):
        st.phase = Phase.initializing
    else:
        st.phase = Phase.pending


def _every_group_ready(desired: list[render.PodSlot], pods: list[PodView | None]) -> bool:
    """Every role group (trainer, rollout, each teacher) has at least one ready pod."""
    ready: dict[str, bool] = {}
    for s, q in zip(desired, pods):
        ready[s.group] = ready.get(s.group, False) or (q is not None and not q.deleting and q.ready)
    return all(ready.values())


def is_surplus(spec: DistillationJobSpec, q: PodView) -> bool:
    """A rollout pod beyond spec.rollout.replicas (left by a scale-down): drained, then deleted,
    never recreated."""
    return q.role is Role.rollout and q.replica >= spec.rollout.replicas


def _rollout_scaled(
    p: Plan, job: JobView, spec: DistillationJobSpec, observed: Observed, before: RoleStatus | None
) -> None:
    """One RolloutScaled event when spec.rollout.replicas differs from the count the status last
    showed; a scale-down restarts the drain deadline (every surplus pod gets a whole one)."""
    if before is None or before.desired == spec.rollout.replicas:
        return
    old, new = before.desired, spec.rollout.replicas
    msg = f"spec.rollout.replicas {old} -> {new}"
    if spec.suspend:
        msg += " (the job is suspended: its pods follow when it resumes)"
    elif new > old:
        names = ", ".join(render.PodSlot(Role.rollout, i).pod_name(job.name) for i in range(old, new))
        msg += f": creating rollout pod(s) {names}; the trainer adds them at a weight sync"
    else:
        names = (
            ", ".join(sorted(q.name for q in observed.pods.values() if is_surplus(spec, q) and not q.deleting))
            or "none left"
        )
        drain = rollout_drain_seconds(spec)
        msg += f": draining rollout pod(s) {names}, deleted once the trainer lets go of them (at most {drain:.0f} s)"
        p.status.rollout_drain_start_time = None  # the deadline counts from this scale-down
    p.events.append(Event("Normal", "RolloutScaled", msg))


def _drain_surplus(
    p: Plan,
    job: JobView,
    spec: DistillationJobSpec,
    live: list[PodView],
    attempt: int,
    report: TrainerReport | None,
    now: datetime,
) -> None:
    """Delete each rollout pod beyond spec.rollout.replicas once the trainer no longer holds it:
    its URL is missing from the rolloutServers that trainer pod 0 of this gang attempt reports,
    or that trainer is not running, or the drain deadline has passed. Until then it stays, and
    counts in no role's status (role_counts)."""
    st = p.status
    surplus = sorted(
        (q for q in live if is_surplus(spec, q) and ChildRef("Pod", q.name) not in p.delete), key=lambda q: q.replica
    )
    if not surplus:
        st.rollout_drain_start_time = None
        return
    started = parse_time(st.rollout_drain_start_time)
    if started is None:
        started = now
        st.rollout_drain_start_time = rfc3339(now)
    deadline = rollout_drain_seconds(spec)
    left = (started + timedelta(seconds=deadline) - now).total_seconds()
    trainer = next(
        (q for q in live if q.role is Role.trainer and q.replica == 0 and q.attempt == attempt),
        None,
    )
    running = trainer is not None and trainer.phase is PodPhase.running
    held = report.rollout_servers if report is not None and report.attempt == attempt else None
    waiting = False
    for q in surplus:
        url = _base_url(render.server_url(job.name, job.namespace, render.PodSlot(Role.rollout, q.replica)))
        if not running:
            why = "the trainer is not running"
        elif held is not None and url not in held:
            why = "the trainer has drained it"
        elif left <= 0:
            why = f"the drain deadline ({deadline:.0f} s) passed before the trainer let go of it"
        else:
            waiting = True
            continue
        p.delete.append(ChildRef("Pod", q.name))
        msg = f"deleted rollout pod {q.name} (beyond spec.rollout.replicas {spec.rollout.replicas}): {why}"
        p.events.append(Event("Normal", "RolloutScaled", msg))
    if waiting:
        p.wake_after = left if p.wake_after is None else min(p.wake_after, left)


def _failed_why(q: PodView) -> str:
    return "failed" + (f" ({q.reason})" if q.reason else "")


def _disruption_of(name: str, observed: Observed, attempt: int) -> str:
    """Why the cluster took a vanished trainer pod of this attempt away, if it did."""
    pod = observed.pods.get(name)
    if pod is not None and pod.disruption:
        return pod.disruption
    seen = observed.disrupted.get(name)
    return seen.disruption if seen is not None and seen.attempt == attempt else ""


def _pod_group_ready(job: JobView, spec: DistillationJobSpec, observed: Observed) -> bool:
    """Pods wait for their PodGroup: Volcano and coscheduling place a pod by its group."""
    if spec.scheduling.gang_scheduler not in render.POD_GROUP_API:
        return True
    return ChildRef("PodGroup", render.pod_group_name(job.name)) in observed.others


def _lost_trainers(job: JobView, spec: DistillationJobSpec, observed: Observed, phase: Phase) -> list[str]:
    """Trainer pods of a started gang that vanished (deleted, evicted, node lost).

    Once the job is Initializing or Running every trainer process has started and joined the
    gang: losing one loses that rank, so the others cannot go on and the gang restarts, as for a
    failed pod. Before that (Pending, Restarting) a missing pod is one not created yet."""
    if phase not in (Phase.initializing, Phase.running):
        return []
    out = []
    for slot in render.slots(spec):
        if slot.role is Role.trainer:
            name = slot.pod_name(job.name)
            pod = observed.pods.get(name)
            if pod is None or pod.deleting:
                out.append(name)
    return out


def _sync_static(p: Plan, job: JobView, spec: DistillationJobSpec, observed: Observed) -> None:
    """Create the static children that are missing; update those whose content follows the spec
    (render.KEPT_CURRENT) where it differs, e.g. the ConfigMap after spec.rollout.replicas changed."""
    if not all(ChildRef(kind, name) in observed.others for kind, name in render.static_refs(job.name, spec)):
        for obj in render.render_static(job.name, job.namespace, spec):
            if ChildRef(obj["kind"], obj["metadata"]["name"]) not in observed.others:
                p.create.append(obj)
    # The usual pass compares cached digests: rendering the runtime config each time is wasted.
    stale = {
        ChildRef(kind, name)
        for kind, name, digest in _kept_digests(job.name, job.namespace, _spec_json(job))
        if ChildRef(kind, name) in observed.others and observed.digests.get(ChildRef(kind, name), digest) != digest
    }
    if stale:
        for obj in render.render_kept_current(job.name, job.namespace, spec):
            if ChildRef(obj["kind"], obj["metadata"]["name"]) in stale:
                p.update.append(obj)


@functools.lru_cache(maxsize=1024)
def _kept_digests(name: str, namespace: str, spec_json: str) -> tuple[tuple[str, str, str], ...]:
    """(kind, name, content digest) of the job's render.KEPT_CURRENT children, by spec content."""
    spec, _ = _parse_spec(name, spec_json)
    if spec is None:
        return ()
    return tuple(
        (o["kind"], o["metadata"]["name"], render.content_digest(o["kind"], o))
        for o in render.render_kept_current(name, namespace, spec)
    )


def _delete_pods(p: Plan, pods: Iterable[PodView]) -> None:
    for q in pods:
        if not q.deleting and ChildRef("Pod", q.name) not in p.delete:
            p.delete.append(ChildRef("Pod", q.name))


def _finish(p: Plan, observed: Observed, phase: Phase, reason: str, message: str, now: datetime) -> None:
    st = p.status
    if st.phase is not phase:  # one event per transition, not one per pass
        p.events.append(Event("Normal" if phase is Phase.succeeded else "Warning", reason, message))
    st.phase = phase
    st.message = "" if phase is Phase.succeeded else message[:4096]
    if st.completion_time is None:
        st.completion_time = rfc3339(now)
    _finish_condition(p, phase, reason, message, now)
    _cleanup_finished(p, observed, phase)


def _finish_condition(p: Plan, phase: Phase, reason: str, message: str, now: datetime) -> None:
    kind = ConditionType.succeeded if phase is Phase.succeeded else ConditionType.failed
    set_condition(p.status, kind, True, reason, message, now)


def _cleanup_finished(p: Plan, observed: Observed, phase: Phase) -> None:
    """A finished job keeps its finished pods (for their logs) and deletes the rest."""
    _delete_pods(p, [q for q in observed.pods.values() if not q.finished])


def _ttl(p: Plan, spec: DistillationJobSpec, now: datetime) -> None:
    done = parse_time(p.status.completion_time)
    if spec.ttl_seconds_after_finished is None or done is None:
        return
    left = (done + timedelta(seconds=spec.ttl_seconds_after_finished) - now).total_seconds()
    if left <= 0:
        p.delete_job = True
        p.events.append(
            Event("Normal", "TTLExpired", f"deleting the job {spec.ttl_seconds_after_finished} s after it finished")
        )
    else:
        p.wake_after = left


def _conditions(p: Plan, spec: DistillationJobSpec | None, observed: Observed, now: datetime) -> None:
    st = p.status
    pods = [q for q in observed.pods.values() if not q.deleting]
    if spec is not None:
        roles = role_counts(render.groups(spec), pods)
        st.roles = roles
        st.ready = ReadySummary(**ready_summary(roles))
    all_ready = bool(st.roles) and all(r.ready == r.desired for r in st.roles.values())
    created = condition(st, ConditionType.created)
    everything = spec is not None and not p.create and all(r.desired <= _present(pods, g) for g, r in st.roles.items())
    if st.phase is Phase.blocked:
        pass  # _hold_refused set it to the refusal
    elif created is None or created.status is not ConditionStatus.true:
        if everything and st.phase not in TERMINAL:
            set_condition(st, ConditionType.created, True, "ChildrenCreated", "every child of the job exists", now)
        else:
            set_condition(st, ConditionType.created, False, "Creating", "creating the job's children", now)
    summary = f"trainer {st.ready.trainer}, rollout {st.ready.rollout}, teachers {st.ready.teachers} ready"
    set_condition(st, ConditionType.ready, all_ready, "AllPodsReady" if all_ready else "PodsNotReady", summary, now)
    set_condition(st, ConditionType.running, st.phase is Phase.running, st.phase.value, f"phase {st.phase.value}", now)
    if st.phase is not Phase.succeeded:
        set_condition(st, ConditionType.succeeded, False, "NotSucceeded", "the trainer has not completed", now)
    if st.phase is not Phase.failed:
        set_condition(st, ConditionType.failed, False, "NotFailed", "no terminal failure", now)
    disrupted = condition(st, ConditionType.disrupted)
    if disrupted is not None and disrupted.status is ConditionStatus.true and st.phase is Phase.running:
        message = f"the gang runs again after: {disrupted.message}"
        set_condition(st, ConditionType.disrupted, False, "Recovered", message[:32768], now)
    suspended = st.phase is Phase.suspended
    set_condition(
        st,
        ConditionType.suspended,
        suspended,
        "Suspended" if suspended else "NotSuspended",
        "spec.suspend is true: the pods are deleted" if suspended else "spec.suspend is false",
        now,
    )


def _present(pods: list[PodView], group: str) -> int:
    return sum(1 for q in pods if q.group == group)


def _phase_event(p: Plan, previous: Phase) -> None:
    now_phase = p.status.phase
    if now_phase is previous:
        return
    if now_phase in TERMINAL:
        return  # _finish already emitted the terminal event with its reason
    kind = "Warning" if now_phase in (Phase.restarting, Phase.blocked) else "Normal"
    detail = f": {p.status.message}" if now_phase is Phase.blocked else ""
    p.events.append(Event(kind, now_phase.value, f"phase {previous.value} -> {now_phase.value}{detail}"))
