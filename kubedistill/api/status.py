"""The DistillationJob status, written by the operator (level-triggered from the children)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import Field

from kubedistill.api.base import MAX_SAFE_INT, ApiModel, keyed_by

SCALE_REPLICAS_MAX = 2**31 - 1
"""The scale subresource's replicas are an autoscaling/v1 Scale's int32: the API server refuses a
larger status.rolloutReplicas (its statusReplicasPath) whatever the schema allows."""


class Phase(str, Enum):
    pending = "Pending"
    initializing = "Initializing"
    running = "Running"
    restarting = "Restarting"
    succeeded = "Succeeded"
    failed = "Failed"
    suspended = "Suspended"
    blocked = "Blocked"
    """The API server refuses to create a child (PodSecurity, quota, an admission webhook):
    retried with backoff, and the phase the job would have once the cause is removed."""


class ConditionType(str, Enum):
    created = "Created"
    ready = "Ready"
    running = "Running"
    succeeded = "Succeeded"
    failed = "Failed"
    suspended = "Suspended"
    disrupted = "Disrupted"
    """True while the trainer gang restarts because the cluster took a pod away (preemption,
    eviction, node drain, a queue's eviction); set only once that has happened."""


class ConditionStatus(str, Enum):
    true = "True"
    false = "False"
    unknown = "Unknown"


class Condition(ApiModel):
    """A Kubernetes-style condition."""

    type: ConditionType
    """Condition type."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: Annotated[str, Field(max_length=1024)] = ""
    """CamelCase machine-readable reason."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """Human-readable detail."""
    last_transition_time: str | None = None
    """RFC 3339 time the status last changed."""
    observed_generation: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] | None = None
    """The job's metadata.generation the condition was set from: older than the job's means the
    operator has not acted on the latest spec yet."""


class RoleStatus(ApiModel):
    """Pod counts of one role (trainer, rollout, teacher/<name>)."""

    desired: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Pods the spec asks for."""
    ready: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Pods running and ready."""
    failed: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Pods currently failed."""


class ReadySummary(ApiModel):
    """ready/desired per role group, for kubectl's printer columns."""

    trainer: str = "0/0"
    """Trainer pods ready/desired."""
    rollout: str = "0/0"
    """Rollout pods ready/desired."""
    teachers: str = "0/0"
    """Teacher pods (all teachers) ready/desired."""


class HeldOutSource(ApiModel):
    """One data_source's held-out results."""

    score: float | None = None
    """Mean task reward (accuracy for 0/1 rewards); unset when no reward function matches."""
    response_length: float | None = None
    """Mean response tokens."""
    reverse_kl: float | None = Field(default=None, alias="reverseKL")
    """Per-token reverse KL(student || teacher) estimate (spec.evaluation.scoreWithTeachers)."""
    teacher: Annotated[str, Field(max_length=256)] | None = None
    """The teacher its samples route to (scoreWithTeachers)."""


class HeldOutEvaluation(ApiModel):
    """The last held-out evaluation (spec.evaluation)."""

    step: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Train step whose weights were evaluated (0: the starting student)."""
    weight_version: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Weight version the rollout servers served for it."""
    score: float | None = None
    """Headline: the mean of the data sources' scores."""
    sources: dict[str, HeldOutSource] = Field(default_factory=dict, max_length=256)
    """Results per data_source."""


class DistillationJobStatus(ApiModel):
    """Observed state of the job."""

    phase: Phase = Phase.pending
    """Pending, Initializing, Running, Restarting, Succeeded, Failed, Suspended or Blocked."""
    message: Annotated[str, Field(max_length=4096)] = ""
    """Why the job is Blocked or Failed, in one line (empty otherwise)."""
    conditions: list[Condition] = Field(default_factory=list, max_length=16, json_schema_extra=keyed_by("type"))
    """Created, Ready, Running, Succeeded, Failed, Suspended, and Disrupted once the cluster
    took a trainer pod away."""
    roles: dict[str, RoleStatus] = Field(default_factory=dict, max_length=64)
    """Pod counts per role: trainer, rollout, teacher/<name>."""
    ready: ReadySummary = Field(default_factory=ReadySummary)
    """ready/desired summaries shown by kubectl get."""
    rollout_replicas: Annotated[int, Field(ge=0, le=SCALE_REPLICAS_MAX)] = 0
    """Rollout pods that exist and have not finished, those still draining after a scale-down
    included (the scale subresource's status.replicas, as a Deployment counts its pods)."""
    rollout_selector: Annotated[str, Field(max_length=1024)] = ""
    """Label selector of the job's rollout pods (the scale subresource's selector, which a
    HorizontalPodAutoscaler needs)."""
    rollout_drain_start_time: str | None = None
    """RFC 3339 time of the scale-down whose surplus rollout pods (replica index at or beyond
    spec.rollout.replicas) still run while the trainer drains them; unset when none is left."""
    step: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Last completed train step (reported by the trainer; totalSteps once it succeeded)."""
    weight_version: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Weight version the rollout servers serve."""
    last_checkpoint: str | None = None
    """Path of the newest complete checkpoint."""
    evaluation: HeldOutEvaluation | None = None
    """The last held-out evaluation reported by the trainer (spec.evaluation)."""
    restarts: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Trainer gang restarts caused by the job's own failures so far (bounded by spec.backoffLimit)."""
    disruptions: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Trainer gang restarts caused by the cluster (preemption, eviction, node drain); not counted
    against spec.backoffLimit. The gang attempt is restarts + disruptions."""
    observed_generation: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """metadata.generation the status reflects."""
    start_time: str | None = None
    """RFC 3339 time the job's pods were first created."""
    completion_time: str | None = None
    """RFC 3339 time the job succeeded or failed."""
