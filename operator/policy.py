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
  * a failed rollout, teacher or environment pod is deleted and recreated alone;
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

from kubedistill.api.failures import GangOutcome
from kubedistill.api.job import API_VERSION, KIND, DistillationJob
from kubedistill.api.progress import TrainerProgress
from kubedistill.api.roleconfig import Role
from kubedistill.api.spec import DistillationJobSpec, GangScheduler
from kubedistill.api.status import (
    ConditionStatus,
    ConditionType,
    DistillationJobStatus,
    HeldOutEvaluation,
    Phase,
    ReadySummary,
    RoleStatus,
)
from kubedistill.api.validate import problems_of
from kubedistill.operator import render, running
from kubedistill.operator.observed import (
    ChildRef,
    Observed,
    PodView,
    condition,
    parse_time,
    ready_summary,
    rfc3339,
    role_counts,
    set_condition,
)
from kubedistill.operator.running import (
    Event,
    base_url,
    is_surplus,
    rollout_drain_seconds,
)
from kubedistill.operator.volumes import resume_problem, unwritable_tracker_dir

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


def gang_attempt(status: DistillationJobStatus) -> int:
    """The current gang attempt: every restart, counted (restarts) or not (disruptions)."""
    return status.restarts + status.disruptions


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
    evaluation: HeldOutEvaluation | None = field(default=None, hash=False)
    """The trainer's last held-out evaluation (spec.evaluation); None before its first one."""

    @classmethod
    def of(cls, doc: Mapping[str, Any], attempt: int | None = None) -> TrainerReport:
        """Raises ValueError (pydantic's ValidationError) on a malformed document."""
        reported = TrainerProgress.from_json(doc)
        servers = reported.rollout_servers
        held = None if servers is None else tuple(sorted({base_url(u) for u in servers}))
        return cls(
            reported.step, reported.weight_version, reported.last_checkpoint or None, held, attempt, reported.evaluation
        )


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
    if report is not None and previous not in TERMINAL:
        # A finished job keeps what it finished with: the last poll of its trainer predates the
        # final step and evaluation (from the trainer's termination message, _run).
        status.step = report.step
        status.weight_version = report.weight_version
        status.last_checkpoint = report.last_checkpoint or status.last_checkpoint
        _evaluated(p, report.evaluation)

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
        _hold_unresumable(p, spec, now)
        _hold_unwritable_trackers(p, spec, now)
        _hold_refused(p, refusals or {}, now)
        _blocked_by_volumes(p, observed, now)
        _blocked_by_images(p, observed)
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


def _hold_pods(p: Plan, reason: str, message: str, now: datetime) -> None:
    """Create no pod of a job whose spec cannot work on Kubernetes: it is Blocked, says why in one
    line and in the Created condition, and goes on once the spec changes (the next plan)."""
    p.create = [o for o in p.create if o["kind"] != "Pod"]
    p.status.phase = Phase.blocked
    p.status.message = message[:4096]
    set_condition(p.status, ConditionType.created, False, reason, message, now)


def _hold_unresumable(p: Plan, spec: DistillationJobSpec, now: datetime) -> None:
    """With checkpoint.resume auto, a job whose checkpoints a gang restart would lose (an emptyDir
    or a relative path at checkpoint.path) would promise a resume it cannot do: its pods are held
    until spec.volumes or spec.volumeMounts change, and the job is Blocked and says why."""
    why = resume_problem(spec) if p.status.phase is not Phase.blocked else None
    if why is not None:
        message = f"checkpoint.resume is auto, but a gang restart could not resume: {why}"
        _hold_pods(p, "CheckpointNotResumable", message, now)


def _hold_unwritable_trackers(p: Plan, spec: DistillationJobSpec, now: datetime) -> None:
    """A tracker directory on the pods' read-only root filesystem would fail at the trainer's first
    write, after the job had started: its pods are held until the spec changes, and the job is
    Blocked and says which field and where to put it."""
    why = unwritable_tracker_dir(spec) if p.status.phase is not Phase.blocked else None
    if why is not None:
        _hold_pods(p, "TrackerDirNotWritable", why, now)


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


def final_report(pod: PodView) -> TrainerReport | None:
    """The trainer's final /status from its pod's termination message; None when it left none
    (an older trainer, a message that is not ours)."""
    if not pod.termination_message:
        return None
    try:
        return TrainerReport.of(json.loads(pod.termination_message), pod.attempt)
    except (TypeError, ValueError):
        return None


def image_stuck(observed: Observed) -> tuple[str, str, str] | None:
    """(pod, the kubelet's reason, message) of the first pod whose container cannot get its image."""
    stuck = sorted((q.name, *q.image_problem) for q in observed.pods.values() if q.image_problem and not q.deleting)
    return stuck[0] if stuck else None


def _blocked_by_images(p: Plan, observed: Observed) -> None:
    """A pod whose image cannot be pulled waits for someone to fix the image or the registry, not
    for time: the job is Blocked and says which pod and why (the Ready condition carries the
    kubelet's reason, see _conditions). The kubelet retries the pull by itself; once the container
    starts, the next plan finds nothing stuck and the job goes on."""
    if p.status.phase is Phase.blocked:
        return  # a refused creation or a missing volume already says why
    stuck = image_stuck(observed)
    if stuck is None:
        return
    name, reason, why = stuck
    message = f"pod {name} cannot get its image: {reason}" + (f": {why}" if why else "")
    p.status.phase = Phase.blocked
    p.status.message = message[:4096]


