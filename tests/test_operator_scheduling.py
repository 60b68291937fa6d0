"""Gang schedulers and cluster disruptions, with the real kopf operator against KMock.

Kueue, Volcano and scheduler-plugins are not running here: the emulator only serves (or not)
their APIs, which is what the operator depends on. Pod status changes are patched the way the
scheduler, the kubelet or Kueue would write them."""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest
from kmock import method

from operator_fixtures import NS, Cluster, FastEmulator, eventually, job_manifest, more_passes, prepare_emulator
from operator_fixtures import running_operator as operator
from test_operator_kmock import cond, events, job_status, phase_is, posted, running_job

pytestmark = pytest.mark.kmock(cls=FastEmulator)

VOLCANO = ("scheduling.volcano.sh", "v1beta1")
COSCHEDULING = ("scheduling.x-k8s.io", "v1alpha1")
KUEUE = ("kueue.x-k8s.io", "v1beta1")
ALL_PODS = 5  # BASE_SPEC: 2 trainer, 2 rollout, 1 teacher


def serve(kmock: Any, group: str, version: str, plural: str, kind: str) -> None:
    """Install a CRD's API in the emulator (discovery and its objects)."""
    kmock.resources[f"{group}/{version}/{plural}"] = kmock.ResourceInfo(
        kind=kind, namespaced=True, verbs={"list", "watch", "get", "create", "patch", "update", "delete"}
    )


@pytest.fixture
def cluster(kmock: Any) -> Cluster:
    prepare_emulator(kmock)
    return Cluster(str(kmock.url))


async def pod_group(cluster: Cluster, group: str, version: str, name: str) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = await cluster.call(
            cluster.custom.get_namespaced_custom_object, group, version, NS, "podgroups", name
        )
        return doc
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def disrupt(cluster: Cluster, name: str, reason: str = "PreemptionByScheduler", delete: bool = True) -> None:
    """What the scheduler does to a pod it preempts (and the Eviction API to a drained one): a
    DisruptionTarget condition, then the deletion."""
    status = {
        "phase": "Running",
        "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "DisruptionTarget", "status": "True", "reason": reason, "message": "preempted by ml/urgent"},
        ],
    }
    await cluster.call(cluster.core.patch_namespaced_pod_status, name, NS, {"status": status})
    if delete:
        await cluster.delete_pod(name)


async def attempts(cluster: Cluster, job: str, label: str = "kubedistill.io/attempt") -> dict[str, str | None]:
    return {n: (p.metadata.labels or {}).get(label) for n, p in (await cluster.pods(job)).items()}


# --- Volcano and coscheduling: a PodGroup owned by the job, made before the pods ------------------


@pytest.mark.parametrize(
    "gang, api, spec_extra, pod_check",
    [
        (
            "volcano",
            VOLCANO,
            {"queue": "research", "priorityClassName": "training"},
            lambda pod, job: (
                pod.metadata.annotations["scheduling.k8s.io/group-name"] == job
                and pod.spec.scheduler_name == "volcano"
                and pod.spec.priority_class_name == "training"
            ),
        ),
        (
            "coscheduling",
            COSCHEDULING,
            {"scheduleTimeoutSeconds": 120, "minMember": 3},
            lambda pod, job: (
                pod.metadata.labels["scheduling.x-k8s.io/pod-group"] == job and pod.spec.scheduler_name is None
            ),
        ),
    ],
    ids=["volcano", "coscheduling"],
)
async def test_pod_group_is_owned_by_the_job_and_made_before_the_pods(
    kmock: Any, cluster: Cluster, gang: str, api: tuple[str, str], spec_extra: dict[str, Any], pod_check: Any
) -> None:
    serve(kmock, *api, "podgroups", "PodGroup")
    job = f"pg-{gang}"
    manifest = job_manifest(job, scheduling={"gangScheduler": gang, **spec_extra})
    async with operator(str(kmock.url)):
        await cluster.create_job(manifest)

        async def every_pod() -> Any:
            return len(await cluster.pods(job)) == ALL_PODS

        await eventually(every_pod, what="the job's pods")
        group = await pod_group(cluster, *api, job)
        assert group is not None
        owner = group["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "DistillationJob",
            job,
            manifest["metadata"]["uid"],
            True,
        )
        assert group["metadata"]["labels"]["kubedistill.io/job"] == job
        # BASE_SPEC runs on cpu: every pod requests 250m CPU and 2Gi (operator/requests.py), and the
        # group's minResources are what its minMember pods request.
        if gang == "volcano":
            assert group["spec"] == {
                "minMember": ALL_PODS,
                "minResources": {"cpu": f"{250 * ALL_PODS}m", "memory": f"{2 * ALL_PODS}Gi"},
                "queue": "research",
                "priorityClassName": "training",
            }
        else:
            assert group["spec"] == {
                "minMember": 3,
                "minResources": {"cpu": "750m", "memory": "6Gi"},
                "scheduleTimeoutSeconds": 120,
            }
        for pod in (await cluster.pods(job)).values():
            assert pod_check(pod, job), pod.metadata.name
        # The scheduler places a pod by its group: the group came first.
        posts = [r for r in list(kmock) if r.method is method.POST]
        creates = [r.data for r in posts if r.url.path.endswith(("/pods", "/podgroups"))]
        kinds = [d["kind"] for d in creates if d["metadata"]["labels"]["kubedistill.io/job"] == job]
        assert kinds[0] == "PodGroup" and kinds.count("PodGroup") == 1


