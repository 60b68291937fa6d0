"""Run the real kopf operator in-process against the KMock Kubernetes emulator.

Used by tests/test_operator*.py and bench/operator.py. Test code talks to the emulator through
the official kubernetes client (in a thread: the emulator serves from this event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp.web
import kmock
import kopf
import kubernetes

from kubedistill.api.job import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.operator.handlers import OperatorOptions, Reconciler, build_registry, configure
from kubedistill.operator.metrics import OperatorMetrics
from kubedistill.operator.render import render_children

NS = "ml"

BASE_SPEC: dict[str, Any] = {
    "device": "cpu",
    "student": {"model": "/models/student"},
    "teachers": [{"name": "math", "model": "/models/teacher", "replicas": 1}],
    "rollout": {"replicas": 2},
    "trainer": {"replicas": 2, "miniBatchSize": 4},
    "data": {"train": ["/data/train.jsonl"]},
    "backoffLimit": 2,
}


def job_manifest(name: str, spec: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    body = copy.deepcopy(spec if spec is not None else BASE_SPEC)
    body.update(overrides)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        # KMock stores objects as posted: give them the uid/resourceVersion the API server would.
        "metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4()), "generation": 1, "resourceVersion": "1"},
        "spec": body,
    }


def expected_children(job: str, spec: dict[str, Any] | None = None) -> set[tuple[str, str]]:
    """(kind, name) of every child the operator must create for a job with `spec`."""
    parsed = DistillationJobSpec.model_validate(spec if spec is not None else BASE_SPEC)
    return {(o["kind"], o["metadata"]["name"]) for o in render_children(job, NS, parsed)}


_serving: contextvars.ContextVar[Any] = contextvars.ContextVar("kmock_serving")


class FastEmulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """KMock's Kubernetes emulator minus one cost of its own making.

    To pick the reaction for a request, KMock asks whether the request is among those each
    reaction's filter sees, by re-filtering every request served so far: O(requests served) per
    request, quadratic over a test or a benchmark (the profile and its numbers:
    docs/operator.md#throughput-benchoperatorpy). While it serves a request, the filters here see
    that request alone, which is all the matching needs (the emulator's reactions have no
    slices); anywhere else, e.g. a test's `list(kmock)`, they see the whole log as before.
    Objects, watch streams and responses are KMock's own."""

    refuse: Callable[[Any], tuple[int, str] | None] | None = None
    """Tests set it to play an admission controller: (HTTP status, message) refuses a request,
    answered with a Kubernetes Status object as the API server answers; None lets it through."""

    async def _handle(self, request: Any) -> Any:
        _serving.set(request)  # aiohttp serves each connection in its own task (own context)
        refusal = self.refuse(request) if self.refuse is not None else None
        if refusal is not None:
            code, message = refusal
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}
            return aiohttp.web.json_response(status, status=code)
        return await super()._handle(request)

    def __iter__(self) -> Any:
        request = _serving.get(None)
        if request is None:
            yield from super().__iter__()
        else:
            yield request


def prepare_emulator(kmock: Any) -> None:
    kmock.resources.load_bundled()
    kmock.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
        kind=KIND,
        singular="distillationjob",
        namespaced=True,
        verbs={"list", "watch", "get", "create", "patch", "update", "delete"},
        subresources={"status"},
    )


