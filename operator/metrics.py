"""The operator's own Prometheus metrics (served on --metrics-port, default 9090).

The Helm chart's dashboard and alerts name exactly these (prefix `kubedistill_operator_`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from kubedistill.api.status import DistillationJobStatus, Phase
from kubedistill.metricdef import MetricDef

PREFIX = "kubedistill_operator_"
RECONCILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def _op(
    name: str, kind: type, help: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] | None = None
) -> MetricDef:
    return MetricDef(name, kind, help, labels, buckets, prefix=PREFIX)


METRICS: list[MetricDef] = [
    _op("jobs", Gauge, "DistillationJobs handled by this operator, by phase.", ("phase",)),
    _op("reconcile_seconds", Histogram, "Wall time of one reconcile pass of one job.", (), RECONCILE_BUCKETS),
    _op("reconcile_errors", Counter, "Reconcile passes that failed (API errors, unexpected exceptions)."),
    _op("children_created", Counter, "Child objects created, by kind.", ("kind",)),
    _op("children_deleted", Counter, "Child objects deleted, by kind.", ("kind",)),
    _op(
        "children_refused",
        Counter,
        "Child creations the API server refused (PodSecurity, quota, webhooks), by kind.",
        ("kind",),
    ),
    _op(
        "role_ready",
        Gauge,
        "Ready pods of each role of a job (trainer, rollout, teacher/<name>).",
        ("namespace", "job", "role"),
    ),
    _op("job_restarts", Gauge, "Trainer gang restarts of a job so far.", ("namespace", "job")),
]
"""Counters are exported with the `_total` suffix (kubedistill_operator_reconcile_errors_total...)."""


class OperatorMetrics:
    """The metrics of METRICS in one registry, each typed by its kind for the reconciler."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        built: dict[str, MetricWrapperBase] = {}
        for d in METRICS:
            kwargs: dict[str, Any] = {"registry": self.registry}
            if d.buckets is not None:
                kwargs["buckets"] = d.buckets
            built[d.name] = d.kind(d.full_name, d.help, d.labels, **kwargs)
        self.jobs = _of(built, "jobs", Gauge)
        self.reconcile_seconds = _of(built, "reconcile_seconds", Histogram)
        self.reconcile_errors = _of(built, "reconcile_errors", Counter)
        self.children_created = _of(built, "children_created", Counter)
        self.children_deleted = _of(built, "children_deleted", Counter)
        self.children_refused = _of(built, "children_refused", Counter)
        self.role_ready = _of(built, "role_ready", Gauge)
        self.job_restarts = _of(built, "job_restarts", Gauge)
        self._phases: dict[tuple[str, str], Phase] = {}
        self._roles: dict[tuple[str, str], set[str]] = {}
        for phase in Phase:
            self.jobs.labels(phase=phase.value).set(0)

    def job_phase(self, namespace: str, name: str, phase: Phase | None) -> None:
        """Record a job's phase (None: the job is gone) and refresh the per-phase gauge."""
        key = (namespace, name)
        if phase is None:
            self._phases.pop(key, None)
            self._forget_job(namespace, name)
        else:
            self._phases[key] = phase
        self._set_counts(self._phases.values())

    def job_status(self, namespace: str, name: str, status: DistillationJobStatus) -> None:
        """Per-job gauges from a computed status: ready pods per role, restarts."""
        self.job_restarts.labels(namespace=namespace, job=name).set(status.restarts)
        roles = self._roles.setdefault((namespace, name), set())
        for role, counts in status.roles.items():
            roles.add(role)
            self.role_ready.labels(namespace=namespace, job=name, role=role).set(counts.ready)

    def _forget_job(self, namespace: str, name: str) -> None:
        for role in self._roles.pop((namespace, name), set()):
            self.role_ready.remove(namespace, name, role)
        try:
            self.job_restarts.remove(namespace, name)
        except KeyError:
            pass

    def _set_counts(self, phases: Iterable[Phase]) -> None:
        counts = dict.fromkeys(Phase, 0)
        for p in phases:
            counts[p] += 1
        for p, n in counts.items():
            self.jobs.labels(phase=p.value).set(n)


_M = TypeVar("_M", bound=MetricWrapperBase)


def _of(built: Mapping[str, MetricWrapperBase], name: str, kind: type[_M]) -> _M:
    metric = built[name]
    if not isinstance(metric, kind):
        raise TypeError(f"metric {name} is a {type(metric).__name__} in METRICS, not a {kind.__name__}")
    return metric
