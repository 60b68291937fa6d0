"""What the operator reads back from the cluster, and the status fields it derives from it.

Pure: Kubernetes objects in, small frozen views and status pieces out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from kubedistill.api.roleconfig import Role
from kubedistill.api.status import Condition, ConditionStatus, ConditionType, DistillationJobStatus, Phase, RoleStatus
from kubedistill.operator.render import (
    KEPT_CURRENT,
    LABEL_ATTEMPT,
    LABEL_ENVIRONMENT,
    LABEL_JOB,
    LABEL_REPLICA,
    LABEL_ROLE,
    LABEL_TEACHER,
    TEACHER_GROUP_PREFIX,
    content_digest,
    group_name,
)


class PodPhase(str, Enum):
    """A Pod's status.phase, as Kubernetes spells it."""

    pending = "Pending"
    running = "Running"
    succeeded = "Succeeded"
    failed = "Failed"
    unknown = "Unknown"

    @classmethod
    def of(cls, raw: object) -> PodPhase:
        """No phase yet is Pending (the pod was just created); a phase this version does not know
        is Unknown, which every decision treats as neither running nor finished."""
        if not raw:
            return cls.pending
        try:
            return cls(raw)
        except ValueError:
            return cls.unknown


FINISHED = (PodPhase.succeeded, PodPhase.failed)
CONDITION_ORDER = [
    ConditionType.created,
    ConditionType.ready,
    ConditionType.running,
    ConditionType.succeeded,
    ConditionType.failed,
    ConditionType.suspended,
    ConditionType.disrupted,
]
DISRUPTION_CONDITIONS = ("DisruptionTarget", "TerminationTarget")
"""Pod conditions the cluster sets on a pod it is about to take away: Kubernetes' DisruptionTarget
(scheduler preemption, the Eviction API of a node drain, the taint manager, the kubelet's
node-pressure eviction) and Kueue's TerminationTarget (it evicts or preempts a pod group)."""
DISRUPTION_REASONS = ("Preempted", "Evicted")
"""Pod status reasons of the same, for clusters that set no condition."""


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> datetime | None:
    if not s:
        return None
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


@dataclass(frozen=True)
class PodView:
    """The parts of a child Pod the operator decides on."""

    name: str
    role: Role | None
    """None when the pod's role label is missing or names no role of ours."""
    replica: int
    teacher: str | None = None
    attempt: int | None = None
    phase: PodPhase = PodPhase.pending
    ready: bool = False
    deleting: bool = False
    pod_ip: str | None = None
    http_port: int | None = None
    reason: str = ""
    """Why it failed: the pod's reason or the container's termination reason and exit code."""
    disruption: str = ""
    """Why the cluster took the pod away (a DISRUPTION_CONDITIONS reason, or Preempted/Evicted);
    empty when it did not."""
    volume_problem: str = ""
    """Why the scheduler cannot place the pod for want of a volume (a claim missing or unbound);
    empty otherwise."""
    termination_message: str = ""
    """The container's termination message once it has exited (trainer rank 0 writes its final
    /status there: kubedistill.api.progress.termination_message)."""
    image_problem: tuple[str, str] | None = None
    """(the kubelet's reason, its message) while a container cannot get its image
    (IMAGE_PROBLEMS: ErrImagePull, ImagePullBackOff, ...); None otherwise."""
    environment: str | None = None
    """The environment's name (environment pods: kubedistill.io/environment)."""

    @property
    def group(self) -> str:
        if self.role is None:
            return ""
        return group_name(self.role, self.environment if self.role is Role.environment else self.teacher)

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> PodView:
        meta = pod.get("metadata") or {}
        lbl = meta.get("labels") or {}
        status = pod.get("status") or {}
        phase = PodPhase.of(status.get("phase"))
        ready = phase is PodPhase.running and any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        port = None
        for c in (pod.get("spec") or {}).get("containers") or []:
            for p in c.get("ports") or []:
                if p.get("name") == "http":
                    port = p.get("containerPort")
        attempt = lbl.get(LABEL_ATTEMPT)
        replica = lbl.get(LABEL_REPLICA, "0")
        return cls(
            name=meta.get("name", ""),
            role=_role(lbl.get(LABEL_ROLE)),
            replica=int(replica) if str(replica).isdigit() else 0,
            teacher=lbl.get(LABEL_TEACHER),
            attempt=int(attempt) if attempt is not None and str(attempt).isdigit() else None,
            phase=phase,
            ready=ready,
            deleting=bool(meta.get("deletionTimestamp")),
            pod_ip=status.get("podIP"),
            http_port=port,
            reason=_failure_reason(status),
            disruption=_disruption(status),
            volume_problem=_volume_problem(status) if phase is PodPhase.pending else "",
            image_problem=_image_problem(status) if phase is PodPhase.pending else None,
            termination_message=_termination_message(status) if phase in FINISHED else "",
            environment=lbl.get(LABEL_ENVIRONMENT),
        )


def _role(label: str | None) -> Role | None:
    try:
        return Role(label)
    except ValueError:
        return None


def _failure_reason(status: Mapping[str, Any]) -> str:
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            why = term.get("reason") or "Error"
            return f"{why}, exit code {term.get('exitCode')}"
    return status.get("reason") or status.get("message") or ""


def _volume_problem(status: Mapping[str, Any]) -> str:
    """The scheduler's message when a volume keeps the pod unscheduled: it names a
    PersistentVolumeClaim ('persistentvolumeclaim "ckpt" not found', 'pod has unbound immediate
    PersistentVolumeClaims')."""
    for c in status.get("conditions") or []:
        message = str(c.get("message") or "")
        unscheduled = c.get("type") == "PodScheduled" and c.get("status") == "False"
        if unscheduled and "persistentvolumeclaim" in message.lower():
            return message
    return ""


