"""Live rollout scaling (`kubectl scale dj/NAME`, an HPA) with the real kopf operator against KMock.

The trainer's GET /status is a local HTTP server whose `rolloutServers` the tests set: trainer
pod 0 gets podIP 127.0.0.1 and its `http` port pointed at it, as in test_operator_kmock.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kmock import method

from operator_fixtures import (
    NS,
    Cluster,
    FastEmulator,
    eventually,
    job_manifest,
    more_passes,
    prepare_emulator,
    trainer_status,
)
from operator_fixtures import running_operator as operator
from test_operator_kmock import events, job_status, phase_is, posted

pytestmark = pytest.mark.kmock(cls=FastEmulator)


@pytest.fixture
def cluster(kmock: Any) -> Cluster:
    prepare_emulator(kmock)
    return Cluster(str(kmock.url))


def url(job: str, replica: int) -> str:
    """A rollout server's base URL as the job's config names it (render.endpoints)."""
    return f"http://{job}-rollout-{replica}.{job}-rollout.{NS}.svc:8000"


def pod_names(job: str, rollout: int, trainers: int = 2) -> set[str]:
    out = {f"{job}-trainer-{i}" for i in range(trainers)} | {f"{job}-teacher-math-0"}
    return out | {f"{job}-rollout-{i}" for i in range(rollout)}


async def pods_are(cluster: Cluster, job: str, names: set[str], timeout: float = 5.0) -> None:
    async def check() -> Any:
        return set(await cluster.pods(job)) == names

    await eventually(check, timeout=timeout, what=f"pods {sorted(names)}")


async def config(cluster: Cluster, job: str) -> dict[str, Any]:
    cm = await cluster.call(cluster.core.read_namespaced_config_map, f"{job}-config", NS)
    doc: dict[str, Any] = json.loads(cm.data["config.json"])
    return doc


async def status_where(cluster: Cluster, job: str, what: str, check: Any) -> dict[str, Any]:
    async def probe() -> Any:
        st = await job_status(cluster, job)
        return st if check(st) else None

    result: dict[str, Any] = await eventually(probe, what=what)
    return result


async def running_with_status(cluster: Cluster, manifest: dict[str, Any], port: int, rollout: int) -> None:
    """Create the job, point trainer pod 0 at the status server, run every pod, wait for Running."""
    job = manifest["metadata"]["name"]
    await cluster.create_job(manifest)
    await pods_are(cluster, job, pod_names(job, rollout))
    ports = {"containers": [{"name": "kubedistill", "ports": [{"name": "http", "containerPort": port}]}]}
    await cluster.call(cluster.core.patch_namespaced_pod, f"{job}-trainer-0", NS, {"spec": ports})
    await cluster.set_pod_status(f"{job}-trainer-0", "Running", ready=True, podIP="127.0.0.1")
    for name in await cluster.pods(job):
        if name != f"{job}-trainer-0":
            await cluster.set_pod_status(name, "Running", ready=True)
    await phase_is(cluster, job, "Running")


async def scaled_events(kmock: Any, text: str) -> list[dict[str, Any]]:
    """The RolloutScaled events whose message holds `text`, once there is one (kopf posts events
    from a background queue)."""

    async def check() -> Any:
        return [e for e in posted(kmock, "events") if e["reason"] == "RolloutScaled" and text in e["message"]]

    found: list[dict[str, Any]] = await eventually(check, what=f"a RolloutScaled event saying {text!r}")
    return found


def requests_since(kmock: Any, before: int) -> list[Any]:
    return list(kmock)[before:]


def deleted(requests: list[Any]) -> list[str]:
    return [r.url.path.rsplit("/", 1)[-1] for r in requests if r.method is method.DELETE]


async def test_scaling_up_adds_rollout_pods_and_endpoints_without_touching_the_gang(
    kmock: Any, cluster: Cluster
) -> None:
    doc = {"step": 3, "weightVersion": 3, "rolloutServers": [url("up", 0)]}
    async with trainer_status(doc) as port, operator(str(kmock.url), resync_seconds=0.3) as reconciler:
        await running_with_status(cluster, job_manifest("up", rollout={"replicas": 1}), port, rollout=1)
        st = await job_status(cluster, "up")
        assert st["rolloutReplicas"] == 1
        assert st["rolloutSelector"] == "kubedistill.io/job=up,kubedistill.io/role=rollout"
        # An unchanged spec never rewrites the config.
        await more_passes(reconciler.metrics, 3)
        assert not [r for r in list(kmock) if r.method is method.PATCH and "/configmaps/" in r.url.path]
        before = len(list(kmock))

        await cluster.patch_job("up", {"spec": {"rollout": {"replicas": 2}}})
        await pods_are(cluster, "up", pod_names("up", 2))
        cfg = await config(cluster, "up")
        assert cfg["endpoints"]["rollout"] == [url("up", 0), url("up", 1)]
        assert cfg["spec"]["rollout"]["replicas"] == 2
        # The config first: the new pod checks its index against it when it starts.
        reqs = requests_since(kmock, before)
        patch_at = next(
            i for i, r in enumerate(reqs) if r.method is method.PATCH and r.url.path.endswith("/configmaps/up-config")
        )
        create_at = next(
            i
            for i, r in enumerate(reqs)
            if r.method is method.POST and r.url.path.endswith("/pods") and r.data["metadata"]["name"] == "up-rollout-1"
        )
        assert patch_at < create_at
        # The trainer gang, the teacher and rollout pod 0 were left alone.
        assert deleted(reqs) == []
        made = [r.data["metadata"]["name"] for r in reqs if r.method is method.POST and r.url.path.endswith("/pods")]
        assert made == ["up-rollout-1"]
        (scaled,) = await events(kmock, "RolloutScaled")
        assert scaled["type"] == "Normal" and "spec.rollout.replicas 1 -> 2" in scaled["message"]
        assert "up-rollout-1" in scaled["message"]

        await cluster.set_pod_status("up-rollout-1", "Running", ready=True)
        st = await status_where(cluster, "up", "rollout 2/2", lambda s: s.get("ready", {}).get("rollout") == "2/2")
        assert st["phase"] == "Running" and (st["restarts"], st["disruptions"]) == (0, 0)
        assert st["roles"]["rollout"] == {"desired": 2, "ready": 2, "failed": 0} and st["rolloutReplicas"] == 2
        pods = await cluster.pods("up")
        assert {pods[f"up-trainer-{i}"].metadata.labels["kubedistill.io/attempt"] for i in range(2)} == {"0"}
        assert not [e for e in posted(kmock, "events") if e["reason"] in ("GangRestart", "GangDisrupted")]


async def test_scaling_down_drains_the_surplus_pod_before_deleting_it(kmock: Any, cluster: Cluster) -> None:
    doc = {"step": 5, "weightVersion": 5, "rolloutServers": [url("down", 0), url("down", 1)]}
    async with trainer_status(doc) as port, operator(str(kmock.url), resync_seconds=0.2) as reconciler:
        await running_with_status(cluster, job_manifest("down"), port, rollout=2)
        await status_where(cluster, "down", "the trainer's progress", lambda s: s.get("step") == 5)
        before = len(list(kmock))

        await cluster.patch_job("down", {"spec": {"rollout": {"replicas": 1}}})
        (scaled,) = await events(kmock, "RolloutScaled")
        assert "spec.rollout.replicas 2 -> 1" in scaled["message"] and "down-rollout-1" in scaled["message"]

        async def one_endpoint() -> Any:
            return (await config(cluster, "down"))["endpoints"]["rollout"] == [url("down", 0)]

        await eventually(one_endpoint, what="the config listing rollout pod 0 alone")
        # The trainer still holds rollout pod 1: it stays, and the job is Running and ready.
        await more_passes(reconciler.metrics, 5)
        assert "down-rollout-1" in await cluster.pods("down")
        st = await job_status(cluster, "down")
        assert st["phase"] == "Running" and st["ready"]["rollout"] == "1/1"
        assert st["roles"]["rollout"] == {"desired": 1, "ready": 1, "failed": 0}
        assert st["rolloutReplicas"] == 2 and st["rolloutDrainStartTime"]
        assert deleted(requests_since(kmock, before)) == []

        # The driver has drained it: the operator deletes it, and only it.
        doc["rolloutServers"] = [url("down", 0)]
        await pods_are(cluster, "down", pod_names("down", 1))
        assert deleted(requests_since(kmock, before)) == ["down-rollout-1"]
        gone = await scaled_events(kmock, "deleted rollout pod down-rollout-1")
        assert gone[0]["type"] == "Normal" and "the trainer has drained it" in gone[0]["message"]
        st = await status_where(cluster, "down", "one rollout pod", lambda s: s.get("rolloutReplicas") == 1)
        assert st["phase"] == "Running" and (st["restarts"], st["disruptions"]) == (0, 0)
        assert st.get("rolloutDrainStartTime") is None
        await more_passes(reconciler.metrics, 3)
        assert set(await cluster.pods("down")) == pod_names("down", 1)  # not recreated


async def test_a_surplus_pod_that_fails_or_is_deleted_is_not_replaced(kmock: Any, cluster: Cluster) -> None:
    servers = [url("gone", i) for i in range(3)]
    doc = {"step": 2, "weightVersion": 2, "rolloutServers": servers}
    async with trainer_status(doc) as port, operator(str(kmock.url), resync_seconds=0.2) as reconciler:
        manifest = job_manifest("gone", rollout={"replicas": 3})
        await running_with_status(cluster, manifest, port, rollout=3)
        await status_where(cluster, "gone", "the trainer's progress", lambda s: s.get("step") == 2)
        await cluster.patch_job("gone", {"spec": {"rollout": {"replicas": 1}}})
        await events(kmock, "RolloutScaled")
        await more_passes(reconciler.metrics, 3)
        assert set(await cluster.pods("gone")) == pod_names("gone", 3)  # both held by the trainer

        await cluster.delete_pod("gone-rollout-1")
        await cluster.fail_pod("gone-rollout-2", exit_code=137)
        await pods_are(cluster, "gone", pod_names("gone", 1))
        await more_passes(reconciler.metrics, 3)
        assert set(await cluster.pods("gone")) == pod_names("gone", 1)
        st = await job_status(cluster, "gone")
        assert st["phase"] == "Running" and (st["restarts"], st["disruptions"]) == (0, 0)
        assert st["ready"]["rollout"] == "1/1" and st["roles"]["rollout"]["failed"] == 0
        reasons = {e["reason"] for e in posted(kmock, "events")}
        assert not reasons & {"GangRestart", "GangDisrupted", "ServerReplaced", "Restarting"}
        failed = await scaled_events(kmock, "rollout pod gone-rollout-2 failed")
        assert "not replaced" in failed[0]["message"]


async def test_surplus_pods_go_at_once_when_the_trainer_is_not_running(kmock: Any, cluster: Cluster) -> None:
    async with operator(str(kmock.url), resync_seconds=0.2):
        await cluster.create_job(job_manifest("idle", rollout={"replicas": 3}))
        await pods_are(cluster, "idle", pod_names("idle", 3))
        # Every pod still Pending: no trainer holds any server.
        await cluster.patch_job("idle", {"spec": {"rollout": {"replicas": 1}}})
        await pods_are(cluster, "idle", pod_names("idle", 1))
        for name in ("idle-rollout-1", "idle-rollout-2"):
            gone = await scaled_events(kmock, f"deleted rollout pod {name}")
            assert "the trainer is not running" in gone[0]["message"]
        st = await job_status(cluster, "idle")
        assert (st["restarts"], st["disruptions"]) == (0, 0) and st["roles"]["rollout"]["desired"] == 1
        await cluster.run_all("idle")
        st = await phase_is(cluster, "idle", "Running")
        assert st["ready"]["rollout"] == "1/1" and st["rolloutReplicas"] == 1
