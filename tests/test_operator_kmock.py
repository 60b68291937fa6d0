"""The real kopf operator, in-process, against the KMock Kubernetes emulator.

Children are checked through the official kubernetes client; pod status transitions are patched
into the emulator the way a kubelet would report them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kmock import method

from kubedistill.operator.metrics import OperatorMetrics
from operator_fixtures import (
    BASE_SPEC,
    NS,
    Cluster,
    FastEmulator,
    eventually,
    expected_children,
    job_manifest,
    more_passes,
    prepare_emulator,
    reconcile_passes,
    running_operator,
    trainer_status,
)

# KMock's emulator without its per-request scan of the request log (see FastEmulator).
pytestmark = pytest.mark.kmock(cls=FastEmulator)

JOB_CHILDREN = {
    ("ConfigMap", "{j}-config"),
    ("NetworkPolicy", "{j}"),
    ("PersistentVolumeClaim", "{j}-checkpoint"),
    ("Service", "{j}-trainer"),
    ("Service", "{j}-rollout"),
    ("Service", "{j}-t-math"),
    ("Pod", "{j}-trainer-0"),
    ("Pod", "{j}-trainer-1"),
    ("Pod", "{j}-rollout-0"),
    ("Pod", "{j}-rollout-1"),
    ("Pod", "{j}-teacher-math-0"),
}


def expected(job: str) -> set[tuple[str, str]]:
    return {(k, n.format(j=job)) for k, n in JOB_CHILDREN}


@pytest.fixture
def cluster(kmock: Any) -> Cluster:
    prepare_emulator(kmock)
    return Cluster(str(kmock.url))


async def all_children(cluster: Cluster, job: str) -> Any:
    async def check() -> Any:
        return await cluster.children(job) == expected(job)

    await eventually(check, what=f"children of {job}")


async def job_status(cluster: Cluster, job: str) -> dict[str, Any]:
    body = await cluster.job(job)
    return (body or {}).get("status") or {}


async def phase_is(cluster: Cluster, job: str, phase: str, timeout: float = 5.0) -> dict[str, Any]:
    async def check() -> Any:
        st = await job_status(cluster, job)
        return st if st.get("phase") == phase else None

    return await eventually(check, timeout=timeout, what=f"{job} phase {phase}")


def cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def posted(kmock: Any, plural: str) -> list[dict[str, Any]]:
    """Bodies POSTed to a collection (KMock keeps every request)."""
    return [r.data for r in list(kmock) if r.method is method.POST and r.url.path.endswith(f"/{plural}")]


async def events(kmock: Any, reason: str) -> list[dict[str, Any]]:
    """The Events posted with `reason`, once there is one: kopf posts them from a background
    queue, a little after the pass that emitted them."""

    async def check() -> Any:
        return [e for e in posted(kmock, "events") if e["reason"] == reason]

    return await eventually(check, what=f"a {reason} event")


async def running_job(cluster: Cluster, manifest: dict[str, Any]) -> None:
    """Create the job, wait for its children, mark every pod Running and wait for phase Running."""
    name = manifest["metadata"]["name"]
    await cluster.create_job(manifest)
    await all_children(cluster, name)
    await cluster.run_all(name)
    await phase_is(cluster, name, "Running")


async def test_create_makes_owned_labelled_children_and_status(kmock: Any, cluster: Cluster) -> None:
    manifest = job_manifest("alpha")
    async with running_operator(str(kmock.url)):
        await cluster.create_job(manifest)
        await all_children(cluster, "alpha")
        pods = await cluster.pods("alpha")
        t0 = pods["alpha-trainer-0"]
        assert t0.spec.containers[0].command == [
            "kubedistill",
            "role",
            "trainer",
            "--config",
            "/etc/kubedistill/config.json",
        ]
        assert t0.metadata.labels["kubedistill.io/role"] == "trainer"
        assert t0.metadata.labels["kubedistill.io/replica"] == "0"
        owner = t0.metadata.owner_references[0]
        assert (owner.kind, owner.name, owner.uid, owner.controller) == (
            "DistillationJob",
            "alpha",
            manifest["metadata"]["uid"],
            True,
        )
        cm = await cluster.call(cluster.core.read_namespaced_config_map, "alpha-config", NS)
        assert json.loads(cm.data["config.json"])["endpoints"]["rollout"][1] == (
            f"http://alpha-rollout-1.alpha-rollout.{NS}.svc:8000"
        )
        assert cm.metadata.owner_references[0].uid == manifest["metadata"]["uid"]
        st = await phase_is(cluster, "alpha", "Pending")
        assert st["roles"]["trainer"] == {"desired": 2, "ready": 0, "failed": 0}
        assert st["ready"] == {"trainer": "0/2", "rollout": "0/2", "teachers": "0/1"}
        assert st["startTime"] and st["observedGeneration"] == 1
        assert {c["type"] for c in st["conditions"]} == {
            "Created",
            "Ready",
            "Running",
            "Succeeded",
            "Failed",
            "Suspended",
        }
        assert all(c["lastTransitionTime"] and c["reason"] for c in st["conditions"])
        # kopf keeps its state in annotations (the CRD's status is structural).
        body = await cluster.job("alpha")
        assert "kopf" not in body["status"]
        assert "kubedistill.io/finalizer" in body["metadata"]["finalizers"]


async def test_pod_transitions_drive_phase_conditions_and_progress(kmock: Any, cluster: Cluster) -> None:
    doc = {"step": 7, "weightVersion": 6, "lastCheckpoint": "/ckpt/step-5"}
    async with trainer_status(doc) as port, running_operator(str(kmock.url), resync_seconds=0.3):
        await cluster.create_job(job_manifest("beta"))
        await all_children(cluster, "beta")
        for name in await cluster.pods("beta"):
            await cluster.set_pod_status(name, "Running", ready=False)
        st = await phase_is(cluster, "beta", "Initializing")
        assert cond(st, "Ready")["status"] == "False"
        # Point trainer pod 0's HTTP port at the local status server (podIP + named port).
        spec_patch = {
            "spec": {
                "containers": [
                    {"name": "kubedistill", "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]}
                ]
            }
        }
        await cluster.call(cluster.core.patch_namespaced_pod, "beta-trainer-0", NS, spec_patch)
        await cluster.set_pod_status("beta-trainer-0", "Running", ready=True, podIP="127.0.0.1")
        for name in await cluster.pods("beta"):
            if name != "beta-trainer-0":
                await cluster.set_pod_status(name, "Running", ready=True)
        st = await phase_is(cluster, "beta", "Running")
        assert cond(st, "Ready")["status"] == "True" and cond(st, "Running")["status"] == "True"
        assert st["ready"] == {"trainer": "2/2", "rollout": "2/2", "teachers": "1/1"}

        async def progressed() -> Any:
            s = await job_status(cluster, "beta")
            return s if s.get("step") == 7 else None

        st = await eventually(progressed, what="trainer progress")
        assert st["weightVersion"] == 6 and st["lastCheckpoint"] == "/ckpt/step-5"
        assert await events(kmock, "Initializing") and await events(kmock, "Running")


async def test_trainer_failure_restarts_the_whole_gang(kmock: Any, cluster: Cluster) -> None:
    async with running_operator(str(kmock.url), resync_seconds=0.3):
        await running_job(cluster, job_manifest("gamma"))
        await cluster.fail_pod("gamma-trainer-1")

        async def new_gang() -> Any:
            pods = await cluster.pods("gamma")
            trainers = [p for n, p in pods.items() if "trainer" in n]
            return len(trainers) == 2 and all(p.metadata.labels["kubedistill.io/attempt"] == "1" for p in trainers)

        await eventually(new_gang, what="a new trainer gang")
        st = await job_status(cluster, "gamma")
        assert st["restarts"] == 1 and st["phase"] == "Restarting"
        # Servers were left alone.
        rollout_creates = [b for b in posted(kmock, "pods") if b["metadata"]["name"] == "gamma-rollout-0"]
        assert len(rollout_creates) >= 1
        assert all(r.method is not method.DELETE or "rollout" not in r.url.path for r in list(kmock))
        warnings = await events(kmock, "GangRestart")
        assert warnings and warnings[0]["type"] == "Warning" and "gamma-trainer-1" in warnings[0]["message"]
        await cluster.run_all("gamma")
        st = await phase_is(cluster, "gamma", "Running")
        assert st["restarts"] == 1


async def test_a_trainer_pod_deleted_by_hand_restarts_the_whole_gang(kmock: Any, cluster: Cluster) -> None:
    async with running_operator(str(kmock.url), resync_seconds=0.3):
        await running_job(cluster, job_manifest("nu"))
        before = len(list(kmock))
        await cluster.delete_pod("nu-trainer-0")

        async def new_gang() -> Any:
            pods = await cluster.pods("nu")
            return {n: p.metadata.labels.get("kubedistill.io/attempt") for n, p in pods.items() if "trainer" in n} == {
                "nu-trainer-0": "1",
                "nu-trainer-1": "1",
            }

        await eventually(new_gang, what="a new trainer gang (attempt 1)")
        st = await job_status(cluster, "nu")
        assert st["restarts"] == 1 and st["phase"] == "Restarting"
        # The surviving rank was deleted by the operator; the servers were left alone.
        deletes = [r.url.path.rsplit("/", 1)[-1] for r in list(kmock)[before:] if r.method is method.DELETE]
        assert sorted(deletes) == ["nu-trainer-0", "nu-trainer-1"]
        restart = await events(kmock, "GangRestart")
        assert len(restart) == 1 and "nu-trainer-0 is gone" in restart[0]["message"]


async def test_backoff_exhausted_fails_the_job(kmock: Any, cluster: Cluster) -> None:
    async with running_operator(str(kmock.url), resync_seconds=0.3):
        await running_job(cluster, job_manifest("delta", backoffLimit=0))
        await cluster.fail_pod("delta-trainer-0", exit_code=3)
        st = await phase_is(cluster, "delta", "Failed")
        failed = cond(st, "Failed")
        assert failed["status"] == "True" and failed["reason"] == "BackoffLimitExceeded"
        assert "exit code 3" in failed["message"]
        assert st["completionTime"]

        async def servers_gone() -> Any:
            return set(await cluster.pods("delta")) == {"delta-trainer-0"}

        await eventually(servers_gone, what="running pods deleted, the failed one kept")


async def test_server_failure_replaces_only_that_pod(kmock: Any, cluster: Cluster) -> None:
    async with running_operator(str(kmock.url), resync_seconds=0.3):
        await running_job(cluster, job_manifest("eps"))
        before = len(list(kmock))
        await cluster.fail_pod("eps-teacher-math-0")

        async def replaced() -> Any:
            pods = await cluster.pods("eps")
            p = pods.get("eps-teacher-math-0")
            return p is not None and (p.status is None or p.status.phase != "Failed")

        await eventually(replaced, what="teacher pod replaced")
        deletes = [r.url.path for r in list(kmock)[before:] if r.method is method.DELETE]
        assert deletes == [f"/api/v1/namespaces/{NS}/pods/eps-teacher-math-0"]
        st = await job_status(cluster, "eps")
        assert st["restarts"] == 0
        assert await events(kmock, "ServerReplaced")


async def test_environment_pods_run_beside_the_job_and_a_failed_one_is_replaced_alone(
    kmock: Any, cluster: Cluster
) -> None:
    spec = {
        **BASE_SPEC,
        "environments": [{"name": "calc", "command": ["python", "-m", "calc_env", "--port", "$(PORT)"], "port": 9000}],
        "rollout": {**BASE_SPEC["rollout"], "multiTurn": {}},
    }
    async with running_operator(str(kmock.url), resync_seconds=0.3):
        await cluster.create_job(job_manifest("envs", spec))
        want = expected_children("envs", spec)
        assert {("Pod", "envs-env-calc-0"), ("Service", "envs-e-calc")} <= want

        async def made() -> Any:
            return await cluster.children("envs") == want

        await eventually(made, what="children of envs")
        pod = (await cluster.pods("envs"))["envs-env-calc-0"]
        assert pod.spec.containers[0].command == ["python", "-m", "calc_env", "--port", "$(PORT)"]
        cm = await cluster.call(cluster.core.read_namespaced_config_map, "envs-config", NS)
        assert json.loads(cm.data["config.json"])["endpoints"]["environments"] == {
            "calc": [f"http://calc-0.envs-e-calc.{NS}.svc:9000"]
        }
        await cluster.run_all("envs")
        st = await phase_is(cluster, "envs", "Running")
        assert st["roles"]["environment/calc"] == {"desired": 1, "ready": 1, "failed": 0}
        before = len(list(kmock))
        await cluster.fail_pod("envs-env-calc-0")

        async def replaced() -> Any:
            p = (await cluster.pods("envs")).get("envs-env-calc-0")
            return p is not None and (p.status is None or p.status.phase != "Failed")

        await eventually(replaced, what="environment pod replaced")
        deletes = [r.url.path for r in list(kmock)[before:] if r.method is method.DELETE]
        assert deletes == [f"/api/v1/namespaces/{NS}/pods/envs-env-calc-0"]  # the gang is not touched
        assert (await job_status(cluster, "envs"))["restarts"] == 0
        assert await events(kmock, "ServerReplaced")


async def test_suspend_and_resume(kmock: Any, cluster: Cluster) -> None:
    async with running_operator(str(kmock.url), resync_seconds=0.3):
        await cluster.create_job(job_manifest("zeta"))
        await all_children(cluster, "zeta")
        await cluster.patch_job("zeta", {"spec": {"suspend": True}})
        st = await phase_is(cluster, "zeta", "Suspended")
        assert cond(st, "Suspended")["status"] == "True"

        async def no_pods() -> Any:
            return not await cluster.pods("zeta")

        await eventually(no_pods, what="pods deleted")
        children = await cluster.children("zeta")
        assert ("ConfigMap", "zeta-config") in children and ("Service", "zeta-trainer") in children
        await cluster.patch_job("zeta", {"spec": {"suspend": False}})
        await all_children(cluster, "zeta")
        st = await phase_is(cluster, "zeta", "Pending")
        assert cond(st, "Suspended")["status"] == "False"


async def test_completion_deletes_servers_then_ttl_deletes_the_job(kmock: Any, cluster: Cluster) -> None:
    async with running_operator(str(kmock.url), resync_seconds=0.3):
        await cluster.create_job(job_manifest("eta", ttlSecondsAfterFinished=1))
        await all_children(cluster, "eta")
        await cluster.run_all("eta")
        # Rank 1 exits first; rank 0's exit completes the job.
        await cluster.set_pod_status("eta-trainer-1", "Succeeded")
        await cluster.set_pod_status("eta-trainer-0", "Succeeded")
        st = await phase_is(cluster, "eta", "Succeeded")
        assert cond(st, "Succeeded")["reason"] == "TrainerSucceeded" and st["completionTime"]

        async def only_trainers() -> Any:
            return set(await cluster.pods("eta")) == {"eta-trainer-0", "eta-trainer-1"}

        await eventually(only_trainers, what="server pods deleted")

        async def gone() -> Any:
            return await cluster.job("eta") is None

        await eventually(gone, timeout=4, what="the job deleted by its TTL")


async def test_deletion_stops_reconciling(kmock: Any, cluster: Cluster) -> None:
    async with running_operator(str(kmock.url), resync_seconds=0.2) as reconciler:
        # omega stays: its loop shows the operator at work while theta's must stay silent.
        await cluster.create_job(job_manifest("theta"))
        await cluster.create_job(job_manifest("omega"))
        await all_children(cluster, "theta")
        await all_children(cluster, "omega")
        await cluster.delete_job("theta")

        async def gone() -> Any:
            return await cluster.job("theta") is None

        await eventually(gone, what="the job released by the operator")
        # The emulator has no garbage collector: remove a child by hand and check that nobody
        # recreates it (the job's loop has stopped; the real API server's GC owns the rest).
        # A child of omega goes after it: once that one is back, the operator has seen both
        # deletions, and the first would have woken theta's loop had it survived.
        await cluster.delete_pod("theta-rollout-0")
        await cluster.delete_pod("omega-rollout-0")
        await all_children(cluster, "omega")
        await more_passes(reconciler.metrics, 2)
        assert "theta-rollout-0" not in await cluster.pods("theta")
        get = reconciler.metrics.registry.get_sample_value
        assert get("kubedistill_operator_job_restarts", {"namespace": NS, "job": "theta"}) is None
        assert get("kubedistill_operator_jobs", {"phase": "Pending"}) == 1  # omega alone


async def test_reconciling_twice_creates_nothing_twice(kmock: Any, cluster: Cluster) -> None:
    # A child that already exists (e.g. from an earlier operator) is a 409: success, not an error.
    await cluster.call(
        cluster.core.create_namespaced_config_map,
        NS,
        {
            "metadata": {"name": "iota-config", "namespace": NS, "labels": {"kubedistill.io/job": "iota"}},
            "data": {"config.json": "{}"},
        },
    )
    metrics = OperatorMetrics()
    async with running_operator(str(kmock.url), resync_seconds=0.1, metrics=metrics):
        await cluster.create_job(job_manifest("iota"))
        await all_children(cluster, "iota")
        await more_passes(metrics, 3)
        assert await cluster.children("iota") == expected("iota")
        assert metrics.registry.get_sample_value("kubedistill_operator_reconcile_errors_total") == 0
        made = metrics.registry.get_sample_value
        assert made("kubedistill_operator_children_created_total", {"kind": "Pod"}) == 5
        assert made("kubedistill_operator_children_created_total", {"kind": "Service"}) == 3
        assert made("kubedistill_operator_children_created_total", {"kind": "ConfigMap"}) is None


async def test_the_loops_own_writes_wake_it_no_more(kmock: Any, cluster: Cluster) -> None:
    # Every child created comes back as a watch event, and so do the job's finalizer and status
    # patches; none shows the loop anything it did not plan from. One pass creates the children,
    # the next (at once) writes the status; nothing else runs until the resync, far beyond.
    metrics = OperatorMetrics()
    async with running_operator(str(kmock.url), resync_seconds=60.0, metrics=metrics):
        await cluster.create_job(job_manifest("omicron"))
        await all_children(cluster, "omicron")

        async def created() -> Any:
            st = await job_status(cluster, "omicron")
            return st.get("conditions") and cond(st, "Created")["status"] == "True"

        await eventually(created, what="omicron Created")
        await asyncio.sleep(1.0)  # every echo has arrived
        assert reconcile_passes(metrics) == 2
        patched = [r for r in list(kmock) if r.method is method.PATCH and r.url.path.endswith("/omicron/status")]
        assert len(patched) == 1
        # A change the loop has not seen still wakes it.
        await cluster.run_all("omicron")
        await phase_is(cluster, "omicron", "Running")


async def test_a_child_deleted_by_hand_is_recreated(kmock: Any, cluster: Cluster) -> None:
    # A resync far beyond the wait below: only the deletions' watch events can wake the loop.
    async with running_operator(str(kmock.url), resync_seconds=60.0):
        await cluster.create_job(job_manifest("kappa"))
        await all_children(cluster, "kappa")
        await cluster.delete_pod("kappa-rollout-1")
        await cluster.call(cluster.core.delete_namespaced_service, "kappa-t-math", NS)
        await eventually(lambda: _has_all(cluster, "kappa"), timeout=10, what="children recreated")


async def _has_all(cluster: Cluster, job: str) -> bool:
    return await cluster.children(job) == expected(job)


async def test_operator_restart_picks_up_existing_jobs(kmock: Any, cluster: Cluster) -> None:
    async with running_operator(str(kmock.url), resync_seconds=0.3):
        await running_job(cluster, job_manifest("lam"))
    # While no operator runs, a pod fails and another disappears.
    cluster.reconnect()
    await cluster.fail_pod("lam-rollout-0")
    await cluster.delete_pod("lam-teacher-math-0")
    async with running_operator(str(kmock.url), resync_seconds=0.3):

        async def healed() -> Any:
            pods = await cluster.pods("lam")
            return set(pods) == {n for k, n in expected("lam") if k == "Pod"} and all(
                p.status is None or p.status.phase != "Failed" for p in pods.values()
            )

        await eventually(healed, what="the restarted operator healing the job")

        async def restarting() -> Any:
            # The status follows the recreated pods by one pass (it counts them as made).
            st = await job_status(cluster, "lam")
            return st if st["phase"] in ("Pending", "Initializing") else None

        st = await eventually(restarting, what="lam's status after the healing")
        assert st["restarts"] == 0


async def test_spec_that_slipped_past_the_crd_fails_without_crash_loop(kmock: Any, cluster: Cluster) -> None:
    bad = job_manifest("mu", trainer={"replicas": 1, "miniBatchSize": 3}, rollout={"sampling": {"samplesPerPrompt": 2}})
    metrics = OperatorMetrics()
    async with running_operator(str(kmock.url), resync_seconds=0.1, metrics=metrics):
        await cluster.create_job(bad)
        st = await phase_is(cluster, "mu", "Failed")
        failed = cond(st, "Failed")
        assert failed["reason"] == "InvalidSpec" and "spec.trainer.miniBatchSize" in failed["message"]
        await more_passes(metrics, 3)
        assert not await cluster.children("mu")
        assert metrics.registry.get_sample_value("kubedistill_operator_reconcile_errors_total") == 0
        assert len(await events(kmock, "InvalidSpec")) == 1


async def test_a_refused_pod_blocks_the_job_until_the_cause_is_removed(kmock: Any, cluster: Cluster) -> None:
    """A namespace enforcing Pod Security refuses the trainer pods: the job says so in its phase
    and Created condition, retries with backoff, and runs once the refusal stops."""
    tries: list[str] = []
    refusing = {"on": True}

    def pod_security(request: Any) -> Any:
        if request.method is not method.POST or not request.url.path.endswith("/pods"):
            return None
        name = request.data["metadata"]["name"]
        if refusing["on"] and "-trainer-" in name:
            tries.append(name)
            return (
                403,
                f'pods "{name}" is forbidden: violates PodSecurity "restricted:latest": '
                "allowPrivilegeEscalation != false",
            )
        return None

    kmock.refuse = pod_security
    async with running_operator(
        str(kmock.url), resync_seconds=0.3, create_backoff_seconds=0.2, create_backoff_max_seconds=0.4
    ) as reconciler:
        await cluster.create_job(job_manifest("psa"))
        st = await phase_is(cluster, "psa", "Blocked")
        created = cond(st, "Created")
        assert created["status"] == "False" and created["reason"] == "PodSecurity"
        assert st["message"] == created["message"] and "violates PodSecurity" in st["message"]
        assert "creating Pod psa-trainer-" in st["message"] and "(and 1 more refused)" in st["message"]
        assert any("violates PodSecurity" in e["message"] for e in await events(kmock, "Blocked"))
        # Everything else was created meanwhile; the trainer pods are tried again, with backoff.
        assert await eventually(lambda: _count_ge(tries, 6), timeout=5)
        children = await cluster.children("psa")
        assert ("Pod", "psa-rollout-0") in children and not any("trainer" in n for k, n in children if k == "Pod")
        assert (
            reconciler.metrics.registry.get_sample_value("kubedistill_operator_children_refused_total", {"kind": "Pod"})
            >= 6
        )

        refusing["on"] = False
        await all_children(cluster, "psa")
        await cluster.run_all("psa")
        st = await phase_is(cluster, "psa", "Running")
        assert st["message"] == "" and cond(st, "Created")["status"] == "True"


async def _count_ge(items: list[str], n: int) -> bool:
    return len(items) >= n


async def test_a_job_deleted_while_in_error_leaves_no_state_behind(kmock: Any, cluster: Cluster) -> None:
    """The API server fails (500) every ConfigMap create of one job: its loop is in error, and
    remembers the error (one Event per distinct error). Deleting the job drops all it kept."""

    def failing(request: Any) -> Any:
        if request.method is method.POST and request.url.path.endswith("/configmaps"):
            if request.data["metadata"]["name"] == "xi-config":
                return 500, "etcdserver: request timed out"
        return None

    kmock.refuse = failing
    async with running_operator(str(kmock.url), resync_seconds=0.2) as reconciler:
        await cluster.create_job(job_manifest("xi"))
        await cluster.create_job(job_manifest("pi"))

        async def in_error() -> Any:
            state = reconciler.jobs.get((NS, "xi"))
            return state is not None and state.last_error and "etcdserver" in state.last_error

        await eventually(in_error, what="xi's loop in error")
        assert any("etcdserver" in e["message"] for e in await events(kmock, "ReconcileError"))
        await all_children(cluster, "pi")
        await cluster.delete_job("xi")

        async def dropped() -> Any:
            return await cluster.job("xi") is None and set(reconciler.jobs) == {(NS, "pi")}

        await eventually(dropped, what="xi's state dropped, pi's kept")


async def test_deleted_jobs_leave_no_state_after_create_delete_cycles(kmock: Any, cluster: Cluster) -> None:
    async with running_operator(str(kmock.url), resync_seconds=0.2) as reconciler:
        await cluster.create_job(job_manifest("stay"))
        for cycle in range(3):
            names = [f"c{cycle}-{i}" for i in range(3)]
            for name in names:
                await cluster.create_job(job_manifest(name))
            for name in names:
                await all_children(cluster, name)
            assert {(NS, n) for n in names} <= set(reconciler.jobs)
            for name in names:
                await cluster.delete_job(name)

            async def only_stay() -> Any:
                return set(reconciler.jobs) == {(NS, "stay")}

            await eventually(only_stay, what=f"cycle {cycle}: only the remaining job's state")