async def test_a_rollout_scale_keeps_the_pod_group_the_whole_job(kmock: Any, cluster: Cluster) -> None:
    """minMember unset means every pod: a scale patches the PodGroup (never watched) to the new
    count, and an operator that restarts patches it once, as it cannot know what it holds."""
    serve(kmock, *VOLCANO, "podgroups", "PodGroup")

    async def min_member_is(n: int) -> Any:
        group = await pod_group(cluster, *VOLCANO, "pgs")
        return group is not None and group["spec"]["minMember"] == n and len(await cluster.pods("pgs")) == n

    def group_patches() -> list[Any]:
        return [r for r in list(kmock) if r.method is method.PATCH and r.url.path.endswith("/podgroups/pgs")]

    async with operator(str(kmock.url), resync_seconds=0.2) as reconciler:
        await cluster.create_job(job_manifest("pgs", scheduling={"gangScheduler": "volcano"}))
        await eventually(lambda: min_member_is(ALL_PODS), what=f"{ALL_PODS} pods, minMember {ALL_PODS}")
        await cluster.patch_job("pgs", {"spec": {"rollout": {"replicas": 3}}})
        await eventually(lambda: min_member_is(ALL_PODS + 1), what="minMember following the scale")
        await more_passes(reconciler.metrics, 3)
        assert len(group_patches()) == 1
        assert reconciler.metrics.registry.get_sample_value("kubedistill_operator_reconcile_errors_total") == 0
    cluster.reconnect()
    # Scaled down while no operator runs: the pods are Pending, no trainer holds a server.
    await cluster.patch_job("pgs", {"spec": {"rollout": {"replicas": 1}}})
    async with operator(str(kmock.url), resync_seconds=0.2):
        await eventually(lambda: min_member_is(ALL_PODS - 1), what="minMember after the restart")
        assert len(group_patches()) == 2


async def test_a_gang_scheduler_whose_api_is_absent_blocks_the_job_and_says_why(kmock: Any, cluster: Cluster) -> None:
    """No scheduler-plugins here: the coscheduling job is Blocked with no pod made; a job with
    gangScheduler none beside it runs (the operator does not need any of these CRDs)."""
    async with operator(str(kmock.url), resync_seconds=0.2) as reconciler:
        await cluster.create_job(job_manifest("cosched", scheduling={"gangScheduler": "coscheduling"}))
        await running_job(cluster, job_manifest("plain"))
        st = await phase_is(cluster, "cosched", "Blocked")
        created = cond(st, "Created")
        assert created["status"] == "False" and created["reason"] == "GangSchedulerMissing"
        assert st["message"] == created["message"]
        assert "scheduling.x-k8s.io/v1alpha1 podgroups" in st["message"] and "scheduler-plugins" in st["message"]
        assert any("podgroups" in e["message"] for e in await events(kmock, "Blocked"))
        await more_passes(reconciler.metrics, 3)
        assert not await cluster.pods("cosched")
        assert ("ConfigMap", "cosched-config") in await cluster.children("cosched")
        get = reconciler.metrics.registry.get_sample_value
        assert get("kubedistill_operator_reconcile_errors_total") == 0
        assert not posted(kmock, "podgroups")


# --- Kueue: one plain pod group per gang attempt --------------------------------------------------


async def test_kueue_pods_form_one_pod_group_per_gang_attempt(kmock: Any, cluster: Cluster) -> None:
    serve(kmock, *KUEUE, "workloads", "Workload")
    manifest = job_manifest("kq", scheduling={"gangScheduler": "kueue", "queue": "research"})
    async with operator(str(kmock.url), resync_seconds=0.3):
        await running_job(cluster, manifest)
        pods = await cluster.pods("kq")
        assert len(pods) == ALL_PODS
        for pod in pods.values():
            assert pod.metadata.labels["kueue.x-k8s.io/queue-name"] == "research"
            assert pod.metadata.labels["kueue.x-k8s.io/pod-group-name"] == "kq-attempt-0"
            assert pod.metadata.annotations["kueue.x-k8s.io/pod-group-total-count"] == str(ALL_PODS)
        assert {p.metadata.annotations["kueue.x-k8s.io/role-hash"] for p in pods.values()} == {
            "trainer",
            "rollout",
            "t-math",
        }
        # A failed trainer restarts the whole job as the next group: Kueue queues it afresh and
        # releases the old group's quota once its pods are gone.
        await cluster.fail_pod("kq-trainer-0")

        async def next_group() -> Any:
            groups = await attempts(cluster, "kq", "kueue.x-k8s.io/pod-group-name")
            return len(groups) == ALL_PODS and set(groups.values()) == {"kq-attempt-1"}

        await eventually(next_group, what="every pod in group kq-attempt-1")
        st = await job_status(cluster, "kq")
        assert st["restarts"] == 1 and st["disruptions"] == 0