def _run(
    p: Plan, job: JobView, spec: DistillationJobSpec, observed: Observed, now: datetime, report: TrainerReport | None
) -> None:
    """Apply the phases of kubedistill.operator.running, in order, to the plan."""
    st = p.status
    left = running.deadline_left(spec, st.start_time, now)
    if left is not None and left <= 0:
        msg = f"the job ran longer than activeDeadlineSeconds ({spec.active_deadline_seconds} s)"
        _finish(p, observed, Phase.failed, "DeadlineExceeded", msg, now)
        return
    if left is not None:
        p.wake_after = left

    gang = running.gang_of(spec, observed, gang_attempt(st))
    done = running.succeeded_rank0(gang)
    if done is not None:
        # The trainer exits 0 right after its last step, usually before the next /status poll:
        # its termination message holds its final /status (the last step and evaluation).
        final = final_report(done)
        if final is not None:
            st.step, st.weight_version = final.step, final.weight_version
            st.last_checkpoint = final.last_checkpoint or st.last_checkpoint
            _evaluated(p, final.evaluation)
        st.step = max(st.step or 0, spec.trainer.total_steps)
        _finish(p, observed, Phase.succeeded, "TrainerSucceeded", f"trainer pod {done.name} completed", now)
        return

    check = running.check_gang(job.name, spec, observed, gang, st)
    decision = check.decision
    if decision is not None:
        if decision.outcome is GangOutcome.failed:
            _finish(p, observed, Phase.failed, decision.reason, decision.message, now)
            return
        st.restarts, st.disruptions = decision.restarts, decision.disruptions
        if decision.outcome is GangOutcome.disrupted:
            set_condition(st, ConditionType.disrupted, True, decision.cause.disruption, decision.message, now)
        p.events.append(Event("Warning", decision.reason, decision.message))
        gang = gang.restarted(gang_attempt(st))
    _delete_pods(p, gang.stale)

    for ref, event in running.replacements(spec, gang.live, p.delete):
        p.delete.append(ref)
        p.events.append(event)

    held = report.rollout_servers if report is not None and report.attempt == gang.attempt else None
    drain = running.drain(job.name, job.namespace, spec, gang, held, st.rollout_drain_start_time, p.delete, now)
    p.delete += drain.delete
    p.events += drain.events
    st.rollout_drain_start_time = drain.start_time
    if drain.wake_after is not None:
        p.wake_after = drain.wake_after if p.wake_after is None else min(p.wake_after, drain.wake_after)

    gone = running.gang_gone(spec, observed, gang)
    p.create += running.creates(job.name, job.namespace, spec, observed, gang.attempt, gone)
    if p.create and st.start_time is None:
        st.start_time = rfc3339(now)

    restarting = bool(gang.stale) or not gone or bool(check.failed) or bool(check.lost)
    st.phase = running.next_phase(job.name, spec, observed, gang.attempt, st.phase, restarting)


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
    summary = f"trainer {st.ready.trainer}, rollout {st.ready.rollout}, teachers {st.ready.teachers}"
    environments = [r for g, r in st.roles.items() if g.startswith(render.ENVIRONMENT_GROUP_PREFIX)]
    if environments:
        summary += f", environments {sum(r.ready for r in environments)}/{sum(r.desired for r in environments)}"
    summary += " ready"
    ready_reason = "AllPodsReady" if all_ready else "PodsNotReady"
    stuck = image_stuck(observed) if not all_ready else None
    if stuck is not None:
        # The kubelet's own reason (ErrImagePull, ImagePullBackOff, ...), as `kubectl get pods` shows it.
        name, ready_reason, why = stuck
        summary = f"{summary}; pod {name}: {ready_reason}" + (f": {why}" if why else "")
    set_condition(st, ConditionType.ready, all_ready, ready_reason, summary[:32768], now)
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


def _evaluated(p: Plan, evaluation: HeldOutEvaluation | None) -> None:
    """A new held-out evaluation goes into the status, with an event. A restarted trainer reports
    none until its first: the status keeps the last one meanwhile."""
    if evaluation is None or evaluation == p.status.evaluation:
        return
    p.status.evaluation = evaluation
    scores = ", ".join(
        f"{name} {s.score:.4g}" if s.score is not None else f"{name} n/a" for name, s in evaluation.sources.items()
    )
    headline = "n/a" if evaluation.score is None else f"{evaluation.score:.4g}"
    at = f"step {evaluation.step} (weight version {evaluation.weight_version})"
    message = f"held-out score {headline} at {at}: {scores}"
    p.events.append(Event("Normal", "Evaluated", message))


def _phase_event(p: Plan, previous: Phase) -> None:
    now_phase = p.status.phase
    if now_phase is previous:
        return
    if now_phase in TERMINAL:
        return  # _finish already emitted the terminal event with its reason
    kind = "Warning" if now_phase in (Phase.restarting, Phase.blocked) else "Normal"
    detail = f": {p.status.message}" if now_phase is Phase.blocked else ""
    p.events.append(Event(kind, now_phase.value, f"phase {previous.value} -> {now_phase.value}{detail}"))