class Cluster:
    """The emulator seen through the kubernetes client, with waiting helpers."""

    def __init__(self, url: str):
        cfg = kubernetes.client.Configuration(host=url)
        self.api_client = kubernetes.client.ApiClient(cfg)
        self.core = kubernetes.client.CoreV1Api(self.api_client)
        self.net = kubernetes.client.NetworkingV1Api(self.api_client)
        self.custom = kubernetes.client.CustomObjectsApi(self.api_client)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", 10)
        return await asyncio.to_thread(fn, *args, **kwargs)

    def reconnect(self) -> None:
        """Drop pooled connections. Needed after an in-process operator stops: kopf cancels
        every task started after it, including the emulator's handlers of our open connections."""
        self.api_client.rest_client.pool_manager.clear()

    async def create_job(self, manifest: dict[str, Any]) -> None:
        await self.call(self.custom.create_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, manifest)

    async def job(self, name: str) -> dict[str, Any] | None:
        try:
            return await self.call(self.custom.get_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, name)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def patch_job(self, name: str, patch: dict[str, Any]) -> None:
        await self.call(self.custom.patch_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, name, patch)

    async def delete_job(self, name: str) -> None:
        await self.call(self.custom.delete_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, name)

    async def pods(self, job: str) -> dict[str, Any]:
        """Pods of the job (by label, filtered here: the emulator ignores label selectors)."""
        items = (await self.call(self.core.list_namespaced_pod, NS)).items
        return {p.metadata.name: p for p in items if (p.metadata.labels or {}).get("kubedistill.io/job") == job}

    async def children(self, job: str) -> set[tuple[str, str]]:
        def mine(items: Any) -> list[str]:
            return [o.metadata.name for o in items if (o.metadata.labels or {}).get("kubedistill.io/job") == job]

        out = {("Pod", n) for n in await self.pods(job)}
        out |= {("Service", n) for n in mine((await self.call(self.core.list_namespaced_service, NS)).items)}
        out |= {("ConfigMap", n) for n in mine((await self.call(self.core.list_namespaced_config_map, NS)).items)}
        out |= {
            ("NetworkPolicy", n) for n in mine((await self.call(self.net.list_namespaced_network_policy, NS)).items)
        }
        claims = (await self.call(self.core.list_namespaced_persistent_volume_claim, NS)).items
        out |= {("PersistentVolumeClaim", n) for n in mine(claims)}
        return out

    async def set_pod_status(self, name: str, phase: str, ready: bool = False, **extra: Any) -> None:
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            **extra,
        }
        await self.call(self.core.patch_namespaced_pod_status, name, NS, {"status": status})

    async def fail_pod(self, name: str, exit_code: int = 1) -> None:
        terminated = {"exitCode": exit_code, "reason": "Error"}
        await self.set_pod_status(
            name,
            "Failed",
            containerStatuses=[
                {
                    "name": "kubedistill",
                    "image": "kubedistill",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            ],
        )

    async def delete_pod(self, name: str) -> None:
        await self.call(self.core.delete_namespaced_pod, name, NS)

    async def run_all(self, job: str) -> None:
        for name in await self.pods(job):
            await self.set_pod_status(name, "Running", ready=True)


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 5.0, interval: float = 0.02, what: str = "condition"
) -> Any:
    """Poll `check` until it returns something truthy; fail with its last value after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = await check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last value: {last!r}")
        await asyncio.sleep(interval)


def reconcile_passes(metrics: OperatorMetrics) -> float:
    """Reconcile passes the operator has finished, over every job."""
    return metrics.registry.get_sample_value("kubedistill_operator_reconcile_seconds_count") or 0.0


async def more_passes(metrics: OperatorMetrics, n: int, timeout: float = 5.0) -> None:
    """Wait until the operator has finished `n` more reconcile passes than when called: what a
    test waits for before it asserts that something did not happen."""
    target = reconcile_passes(metrics) + n

    async def done() -> bool:
        return reconcile_passes(metrics) >= target

    await eventually(done, timeout=timeout, what=f"{n} more reconcile passes")


@contextlib.asynccontextmanager
async def running_operator(
    url: str,
    resync_seconds: float = 0.5,
    metrics: OperatorMetrics | None = None,
    post_events: bool = True,
    **options: Any,
) -> AsyncIterator[Reconciler]:
    """The real operator (kopf + our handlers), cluster-wide (KMock cannot list namespaces), in
    this event loop; `options` go to OperatorOptions."""
    settings_ = OperatorOptions(
        resync_seconds=resync_seconds, server=url, metrics=metrics or OperatorMetrics(), **options
    )
    reconciler = Reconciler(settings_)
    registry = build_registry(reconciler)
    settings = kopf.OperatorSettings()
    configure(settings)
    settings.watching.reconnect_backoff = 0.1
    settings.posting.enabled = post_events
    ready = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry,
            settings=settings,
            standalone=True,
            clusterwide=True,
            ready_flag=ready,
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield reconciler
    finally:
        # Cancelling is instant; the stop flag would add kopf's ~5 s grace period.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await reconciler.close()


logging.getLogger("kopf").setLevel(logging.WARNING)


@contextlib.asynccontextmanager
async def trainer_status(doc: dict[str, Any]) -> AsyncIterator[int]:
    """A trainer rank 0 /status server answering `doc` (mutable: the tests change it); its port."""

    async def status(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response(doc)

    app = aiohttp.web.Application()
    app.router.add_get("/status", status)
    async with serving(app) as port:
        yield port


@contextlib.asynccontextmanager
async def serving(app: aiohttp.web.Application) -> AsyncIterator[int]:
    """`app` on a free loopback port, in this event loop; the port."""
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()