# --- preemption and eviction versus the job's own failures ----------------------------------------


async def test_a_preempted_trainer_restarts_the_gang_without_counting(kmock: Any, cluster: Cluster) -> None:
    """backoffLimit 0: one counted restart would fail the job. Preemption must not."""
    async with operator(str(kmock.url), resync_seconds=0.3):
        await running_job(cluster, job_manifest("pre", backoffLimit=0))
        before = len(list(kmock))
        await disrupt(cluster, "pre-trainer-1")

        async def new_gang() -> Any:
            got = await attempts(cluster, "pre")
            return got.get("pre-trainer-0") == "1" and got.get("pre-trainer-1") == "1"

        await eventually(new_gang, what="a new trainer gang (attempt 1)")
        st = await job_status(cluster, "pre")
        assert st["phase"] == "Restarting" and st["restarts"] == 0 and st["disruptions"] == 1
        disrupted = cond(st, "Disrupted")
        assert disrupted["status"] == "True" and disrupted["reason"] == "PreemptionByScheduler"
        assert "pre-trainer-1 was preempted" in disrupted["message"]
        assert "not counted against backoffLimit" in disrupted["message"]
        (event,) = await events(kmock, "GangDisrupted")
        assert event["type"] == "Warning" and event["message"] == disrupted["message"]
        assert not [e for e in posted(kmock, "events") if e["reason"] == "GangRestart"]
        # The surviving rank was deleted by the operator; the servers were left alone.
        deletes = [r.url.path.rsplit("/", 1)[-1] for r in list(kmock)[before:] if r.method is method.DELETE]
        assert "pre-trainer-0" in deletes and not [d for d in deletes if "rollout" in d or "teacher" in d]
        await cluster.run_all("pre")
        st = await phase_is(cluster, "pre", "Running")
        recovered = cond(st, "Disrupted")
        assert recovered["status"] == "False" and recovered["reason"] == "Recovered"
        assert "pre-trainer-1 was preempted" in recovered["message"]


async def test_eviction_does_not_count_but_the_jobs_own_failures_do(kmock: Any, cluster: Cluster) -> None:
    """backoffLimit 1: a kubelet eviction (phase Failed, reason Evicted) and a drain (Eviction API)
    are free; then a crash is counted, and a second crash fails the job."""
    async with operator(str(kmock.url), resync_seconds=0.3):
        await running_job(cluster, job_manifest("ev", backoffLimit=1))
        await cluster.set_pod_status("ev-trainer-0", "Failed", reason="Evicted", message="The node was low on memory.")

        async def attempt_is(n: int) -> Any:
            got = await attempts(cluster, "ev")
            return got.get("ev-trainer-0") == str(n) and got.get("ev-trainer-1") == str(n)

        await eventually(lambda: attempt_is(1), what="attempt 1 after the eviction")
        await cluster.run_all("ev")
        st = await phase_is(cluster, "ev", "Running")
        assert (st["restarts"], st["disruptions"]) == (0, 1)
        assert "evicted" in cond(st, "Disrupted")["message"]

        await disrupt(cluster, "ev-trainer-1", reason="EvictionByEvictionAPI")
        await eventually(lambda: attempt_is(2), what="attempt 2 after the drain")
        await cluster.run_all("ev")
        st = await phase_is(cluster, "ev", "Running")
        assert (st["restarts"], st["disruptions"]) == (0, 2)

        await cluster.fail_pod("ev-trainer-1", exit_code=2)
        await eventually(lambda: attempt_is(3), what="attempt 3 after the crash")
        st = await job_status(cluster, "ev")
        assert (st["restarts"], st["disruptions"]) == (1, 2)
        assert "exit code 2" in (await events(kmock, "GangRestart"))[0]["message"]
        await cluster.run_all("ev")
        await phase_is(cluster, "ev", "Running")

        await cluster.fail_pod("ev-trainer-0", exit_code=3)
        st = await phase_is(cluster, "ev", "Failed")
        assert cond(st, "Failed")["reason"] == "BackoffLimitExceeded" and st["restarts"] == 1


async def test_a_trainer_pod_deleted_by_hand_still_counts(kmock: Any, cluster: Cluster) -> None:
    """No disruption condition, no disruption reason: the job's own business (backoffLimit 0)."""
    async with operator(str(kmock.url), resync_seconds=0.3):
        await running_job(cluster, job_manifest("byhand", backoffLimit=0))
        await cluster.delete_pod("byhand-trainer-0")
        st = await phase_is(cluster, "byhand", "Failed")
        assert cond(st, "Failed")["reason"] == "BackoffLimitExceeded" and st["disruptions"] == 0