IMAGE_PROBLEMS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "ImageInspectError",
        "RegistryUnavailable",
    }
)
"""The kubelet's waiting reasons of a container whose image it cannot get: the pod stays Pending
until someone fixes the image (the kubelet retries a pull by itself, with backoff)."""


def _termination_message(status: Mapping[str, Any]) -> str:
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term.get("message"):
            return str(term["message"])
    return ""


def _image_problem(status: Mapping[str, Any]) -> tuple[str, str] | None:
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PROBLEMS:
            return str(waiting["reason"]), str(waiting.get("message") or "")
    return None


def _disruption(status: Mapping[str, Any]) -> str:
    for c in status.get("conditions") or []:
        if c.get("type") in DISRUPTION_CONDITIONS and c.get("status") == "True":
            return str(c.get("reason") or c.get("type"))
    reason = status.get("reason")
    return str(reason) if reason in DISRUPTION_REASONS else ""


@dataclass(frozen=True)
class ChildRef:
    kind: str
    name: str


@dataclass(frozen=True)
class ChildView:
    """A non-Pod child as its watch shows it: which one, and for a kind whose content the
    operator keeps current (render.KEPT_CURRENT), a digest of that content."""

    ref: ChildRef
    digest: str | None = None

    @classmethod
    def of(cls, kind: str, obj: Mapping[str, Any]) -> ChildView:
        name = (obj.get("metadata") or {}).get("name", "")
        digest = content_digest(kind, obj) if kind in KEPT_CURRENT else None
        return cls(ChildRef(kind, name), digest)


@dataclass
class Observed:
    """A job's children as the operator last saw them."""

    pods: dict[str, PodView] = field(default_factory=dict)
    others: set[ChildRef] = field(default_factory=set)
    """ConfigMaps, Services, NetworkPolicies and PodGroups present (by kind and name)."""
    digests: dict[ChildRef, str] = field(default_factory=dict)
    """render.content_digest of the present children whose content the operator keeps current,
    where known; a child missing here is taken to be current."""
    disrupted: dict[str, PodView] = field(default_factory=dict)
    """The last view of each pod the cluster took away, by name, kept after the pod is gone: a
    deleted pod's DisruptionTarget condition is seen only while it terminates."""

    def shows(self, view: PodView | ChildView) -> bool:
        """Whether a child's view is already here as it is: a plan from these observations has
        decided on it, so a watch event showing just that (the echo of the operator's own create
        or patch, a change to fields no view holds) needs no new plan."""
        if isinstance(view, PodView):
            return self.pods.get(view.name) == view
        return view.ref in self.others and self.digests.get(view.ref) == view.digest

    def add(self, kind: str, obj: Mapping[str, Any]) -> None:
        """Count a child the operator is creating or patching as present, as it is written."""
        if kind == "Pod":
            self.pods[obj["metadata"]["name"]] = PodView.of(obj)
            return
        ref = ChildRef(kind, obj["metadata"]["name"])
        self.others.add(ref)
        if kind in KEPT_CURRENT:
            self.digests[ref] = content_digest(kind, obj)


def job_of(obj: Mapping[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB)


def set_condition(
    status: DistillationJobStatus, kind: ConditionType, value: bool, reason: str, message: str, now: datetime
) -> None:
    """Set a condition, keeping lastTransitionTime unless the status flips; keep a fixed order.
    Its observedGeneration is the status's (the generation this pass planned from)."""
    new = ConditionStatus.true if value else ConditionStatus.false
    existing = {c.type: c for c in status.conditions}
    old = existing.get(kind)
    since = old.last_transition_time if old is not None and old.status is new else rfc3339(now)
    existing[kind] = Condition(
        type=kind,
        status=new,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=status.observed_generation,
    )
    status.conditions = [existing[k] for k in CONDITION_ORDER if k in existing]


def condition(status: DistillationJobStatus, kind: ConditionType) -> Condition | None:
    return next((c for c in status.conditions if c.type is kind), None)


def role_counts(desired: Mapping[str, int], pods: list[PodView]) -> dict[str, RoleStatus]:
    """ready/failed per role group, over the pods the spec asks for: a pod whose replica index is
    at or beyond its group's desired count (a rollout pod draining after a scale-down) is not
    counted."""
    out = {g: RoleStatus(desired=n) for g, n in desired.items()}
    for p in pods:
        rs = out.get(p.group)
        if rs is None or p.deleting or p.replica >= rs.desired:
            continue
        if p.ready:
            rs.ready += 1
        if p.phase is PodPhase.failed:
            rs.failed += 1
    return out


def ready_summary(roles: Mapping[str, RoleStatus]) -> dict[str, str]:
    def total(keys: list[str]) -> str:
        return f"{sum(roles[k].ready for k in keys)}/{sum(roles[k].desired for k in keys)}"

    teachers = [k for k in roles if k.startswith(TEACHER_GROUP_PREFIX)]
    return {
        "trainer": total([k for k in roles if k == Role.trainer.value]),
        "rollout": total([k for k in roles if k == Role.rollout.value]),
        "teachers": total(teachers),
    }


def status_patch(status: DistillationJobStatus) -> dict[str, Any]:
    """The status as a JSON merge patch: unset optional fields are sent as null (removed)."""
    body = status.model_dump(by_alias=True, mode="json", exclude_none=False)
    for c in body.get("conditions", []):
        for k in [k for k, v in c.items() if v is None]:
            del c[k]
    return body


PHASE_EVENT_TYPE = {Phase.failed: "Warning", Phase.restarting: "Warning"}
