"""kopf wiring: watch jobs and their children, run the pure plan, apply it.

One kopf daemon per DistillationJob runs the reconcile loop: read the job (a live view) and its
children (kopf indices fed by label-selected watches), compute a plan (kubedistill.operator.policy),
apply it, sleep until a watch event shows something the last pass did not plan from (a spec
change, a child changed or deleted; not the echo of the loop's own writes), or the resync interval
passes. Daemons start for every job kopf sees, so an operator restart resumes every existing job;
deletion stops the daemon and the children go with the job's owner references.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import aiohttp
import kopf

from kubedistill.api.job import GROUP, KIND, PLURAL, VERSION
from kubedistill.api.roleconfig import Role
from kubedistill.api.spec import GangScheduler
from kubedistill.operator.kube import (
    CHILDREN,
    POD,
    UNWATCHED,
    Kube,
    KubeConfig,
    KubeError,
    bearer_header,
    client_configuration,
    fetch_json,
)
from kubedistill.operator.metrics import OperatorMetrics
from kubedistill.operator.observed import ChildRef, ChildView, Observed, PodPhase, PodView, status_patch
from kubedistill.operator.policy import (
    GANG_APIS,
    JobView,
    Plan,
    Refusal,
    RefusalKey,
    TrainerReport,
    create_backoff,
    current_status,
    gang_attempt,
    is_refusal,
    plan,
    refusal_reason,
)
from kubedistill.operator.render import KEPT_CURRENT, LABEL_ATTEMPT, LABEL_JOB, content_digest, owned_by_job

if TYPE_CHECKING:
    # kopf checks its decorators' handlers against these Protocols but does not re-export them.
    from kopf._core.intents.callbacks import IndexingFn, WatchingFn

ANNOTATION_PREFIX = "kubedistill.io"
FINALIZER = "kubedistill.io/finalizer"
OTHER_CHILDREN = tuple(r for r in CHILDREN if r is not POD)
"""The watched children indexed as ChildViews (pods have their own index of PodViews)."""

Key = tuple[str, str]
"""(namespace, job name)."""
RECENT_SECONDS = 60.0
"""How long a created child counts as present if no watch event about it ever arrives."""
API_CHECK_SECONDS = 30.0
"""How long a discovery answer (is a gang scheduler's API served?) is trusted: installing the
scheduler unblocks waiting jobs within this time."""


@dataclass
class OperatorOptions:
    resync_seconds: float = 5.0
    """Longest sleep between two reconcile passes of a job (watch events wake it sooner)."""
    status_timeout: float = 2.0
    """Timeout of one GET /status to trainer pod 0."""
    server: str | None = None
    """Plain-HTTP API server to use instead of the in-cluster/kubeconfig login (tests, bench)."""
    create_backoff_seconds: float = 2.0
    """First wait before creating a child the API server refused again (doubles per refusal)."""
    create_backoff_max_seconds: float = 120.0
    """Longest wait between two attempts to create a refused child."""
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)


@dataclass
class JobState:
    """What the operator remembers about one job between its reconcile passes, beyond what the
    job and the indices show. It lives exactly as long as the job's daemon (Reconciler.run)."""

    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by watch events about the job or its children: the loop plans again at once."""
    report: TrainerReport | None = None
    """Trainer pod 0's last GET /status, by the background poll."""
    polling: asyncio.Task[None] | None = None
    last_error: str | None = None
    """The last reconcile error reported as an Event: one Event per distinct error, not per retry."""
    written: dict[str, Any] | None = None
    """The status this loop last wrote: the job's live body shows it only once the watch event
    arrives, and deciding from an older status would repeat transitions and events."""
    decided: dict[str, Any] | None = None
    """The status a pass that created children decided and left to the next pass, which comes
    at once and counts them as made: that one writes it (the next pass plans from this). Writing
    both cost a status patch per job, ~9 ms of the API server's CPU each (the CRD's rules)."""
    recent: dict[tuple[str, str], tuple[float, dict[str, Any]]] = field(default_factory=dict)
    """Children this loop created or patched, by (kind, name), until a watch event about them
    arrives (then the indices are authoritative): counted as present so a pass woken by an early
    event does not create them again. Under load the watch lags seconds behind the creates, so
    this cannot be a short time window: each re-create is a 409, more load and more lag."""
    refused: dict[RefusalKey, Refusal] = field(default_factory=dict)
    """Children the API server refused to create: the plan holds them back until their backoff
    ends and shows the job Blocked meanwhile."""
    made: dict[ChildRef, str] = field(default_factory=dict)
    """Children of kinds the operator does not watch (PodGroups: their CRDs may be absent, and
    watching them would need list/watch RBAC on every cluster): present once created or found
    existing (409), with the digest of the content this loop last wrote (see Observed.digests);
    "" for one found existing, whose content is unknown, so the next pass patches it once (it may
    predate a scale). An operator restart creates them again (a 409 each)."""
    disrupted: dict[str, PodView] = field(default_factory=dict)
    """The last view of each pod the cluster took away (DisruptionTarget...), by pod name: the
    condition is visible only while the pod terminates, the decision may come after."""
    seen: Observed = field(default_factory=Observed)
    """The children as the last pass planned from them, plus those it created or patched: a watch
    event that shows a child as it is here wakes nothing. Each child created comes back as an
    ADDED event; re-planning on each cost more CPU than creating it (bench/operator_scale.py)."""
    generation: int | None = None
    """The job's generation the last pass planned from: the job's own events (its status patches,
    the finalizer) wake the loop only when the spec changed."""

    def close(self) -> None:
        if self.polling is not None:
            self.polling.cancel()


class Reconciler:
    """State shared by the handlers of one operator instance."""

    def __init__(self, options: OperatorOptions):
        self.options = options
        self.metrics = options.metrics
        self._kube: Kube | None = None
        self._http: aiohttp.ClientSession | None = None
        self._jobs: dict[Key, JobState] = {}
        """The jobs whose daemon runs: added when it starts, removed when it stops (run())."""
        self._apis: dict[GangScheduler, tuple[float, bool]] = {}

    @property
    def jobs(self) -> Mapping[Key, JobState]:
        """The state of every job whose daemon runs (read-only)."""
        return MappingProxyType(self._jobs)

    # -- plumbing -------------------------------------------------------------------------
    def kube(self) -> Kube:
        if self._kube is None:
            cfg = KubeConfig.plain(self.options.server) if self.options.server else KubeConfig.load()
            self._kube = Kube(cfg)
        return self._kube

    async def close(self) -> None:
        for state in self._jobs.values():
            state.close()
        if self._kube is not None:
            await self._kube.close()
        if self._http is not None:
            await self._http.close()

    def _state(self, namespace: str | None, job: str | None) -> JobState | None:
        return self._jobs.get((namespace, job)) if namespace and job else None

    def job_event(self, namespace: str | None, name: str, generation: int) -> None:
        """A watch event about a job: its loop plans again if the spec changed since its last pass."""
        state = self._state(namespace, name)
        if state is not None and state.generation != generation:
            state.wakeup.set()

    def child_seen(self, namespace: str | None, job: str | None, kind: str, view: PodView | ChildView) -> None:
        """A child as a watch event shows it, while kopf indexes it (the loop cannot run before the
        index holds it): from now on the index is authoritative, so it stops counting as recently
        made; its job re-plans unless its last pass saw it just so."""
        state = self._state(namespace, job)
        if state is None:
            # Of a job whose daemon is not running (yet), nothing is kept: once it starts, the
            # pods index shows a disruption while the pod terminates.
            return
        name = view.name if isinstance(view, PodView) else view.ref.name
        if isinstance(view, PodView) and view.disruption:
            state.disrupted[name] = view
        state.recent.pop((kind, name), None)
        if not state.seen.shows(view):
            state.wakeup.set()

    def child_gone(self, namespace: str | None, job: str | None, kind: str, body: Mapping[str, Any]) -> None:
        """A child deleted: its job re-plans (a pod's last view may say the cluster took it away)."""
        state = self._state(namespace, job)
        if state is None:
            return
        name = (body.get("metadata") or {}).get("name", "")
        if kind == "Pod":
            view = PodView.of(body)
            if view.disruption:
                state.disrupted[name] = view
        state.recent.pop((kind, name), None)
        state.wakeup.set()

    # -- the trainer's report -----------------------------------------------------------------
    def _poll_report(self, state: JobState, pod: PodView | None) -> None:
        """Poll trainer pod 0's GET /status in the background; a change wakes the job."""
        if pod is None or pod.phase is not PodPhase.running or not pod.pod_ip or not pod.http_port:
            return
        if state.polling is not None and not state.polling.done():
            return
        url = f"http://{pod.pod_ip}:{pod.http_port}/status"
        state.polling = asyncio.get_running_loop().create_task(self._poll(state, url, pod.attempt))

    async def _poll(self, state: JobState, url: str, attempt: int | None) -> None:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        doc = await fetch_json(self._http, url, self.options.status_timeout)
        if doc is None:
            return  # not up yet, or restarting: not an error
        try:
            report = TrainerReport.of(doc, attempt)
        except (TypeError, ValueError):
            return
        if state.report != report:
            state.report = report
            state.wakeup.set()

    async def _missing_apis(self, spec: Mapping[str, Any]) -> set[GangScheduler]:
        """The job's gang scheduler, if its API is not served (discovery, cached)."""
        try:
            gang = GangScheduler((spec.get("scheduling") or {}).get("gangScheduler", "none"))
        except ValueError:
            return set()  # an invalid spec: the plan reports it
        api = GANG_APIS.get(gang)
        if api is None:
            return set()
        checked = self._apis.get(gang)
        if checked is None or time.monotonic() - checked[0] > API_CHECK_SECONDS:
            served = await self.kube().serves(api.group_version, api.plural)
            checked = (time.monotonic(), served)
            self._apis[gang] = checked
        return set() if checked[1] else {gang}

    # -- one pass ------------------------------------------------------------------------
    async def reconcile(
        self,
        body: kopf.Body,
        state: JobState,
        pods: Iterable[PodView],
        others: Iterable[ChildView],
        logger: kopf.Logger,
    ) -> float | None:
        """Run one pass; the seconds until the next one (None: the job was deleted)."""
        name, namespace = body.meta["name"], body.meta["namespace"]
        views = list(others)
        made = state.made
        observed = Observed(
            pods={p.name: p for p in pods},
            others={v.ref for v in views} | set(made),
            digests={v.ref: v.digest for v in views if v.digest is not None}
            | {ref: digest for ref, digest in made.items() if ref.kind in KEPT_CURRENT},
            disrupted=dict(state.disrupted),
        )
        recent = state.recent
        now_mono = time.monotonic()
        for (kind, child), (when, obj) in list(recent.items()):
            if now_mono - when > RECENT_SECONDS:
                del recent[(kind, child)]
            elif kind != "Pod" or child not in observed.pods:
                # Created or updated by this loop, not yet seen by the watch: as written.
                observed.add(kind, obj)
        job = JobView(
            name=name,
            namespace=namespace,
            generation=int(body.meta.get("generation") or 0),
            spec=dict(body.spec),
            status=state.decided or state.written or dict(body.status),
        )
        # A copy: what this pass writes is added to it, not to what it plans from.
        state.seen = Observed(dict(observed.pods), set(observed.others), dict(observed.digests))
        state.generation = job.generation
        started = time.perf_counter()
        try:
            now = datetime.now(UTC)
            missing = await self._missing_apis(job.spec)
            p = plan(job, observed, now, state.report, state.refused, missing)
            newly_refused = await self._apply(body, state, job, p, now)
            state.last_error = None
        except (TimeoutError, KubeError) as exc:
            self._error(body, state, str(exc), logger)
            return self.options.resync_seconds
        except Exception as exc:  # a bug must not stop the loop or the other jobs
            logger.exception("reconcile of %s/%s failed", namespace, name)
            self._error(body, state, f"{type(exc).__name__}: {exc}", logger)
            return self.options.resync_seconds
        finally:
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
        self.metrics.job_phase(namespace, name, p.status.phase)
        self.metrics.job_status(namespace, name, p.status)
        if p.delete_job:
            return None
        rank0 = next(
            (
                q
                for q in observed.pods.values()
                if q.role is Role.trainer and q.replica == 0 and q.attempt == gang_attempt(p.status)
            ),
            None,
        )
        self._poll_report(state, rank0)
        delay = self.options.resync_seconds
        if p.wake_after is not None:
            delay = min(delay, max(p.wake_after, 0.05))
        if newly_refused:
            delay = 0.05  # plan again at once: the status must say Blocked, and why
        if p.create or p.update:
            # Plan again at once from what this pass wrote (their watch events wake nothing): the
            # status says Created, and the pods waiting for an unwatched child (PodGroup) go now.
            delay = 0.05
        return delay

    def _error(self, body: kopf.Body, state: JobState, message: str, logger: kopf.Logger) -> None:
        self.metrics.reconcile_errors.inc()
        logger.warning("reconcile error: %s", message)
        if state.last_error != message:
            state.last_error = message
            kopf.event(body, type="Warning", reason="ReconcileError", message=message[:1000])

    async def _apply(self, body: kopf.Body, state: JobState, job: JobView, p: Plan, now: datetime) -> bool:
        """Carry out the plan; whether the API server refused a child it had not refused before."""
        kube = self.kube()
        if p.update:
            # Before the creates: a new rollout pod reads the updated config when it starts.
            await self._update(state, p.update)
        newly_refused = await self._create(body, state, p.create, now) if p.create else False
        if p.delete:
            for c in p.delete:
                state.recent.pop((c.kind, c.name), None)
            gone = await asyncio.gather(*(kube.delete(c.kind, job.namespace, c.name) for c in p.delete))
            for ref, deleted in zip(p.delete, gone):
                if deleted:
                    self.metrics.children_deleted.labels(kind=ref.kind).inc()
        new = status_patch(p.status)
        if p.create or p.update:
            state.decided = new  # the follow-up pass writes it (Reconciler.reconcile)
        else:
            if new != (state.written or status_patch(current_status(body.status))):
                await kube.patch_status(job.namespace, job.name, new)
                state.written = new
            state.decided = None
        for ev in p.events:
            kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message)
        if p.delete_job:
            await kube.delete("DistillationJob", job.namespace, job.name)
        _forget_old_disruptions(state, gang_attempt(p.status))
        return newly_refused

    async def _update(self, state: JobState, objs: Sequence[dict[str, Any]]) -> None:
        """Patch the owned field of children that differ from the spec."""
        watched = [o for o in objs if o["kind"] not in UNWATCHED]
        _writing(state, watched)
        owned = [{KEPT_CURRENT[o["kind"]]: o[KEPT_CURRENT[o["kind"]]]} for o in objs]
        try:
            patched = await asyncio.gather(*(self.kube().patch(o, change) for o, change in zip(objs, owned)))
        except BaseException:
            _not_written(state, watched)
            raise
        for obj, found in zip(objs, patched):
            ref = ChildRef(obj["kind"], obj["metadata"]["name"])
            if not found:  # deleted meanwhile: the next pass creates it
                state.made.pop(ref, None)
                _not_written(state, [obj])
            elif ref.kind in UNWATCHED:
                state.made[ref] = content_digest(ref.kind, obj)

    async def _create(self, body: kopf.Body, state: JobState, objs: Sequence[dict[str, Any]], now: datetime) -> bool:
        """Create the children, all at once; whether the API server refused one it had not before."""
        # A retained checkpoint claim gets no owner reference: it outlives the job.
        kopf.adopt([o for o in objs if owned_by_job(o)], owner=body)
        for obj in objs:
            # kopf.adopt copies the job's labels; ours must win on the children.
            obj["metadata"]["labels"].update(_own_labels(obj))
        _writing(state, [o for o in objs if o["kind"] not in UNWATCHED])
        created = await asyncio.gather(*(self.kube().create(o) for o in objs), return_exceptions=True)
        refused = state.refused
        newly_refused = False
        failure: BaseException | None = None
        for obj, made in zip(objs, created):
            child = (obj["kind"], obj["metadata"]["name"])
            if isinstance(made, BaseException):
                _not_written(state, [obj])
                if isinstance(made, KubeError) and is_refusal(made.status):
                    newly_refused |= child not in refused
                    refused[child] = self._refusal(refused.get(child), made, now)
                    self.metrics.children_refused.labels(kind=obj["kind"]).inc()
                else:
                    failure = failure or made
                continue
            refused.pop(child, None)
            if obj["kind"] in UNWATCHED:
                digest = content_digest(obj["kind"], obj) if made and obj["kind"] in KEPT_CURRENT else ""
                state.made[ChildRef(*child)] = digest
            if made:
                self.metrics.children_created.labels(kind=obj["kind"]).inc()
        if failure is not None:
            raise failure
        return newly_refused

    def _refusal(self, last: Refusal | None, exc: KubeError, now: datetime) -> Refusal:
        attempts = (last.attempts if last else 0) + 1
        wait = create_backoff(attempts, self.options.create_backoff_seconds, self.options.create_backoff_max_seconds)
        return Refusal(
            reason=refusal_reason(exc.status, exc.detail),
            message=exc.detail,
            attempts=attempts,
            retry_at=now + timedelta(seconds=wait),
        )

    # -- the daemon loop -----------------------------------------------------------------
    async def run(
        self,
        body: kopf.Body,
        stopped: kopf.DaemonStopped,
        pods_index: Mapping[Key, Collection[PodView]],
        others_indices: Sequence[Mapping[Key, Collection[ChildView]]],
        logger: kopf.Logger,
    ) -> None:
        """The job's reconcile loop, until kopf stops it or the job is deleted; the indices hold
        every job's children by (namespace, job), others_indices one index per non-Pod kind."""
        key = (body.meta["namespace"], body.meta["name"])
        # kopf runs one daemon per job at a time: a state left here would be a stopped one's.
        state = self._jobs[key] = JobState()
        stop = asyncio.ensure_future(stopped.wait())
        try:
            while not stopped:
                state.wakeup.clear()
                others = [view for index in others_indices for view in index.get(key, ())]
                delay = await self.reconcile(body, state, list(pods_index.get(key, ())), others, logger)
                if delay is None or stopped:
                    break
                woken = asyncio.ensure_future(state.wakeup.wait())
                await asyncio.wait({woken, stop}, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
        finally:
            stop.cancel()
            # The one place a job's state goes, whichever way the loop ended.
            if self._jobs.get(key) is state:
                del self._jobs[key]
            state.close()
            if body.meta.get("deletionTimestamp"):
                self.metrics.job_phase(key[0], key[1], None)


def _writing(state: JobState, objs: Iterable[dict[str, Any]]) -> None:
    """Count children of watched kinds as written before the requests go: their watch events may
    come before the answers, and show what this loop already knows (JobState.seen)."""
    for obj in objs:
        state.recent[(obj["kind"], obj["metadata"]["name"])] = (time.monotonic(), obj)
        state.seen.add(obj["kind"], obj)


def _not_written(state: JobState, objs: Iterable[Mapping[str, Any]]) -> None:
    for obj in objs:
        state.recent.pop((obj["kind"], obj["metadata"]["name"]), None)


def _forget_old_disruptions(state: JobState, attempt: int) -> None:
    """Disruptions of earlier gang attempts were decided on already."""
    for name in [n for n, v in state.disrupted.items() if v.attempt is not None and v.attempt < attempt]:
        del state.disrupted[name]


def _own_labels(obj: Mapping[str, Any]) -> dict[str, str]:
    return {k: v for k, v in obj["metadata"]["labels"].items() if k.startswith("kubedistill.io/")}


class JobsDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base (an object's last handled state, for on.create/update handlers) of the
    jobs alone. kopf builds one of every body it processes, a deep copy of each pod, though the
    children have no such handlers: that was a fifth of the operator's CPU while it created
    children (bench/operator_scale.py)."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None) -> kopf.BodyEssence:
        if body.get("kind") != KIND:
            return kopf.BodyEssence()
        return super().build(body=body, extra_fields=extra_fields)


def configure(settings: kopf.OperatorSettings) -> None:
    """kopf settings the operator needs (also used by tests that run it in-process)."""
    # The CRD's status is structural: kopf's own state goes into annotations, not status.kopf.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = JobsDiffBase(prefix=ANNOTATION_PREFIX)
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


def _deleted(*, type: str | None, **_: Any) -> bool:  # noqa: A002 (kopf's name for the event type)
    return type == "DELETED"


def connection_info(cfg: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from the configuration the operator's own client uses: one reading
    of the kubeconfig or service account for both (kopf's login_via_client would send a
    kubeconfig tokenFile's trailing newline). kopf logs in again after a 401."""
    scheme, _, token = bearer_header(cfg).get("Authorization", "").partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


def build_registry(reconciler: Reconciler) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    selector = {LABEL_JOB: kopf.PRESENT}

    @kopf.on.startup(registry=registry)
    def _startup(*, settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(**_: Any) -> None:
        await reconciler.close()

    @kopf.on.login(registry=registry)
    def _login(**_: Any) -> kopf.ConnectionInfo:
        if reconciler.options.server:
            return kopf.ConnectionInfo(server=reconciler.options.server)
        return connection_info(client_configuration())

    # Indices: the children of each job, kept current by label-selected watches. Their handlers
    # also wake the job's loop (Reconciler.child_seen): kopf stores what they return before the
    # loop can run, and an event handler beside each would double kopf's work per event. They
    # are `async def`: kopf runs plain functions in a thread pool, a thread hop per watch event.
    @kopf.index(POD.group_version, POD.plural, labels=selector, registry=registry, id="job_pods")
    async def job_pods(*, namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Key, PodView]:
        if namespace is None:  # pods are namespaced: kopf always passes one
            return {}
        view = PodView.of(body)
        reconciler.child_seen(namespace, labels[LABEL_JOB], POD.kind, view)
        return {(namespace, labels[LABEL_JOB]): view}

    def _child_index(kind: str) -> IndexingFn:
        async def index(
            *, namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
        ) -> dict[Key, ChildView]:
            if namespace is None:  # every child kind is namespaced
                return {}
            view = ChildView.of(kind, body)
            reconciler.child_seen(namespace, labels[LABEL_JOB], kind, view)
            return {(namespace, labels[LABEL_JOB]): view}

        return index

    for r in OTHER_CHILDREN:
        kopf.index(r.group_version, r.plural, labels=selector, registry=registry, id=f"job_{r.plural}")(
            _child_index(r.kind)
        )

    # kopf drops a deleted child from the indices without calling their handlers: this one wakes its job.
    def _child_gone(kind: str) -> WatchingFn:
        async def gone(*, namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> None:
            reconciler.child_gone(namespace, labels.get(LABEL_JOB), kind, body)

        return gone

    for r in CHILDREN:
        kopf.on.event(
            r.group_version, r.plural, labels=selector, when=_deleted, registry=registry, id=f"gone_{r.plural}"
        )(_child_gone(r.kind))

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def _job_changed(*, namespace: str | None, name: str, meta: kopf.Meta, **_: Any) -> None:
        reconciler.job_event(namespace, name, int(meta.get("generation") or 0))

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=5.0)
    async def job(*, body: kopf.Body, stopped: kopf.DaemonStopped, logger: kopf.Logger, **kwargs: Any) -> None:
        # kopf passes every index as a keyword named by its handler id.
        pods: kopf.Index[Key, PodView] = kwargs["job_pods"]
        others: list[kopf.Index[Key, ChildView]] = [kwargs[f"job_{r.plural}"] for r in OTHER_CHILDREN]
        await reconciler.run(body, stopped, pods, others, logger)

    return registry


__all__ = ["OperatorOptions", "Reconciler", "build_registry", "configure", "LABEL_ATTEMPT"]
