"""The operator as the Helm chart deploys it, on a real Kubernetes control plane.

One chart install (release RELEASE in RELEASE_NS) and one `kubedistill operator` process per
module, authenticated only by the chart ServiceAccount's token (tests/real_cluster.py). There is no
kubelet: pods are admitted and stored, never run, so the tests play the kubelet by patching pod
status as the admin. What the KMock tests (test_operator_kmock.py) cannot show is what this tier
is for: the chart's RBAC, the API server's own admission answers (Pod Security, ResourceQuota,
LimitRange), the garbage collector, and token authentication.

The job pods carry a nodeSelector no node has: the control plane is shared by the session, and a
pod bound to a node some other module registered would never finish a graceful deletion here.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import re
import ssl
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.config import ConfigException, incluster_config, kube_config

from control_plane import CONTROLLERS, ControlPlane
from kubedistill.api.job import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.operator.handlers import FINALIZER
from kubedistill.operator.kube import Kube, KubeConfig, KubeError
from kubedistill.operator.render import LABEL_ATTEMPT, LABEL_JOB, render_children, render_pods
from real_cluster import install_chart, operator_process, service_account, wait_for

RELEASE = "kd-op"
"""Not real_cluster.RELEASE: the chart's cluster-scoped objects are named by the release, and
another module may install the chart in the same control plane."""
RELEASE_NS = "op-system"
LIFE_NS = "op-life"
PSA_NS = "op-psa"
QUOTA_NS = "op-quota"
CPU_QUOTA_NS = "op-quota-cpu"
PRIORITY_NS = "op-priority"
OPERATED = [LIFE_NS, PSA_NS, QUOTA_NS, CPU_QUOTA_NS, PRIORITY_NS]
AUTH_NS = "op-auth"
"""Watched by the chart (the ServiceAccount has its Role there) but not by the operator process:
the in-process Kube tests act as the operator there, and a running one would rewrite the status
they patch."""

DJ = f"{PLURAL}.{GROUP}"
"""The jobs' resource as kubectl names it."""
PSA_ENFORCE = "pod-security.kubernetes.io/enforce"
WAIT = 20.0
"""Longest wait for the operator to act; a refused child's backoff (2 s, 4 s, 8 s) fits in it."""
GC_WAIT = 60.0
"""Longest wait for the garbage collector, which learns of the CRD up to ~45 s after its install."""

SPEC: dict[str, Any] = {
    "device": "cpu",
    "student": {"model": "/models/student"},
    "teachers": [{"name": "math", "model": "/models/teacher", "replicas": 1}],
    "rollout": {"replicas": 1},
    "trainer": {"replicas": 2, "miniBatchSize": 4},
    "data": {"train": ["/data/train.jsonl"]},
    "backoffLimit": 1,
    "nodeSelector": {"kubedistill.io/test-node": "none"},
}

JsonDict = dict[str, Any]
CHILD_PATHS = {
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "Service": "/api/v1/namespaces/{ns}/services",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
}
"""Where the kinds of child the operator makes are listed."""


class ApiError(Exception):
    def __init__(self, status: int, body: JsonDict):
        super().__init__(f"HTTP {status}: {body.get('message', body)}")
        self.status = status
        self.message = str(body.get("message", ""))


@dataclasses.dataclass
class Cluster:
    """The control plane with the chart installed and the operator running, seen as the admin."""

    plane: ControlPlane
    operator: subprocess.Popen[bytes]
    log: Path
    sa_user: str
    """The operator's identity: system:serviceaccount:<release namespace>:<chart SA>."""
    sa_kubeconfig: Path

    def call(
        self, method: str, path: str, body: JsonDict | None = None, content_type: str = "", token: str = ""
    ) -> JsonDict:
        """One REST call as the admin (its static token) or as `token`: the answer, or ApiError
        with the server's Status."""
        headers = {"Authorization": f"Bearer {token or self.plane.admin_token}", "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
            data = json.dumps(body).encode()
        request = urllib.request.Request(self.plane.server + path, data=data, headers=headers, method=method)
        ctx = ssl.create_default_context(cafile=str(self.plane.ca_file))
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=10) as resp:
                answer: JsonDict = json.loads(resp.read())
                return answer
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, json.loads(exc.read() or b"{}")) from None

    def items(self, path: str, **query: str) -> list[JsonDict]:
        return list(self.call("GET", f"{path}?{urllib.parse.urlencode(query)}")["items"])

    def wait(self, check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
        """wait_for, failing at once with the operator's log if the operator has exited."""

        def alive_check() -> Any:
            if self.operator.poll() is not None:
                raise AssertionError(f"the operator exited ({self.operator.returncode}):\n{self.log_tail()}")
            return check()

        try:
            return wait_for(alive_check, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\noperator log ends:\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    # -- jobs ------------------------------------------------------------------------------
    def create_job(self, namespace: str, name: str, **overrides: Any) -> JsonDict:
        """`kubectl apply` of a small job; the job as stored (defaults filled in)."""
        spec = copy.deepcopy(SPEC)
        spec.update(overrides)
        manifest = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace}}
        self.plane.apply({**manifest, "spec": spec})
        job = self.job(namespace, name)
        assert job is not None
        return job

    def job(self, namespace: str, name: str) -> JsonDict | None:
        try:
            return self.call("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def status(self, namespace: str, name: str) -> JsonDict:
        return dict((self.job(namespace, name) or {}).get("status") or {})

    def phase_is(self, namespace: str, name: str, phase: str, timeout: float = WAIT) -> JsonDict:
        def check() -> JsonDict | None:
            st = self.status(namespace, name)
            return st if st.get("phase") == phase else None

        return dict(self.wait(check, f"{namespace}/{name} phase {phase} (now {self.status(namespace, name)})", timeout))

    def patch_job(self, namespace: str, name: str, patch: JsonDict) -> None:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
        self.call("PATCH", path, patch, "application/merge-patch+json")

    def events(self, namespace: str, name: str, reason: str) -> list[JsonDict]:
        """The Events about a job with `reason` (kopf posts them from a queue: poll for them)."""
        selector = f"involvedObject.kind={KIND},involvedObject.name={name},reason={reason}"
        return self.items(f"/api/v1/namespaces/{namespace}/events", fieldSelector=selector)

    def event(self, namespace: str, name: str, reason: str) -> JsonDict:
        found = self.wait(lambda: self.events(namespace, name, reason), f"a {reason} event about {namespace}/{name}")
        return dict(found[0])

    # -- children ----------------------------------------------------------------------------
    def pods(self, namespace: str, job: str) -> dict[str, JsonDict]:
        found = self.items(CHILD_PATHS["Pod"].format(ns=namespace), labelSelector=f"{LABEL_JOB}={job}")
        return {p["metadata"]["name"]: p for p in found}

    def children(self, namespace: str, job: str) -> dict[tuple[str, str], JsonDict]:
        """Every object labelled as the job's child, by (kind, name): the kinds the operator makes."""
        return {
            (kind, o["metadata"]["name"]): o
            for kind, path in CHILD_PATHS.items()
            for o in self.items(path.format(ns=namespace), labelSelector=f"{LABEL_JOB}={job}")
        }

    def all_children(self, namespace: str, job: JsonDict) -> dict[tuple[str, str], JsonDict]:
        """Wait until the job's children are exactly those its stored spec renders."""
        want = expected_children(job)
        name = job["metadata"]["name"]
        return dict(
            self.wait(
                lambda: (found := self.children(namespace, name)) and set(found) == want and found,
                f"the children of {namespace}/{name}: {sorted(want)}",
            )
        )

    def set_pod_status(self, namespace: str, name: str, phase: str, ready: bool = False, **extra: Any) -> None:
        """What a kubelet would report, written through pods/status as the admin."""
        status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}], **extra}
        path = f"{CHILD_PATHS['Pod'].format(ns=namespace)}/{name}/status"
        self.call("PATCH", path, {"status": status}, "application/merge-patch+json")

    def run_pods(self, namespace: str, names: list[str]) -> None:
        for name in names:
            self.set_pod_status(namespace, name, "Running", ready=True)

    def fail_pod(self, namespace: str, name: str, exit_code: int, reason: str = "Error") -> None:
        terminated = {"exitCode": exit_code, "reason": reason}
        container = {"name": "kubedistill", "image": "kubedistill", "imageID": "", "ready": False, "restartCount": 0}
        self.set_pod_status(
            namespace, name, "Failed", containerStatuses=[{**container, "state": {"terminated": terminated}}]
        )

    def server_refusal(self, namespace: str, pod: JsonDict) -> str:
        """The API server's own message refusing `pod` now (a dry-run create as the admin)."""
        try:
            self.call("POST", f"{CHILD_PATHS['Pod'].format(ns=namespace)}?dryRun=All", pod)
        except ApiError as exc:
            assert exc.status == 403, exc
            return exc.message
        raise AssertionError(f"the server admits pod {pod['metadata']['name']} in {namespace}")

    def can_i(self, verb: str, resource: str, namespace: str | None = None) -> bool:
        """`kubectl auth can-i` as the operator's ServiceAccount (its token kubeconfig); a
        `resource/sub` names a subresource (kubectl would read it as resource/name)."""
        where = ["-n", namespace] if namespace else ["--all-namespaces"]
        resource, _, sub = resource.partition("/")
        if sub:
            where.append(f"--subresource={sub}")
        r = self.plane.kubectl("auth", "can-i", verb, resource, *where, kubeconfig=self.sa_kubeconfig, check=False)
        assert r.stdout.strip() in ("yes", "no"), r
        return r.stdout.strip() == "yes"


def parsed_spec(job: JsonDict) -> DistillationJobSpec:
    return DistillationJobSpec.model_validate(job["spec"])


def expected_children(job: JsonDict) -> set[tuple[str, str]]:
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    return {(o["kind"], o["metadata"]["name"]) for o in render_children(name, namespace, parsed_spec(job))}


def condition(status: JsonDict, kind: str) -> JsonDict:
    return next(c for c in status.get("conditions") or [] if c["type"] == kind)


def uids(pods: dict[str, JsonDict]) -> dict[str, str]:
    return {name: p["metadata"]["uid"] for name, p in pods.items()}


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    plane = control_plane
    plane.needs(CONTROLLERS, why="the garbage collector and quota accounting")
    home = tmp_path_factory.mktemp("k8s-operator")
    docs = install_chart(plane, RELEASE_NS, [*OPERATED, AUTH_NS], release=RELEASE)
    sa = service_account(docs)
    sa_kubeconfig = plane.token_kubeconfig(home / "operator.kubeconfig", token=plane.token(RELEASE_NS, sa))
    log = home / "operator.log"
    try:
        with operator_process(sa_kubeconfig, OPERATED, log) as proc:
            yield Cluster(plane, proc, log, f"system:serviceaccount:{RELEASE_NS}:{sa}", sa_kubeconfig)
            # While the operator runs: it removes its finalizer from the jobs it watches.
            for ns in [*OPERATED, AUTH_NS]:
                plane.kubectl("delete", DJ, "--all", "-n", ns, "--timeout=30s", check=False)
    finally:
        for ns in [*OPERATED, AUTH_NS, RELEASE_NS]:
            plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        for kind in ("clusterrolebinding", "clusterrole"):
            plane.kubectl("delete", kind, "-l", f"app.kubernetes.io/instance={RELEASE}", check=False)


# --- identity and least privilege ----------------------------------------------------------


def test_the_operator_runs_as_the_chart_service_account_with_least_privilege(cluster: Cluster) -> None:
    kubeconfig = yaml.safe_load(cluster.sa_kubeconfig.read_text())
    (user,) = kubeconfig["users"]
    assert set(user["user"]) == {"token"}, "the operator's kubeconfig must hold the token alone"
    whoami = cluster.plane.kubectl(
        "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}", kubeconfig=cluster.sa_kubeconfig
    )
    assert whoami.stdout.strip() == cluster.sa_user
    # What the operator needs, in a namespace it watches.
    for verb, resource in [
        ("watch", DJ),
        ("patch", f"{DJ}/status"),
        # Its children's ownerReferences set blockOwnerDeletion: OwnerReferencesPermissionEnforcement
        # admits that only with update on the owner's finalizers.
        ("update", f"{DJ}/finalizers"),
        ("create", "pods"),
        ("delete", "pods"),
        ("patch", "configmaps"),
        ("create", "networkpolicies.networking.k8s.io"),
        ("create", "persistentvolumeclaims"),
        ("create", "events"),
    ]:
        assert cluster.can_i(verb, resource, LIFE_NS), (verb, resource)
    # Nothing more: no secrets, nothing in namespaces it does not watch, nothing cluster-wide.
    for verb, resource, ns in [
        ("get", "secrets", LIFE_NS),
        ("list", "secrets", None),
        ("create", "pods", "default"),
        ("create", "pods", RELEASE_NS),
        ("list", "pods", None),
        ("patch", DJ, "default"),
        ("delete", "namespaces", None),
        ("update", "pods/status", LIFE_NS),
        ("create", "pods/exec", LIFE_NS),
        ("update", "nodes", None),
    ]:
        assert not cluster.can_i(verb, resource, ns), (verb, resource, ns)


# --- the job's life ------------------------------------------------------------------------


def test_lifecycle_create_run_succeed_and_clean_up_the_servers(cluster: Cluster) -> None:
    job = cluster.create_job(LIFE_NS, "life")
    children = cluster.all_children(LIFE_NS, job)
    for (kind, name), obj in children.items():
        owners = obj["metadata"].get("ownerReferences") or []
        # The checkpoint claim outlives the job (checkpoint.claim.whenDeleted Retain, the default).
        owner = [] if kind == "PersistentVolumeClaim" else [(KIND, "life", job["metadata"]["uid"], True)]
        assert [(o["kind"], o["name"], o["uid"], o.get("controller")) for o in owners] == owner, (kind, name)
    st = cluster.phase_is(LIFE_NS, "life", "Pending")
    assert condition(st, "Created")["status"] == "True" and st["startTime"]
    assert FINALIZER in (cluster.job(LIFE_NS, "life") or {})["metadata"]["finalizers"]

    pods = sorted(n for kind, n in children if kind == "Pod")
    cluster.run_pods(LIFE_NS, pods)
    st = cluster.phase_is(LIFE_NS, "life", "Running")
    assert condition(st, "Ready")["status"] == "True"
    assert st["ready"] == {"trainer": "2/2", "rollout": "1/1", "teachers": "1/1"}

    # Rank 1 exits first: the job is finishing, still Running; only rank 0's exit completes it.
    cluster.set_pod_status(LIFE_NS, "life-trainer-1", "Succeeded")
    st = cluster.wait(
        lambda: (st := cluster.status(LIFE_NS, "life"))["ready"]["trainer"] == "1/2" and st, "trainer 1/2 ready"
    )
    assert st["phase"] == "Running"
    cluster.set_pod_status(LIFE_NS, "life-trainer-0", "Succeeded")
    st = cluster.phase_is(LIFE_NS, "life", "Succeeded")
    assert condition(st, "Succeeded")["reason"] == "TrainerSucceeded" and st["completionTime"]
    # The servers still running are deleted; the finished trainer pods stay for their logs, and
    # the Services, ConfigMap and NetworkPolicy stay with the job.
    trainers = {"life-trainer-0", "life-trainer-1"}
    cluster.wait(lambda: set(cluster.pods(LIFE_NS, "life")) == trainers, "only the trainer pods left")
    assert set(cluster.children(LIFE_NS, "life")) == {(k, n) for k, n in children if k != "Pod" or n in trainers}
    assert cluster.event(LIFE_NS, "life", "TrainerSucceeded")["type"] == "Normal"
    assert cluster.event(LIFE_NS, "life", "Running")["type"] == "Normal"
    assert not [e["message"] for e in cluster.events(LIFE_NS, "life", "Pending") if "Running ->" in e["message"]]


def test_suspend_deletes_the_pods_and_resume_recreates_them(cluster: Cluster) -> None:
    job = cluster.create_job(LIFE_NS, "nap")
    children = cluster.all_children(LIFE_NS, job)
    before = uids(cluster.pods(LIFE_NS, "nap"))
    cluster.patch_job(LIFE_NS, "nap", {"spec": {"suspend": True}})
    st = cluster.phase_is(LIFE_NS, "nap", "Suspended")
    assert condition(st, "Suspended")["status"] == "True"
    cluster.wait(lambda: not cluster.pods(LIFE_NS, "nap"), "the pods deleted")
    assert set(cluster.children(LIFE_NS, "nap")) == {(k, n) for k, n in children if k != "Pod"}

    cluster.patch_job(LIFE_NS, "nap", {"spec": {"suspend": False}})
    cluster.all_children(LIFE_NS, job)
    after = uids(cluster.pods(LIFE_NS, "nap"))
    assert set(after) == set(before) and not set(after.values()) & set(before.values()), "new pods, same names"
    st = cluster.phase_is(LIFE_NS, "nap", "Pending")
    assert condition(st, "Suspended")["status"] == "False"


def test_a_failed_trainer_restarts_the_gang_until_the_backoff_limit(cluster: Cluster) -> None:
    job = cluster.create_job(LIFE_NS, "gang")
    limit = parsed_spec(job).backoff_limit
    assert limit == 1
    cluster.all_children(LIFE_NS, job)
    first = cluster.pods(LIFE_NS, "gang")
    cluster.run_pods(LIFE_NS, sorted(first))
    cluster.phase_is(LIFE_NS, "gang", "Running")

    cluster.fail_pod(LIFE_NS, "gang-trainer-1", exit_code=3)
    trainers = {"gang-trainer-0", "gang-trainer-1"}

    def second_gang() -> dict[str, JsonDict] | None:
        pods = cluster.pods(LIFE_NS, "gang")
        new = {n: p for n, p in pods.items() if n in trainers and p["metadata"]["uid"] != first[n]["metadata"]["uid"]}
        ok = set(new) == trainers and all(p["metadata"]["labels"][LABEL_ATTEMPT] == "1" for p in new.values())
        return pods if ok else None

    pods = cluster.wait(second_gang, "both trainer pods replaced with attempt 1")
    # Only the gang: the servers are the same pods.
    assert {n: uid for n, uid in uids(pods).items() if n not in trainers} == {
        n: uid for n, uid in uids(first).items() if n not in trainers
    }
    st = cluster.status(LIFE_NS, "gang")
    assert st["restarts"] == 1 and st["phase"] in ("Restarting", "Pending")
    restart = cluster.event(LIFE_NS, "gang", "GangRestart")
    assert restart["type"] == "Warning"
    assert "gang-trainer-1 failed (Error, exit code 3)" in restart["message"] and f"(1/{limit})" in restart["message"]

    cluster.run_pods(LIFE_NS, sorted(trainers))
    assert cluster.phase_is(LIFE_NS, "gang", "Running")["restarts"] == 1
    # The second failure exhausts backoffLimit 1: the job fails, what still runs is deleted.
    cluster.fail_pod(LIFE_NS, "gang-trainer-0", exit_code=7, reason="OOMKilled")
    st = cluster.phase_is(LIFE_NS, "gang", "Failed")
    failed = condition(st, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "BackoffLimitExceeded"
    assert "OOMKilled, exit code 7" in failed["message"] and f"backoffLimit {limit}" in failed["message"]
    assert st["restarts"] == 1 and st["completionTime"]
    cluster.wait(lambda: set(cluster.pods(LIFE_NS, "gang")) == {"gang-trainer-0"}, "only the failed pod kept")


# --- refusals from real admission ------------------------------------------------------------


def assert_blocked_by_the_server(cluster: Cluster, namespace: str, job: JsonDict, reason: str) -> str:
    """The job is Blocked, and its Created condition, status.message and Blocked event carry the
    API server's own message for a pod it refused; that message."""
    name = job["metadata"]["name"]
    st = cluster.phase_is(namespace, name, "Blocked")
    created = condition(st, "Created")
    assert created["status"] == "False" and created["reason"] == reason, created
    found = re.match(r"creating Pod (\S+) was refused: ", st["message"])
    assert found, st["message"]
    (pod,) = [p for p in render_pods(name, namespace, parsed_spec(job)) if p["metadata"]["name"] == found[1]]
    server = cluster.server_refusal(namespace, pod)
    assert st["message"].startswith(f"{found[0]}{server}"), (st["message"], server)
    assert created["message"] == st["message"]
    assert server in cluster.event(namespace, name, "Blocked")["message"]
    return server


def assert_recovered(cluster: Cluster, namespace: str, job: JsonDict) -> dict[tuple[str, str], JsonDict]:
    children = cluster.all_children(namespace, job)
    st = cluster.phase_is(namespace, job["metadata"]["name"], "Pending")
    assert st["message"] == "" and condition(st, "Created")["status"] == "True"
    return children


def test_pod_security_restricted_blocks_a_relaxed_job_until_the_namespace_allows_it(cluster: Cluster) -> None:
    cluster.plane.kubectl("label", "namespace", PSA_NS, f"{PSA_ENFORCE}=restricted", "--overwrite")
    # Root is what "restricted" refuses and "baseline" allows.
    job = cluster.create_job(PSA_NS, "psa", securityContext={"runAsNonRoot": False, "runAsUser": 0})
    server = assert_blocked_by_the_server(cluster, PSA_NS, job, "PodSecurity")
    assert 'violates PodSecurity "restricted' in server
    # The rest of the job was created meanwhile.
    assert {k for k, _ in cluster.children(PSA_NS, "psa")} == {
        "Service",
        "ConfigMap",
        "NetworkPolicy",
        "PersistentVolumeClaim",
    }

    cluster.plane.kubectl("label", "namespace", PSA_NS, f"{PSA_ENFORCE}=baseline", "--overwrite")
    pods = assert_recovered(cluster, PSA_NS, job)
    assert all(p["spec"]["securityContext"]["runAsUser"] == 0 for (k, _), p in pods.items() if k == "Pod")


def wait_quota(cluster: Cluster, namespace: str, name: str, hard: dict[str, str]) -> None:
    """Quota admission reads status.hard, which kube-controller-manager copies from spec.hard."""

    def current() -> bool:
        q = cluster.call("GET", f"/api/v1/namespaces/{namespace}/resourcequotas/{name}")
        return bool((q.get("status") or {}).get("hard") == hard)

    cluster.wait(current, f"quota {namespace}/{name} status.hard {hard}")


def test_a_pod_quota_blocks_the_job_until_it_is_raised(cluster: Cluster) -> None:
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "pods", "namespace": QUOTA_NS}}
    cluster.plane.apply({**quota, "spec": {"hard": {"pods": "2"}}})
    wait_quota(cluster, QUOTA_NS, "pods", {"pods": "2"})
    job = cluster.create_job(QUOTA_NS, "quota")
    assert len(render_pods("quota", QUOTA_NS, parsed_spec(job))) > 2
    server = assert_blocked_by_the_server(cluster, QUOTA_NS, job, "QuotaExceeded")
    assert "exceeded quota: pods" in server
    assert len(cluster.pods(QUOTA_NS, "quota")) == 2

    cluster.plane.apply({**quota, "spec": {"hard": {"pods": "10"}}})
    wait_quota(cluster, QUOTA_NS, "pods", {"pods": "10"})
    assert_recovered(cluster, QUOTA_NS, job)


def test_a_cpu_quota_below_the_jobs_requests_blocks_it_until_it_is_raised(cluster: Cluster) -> None:
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "cpu", "namespace": CPU_QUOTA_NS}}
    cluster.plane.apply({**quota, "spec": {"hard": {"requests.cpu": "400m"}}})
    wait_quota(cluster, CPU_QUOTA_NS, "cpu", {"requests.cpu": "400m"})
    job = cluster.create_job(CPU_QUOTA_NS, "cpu")
    # Every pod requests CPU by default (operator/requests.py: 250m on device cpu), so the quota
    # counts them as they come, with no LimitRange, and refuses the second.
    server = assert_blocked_by_the_server(cluster, CPU_QUOTA_NS, job, "QuotaExceeded")
    assert "exceeded quota: cpu" in server
    assert len(cluster.pods(CPU_QUOTA_NS, "cpu")) == 1

    cluster.plane.apply({**quota, "spec": {"hard": {"requests.cpu": "100"}}})
    wait_quota(cluster, CPU_QUOTA_NS, "cpu", {"requests.cpu": "100"})
    children = assert_recovered(cluster, CPU_QUOTA_NS, job)
    pods = [p for (kind, _), p in children.items() if kind == "Pod"]
    assert pods and all(
        p["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "250m", "memory": "2Gi"} for p in pods
    )


def test_a_missing_priority_class_blocks_the_job_until_it_is_created(cluster: Cluster) -> None:
    job = cluster.create_job(PRIORITY_NS, "prio", scheduling={"priorityClassName": "kd-test-training"})
    server = assert_blocked_by_the_server(cluster, PRIORITY_NS, job, "PriorityClassNotFound")
    assert "no PriorityClass with name kd-test-training was found" in server

    cluster.plane.apply(
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": "kd-test-training"},
            "value": 1000,
        }
    )
    pods = [p for (kind, _), p in assert_recovered(cluster, PRIORITY_NS, job).items() if kind == "Pod"]
    assert pods and all(p["spec"]["priority"] == 1000 for p in pods)


# --- the in-cluster login ------------------------------------------------------------------


@dataclasses.dataclass
class BoundToken:
    token: str
    secret: str
    """The Secret the token is bound to: deleting it revokes the token."""


@pytest.fixture(scope="module")
def bound_token(cluster: Cluster) -> BoundToken:
    """A token of the chart's ServiceAccount bound to a Secret, as a kubelet projects one."""
    secret = "op-token-holder"
    cluster.plane.kubectl("create", "secret", "generic", secret, "-n", RELEASE_NS)
    sa = cluster.sa_user.rsplit(":", 1)[1]
    return BoundToken(cluster.plane.token(RELEASE_NS, sa, bound_secret=secret), secret)


@pytest.fixture
def token_file(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Where the in-cluster loader reads its token (the test writes it), as in a pod: CA file,
    KUBERNETES_SERVICE_HOST/PORT at the API server."""
    path = tmp_path / "token"
    ca = tmp_path / "ca.crt"
    ca.write_bytes(cluster.plane.ca_file.read_bytes())
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(path))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(cluster.plane.port))
    return path


def config_map(name: str, namespace: str = AUTH_NS) -> JsonDict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace}}


def token_refused(cluster: Cluster, token: str) -> bool:
    """Whether the API server refuses `token` (401) on a request its RBAC would allow."""
    try:
        cluster.call("GET", f"/api/v1/namespaces/{AUTH_NS}/configmaps", token=token)
    except ApiError as exc:
        if exc.status == 401:
            return True
        raise
    return False


async def test_the_in_cluster_login_makes_the_calls_the_chart_role_allows(
    cluster: Cluster, bound_token: BoundToken, token_file: Path
) -> None:
    token_file.write_text(bound_token.token)
    cluster.create_job(AUTH_NS, "auth")
    cfg = KubeConfig.load()
    assert cfg.server == cluster.plane.server
    assert cfg.headers()["Authorization"].split()[-1] == bound_token.token
    kube = Kube(cfg)
    try:
        assert await kube.create(config_map("auth-made")) is True
        assert await kube.create(config_map("auth-made")) is False  # exists: 409 is success
        await kube.patch_status(AUTH_NS, "auth", {"message": "written with the in-cluster token"})
        assert cluster.status(AUTH_NS, "auth")["message"] == "written with the in-cluster token"
        assert await kube.delete("ConfigMap", AUTH_NS, "auth-made") is True
        # Outside the Role the same identity is refused by RBAC, by name.
        with pytest.raises(KubeError) as refused:
            await kube.create(config_map("auth-made", RELEASE_NS))
        assert refused.value.status == 403 and cluster.sa_user in refused.value.detail
    finally:
        await kube.close()


async def test_without_the_service_account_token_the_same_calls_are_refused(
    cluster: Cluster, token_file: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # No token file and no kubeconfig: loading fails, rather than going on as anonymous.
    nowhere = str(tmp_path / "no-kubeconfig")
    monkeypatch.setenv("KUBECONFIG", nowhere)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", nowhere)
    with pytest.raises(ConfigException):
        KubeConfig.load()
    # Another identity of the namespace, with no Role: authenticated, then refused by RBAC.
    token_file.write_text(cluster.plane.token(AUTH_NS, "default"))
    kube = Kube(KubeConfig.load())
    try:
        with pytest.raises(KubeError) as other:
            await kube.create(config_map("not-made"))
        assert other.value.status == 403 and f"system:serviceaccount:{AUTH_NS}:default" in other.value.detail
        # No credential at all, what a missing token would amount to: anonymous.
        kube.config = dataclasses.replace(kube.config, headers=lambda: {}, reload=None)
        await kube.close()
        with pytest.raises(KubeError) as anonymous:
            await kube.create(config_map("not-made"))
        assert anonymous.value.status == 403 and "system:anonymous" in anonymous.value.detail
    finally:
        await kube.close()
    # A token the server does not know: 401, also after loading the file again.
    token_file.write_text("not-a-token")
    kube = Kube(KubeConfig.load())
    try:
        with pytest.raises(KubeError) as unknown:
            await kube.create(config_map("not-made"))
        assert unknown.value.status == 401
    finally:
        await kube.close()
    assert cluster.items(f"/api/v1/namespaces/{AUTH_NS}/configmaps", fieldSelector="metadata.name=not-made") == []


# --- deletion, and what the operator's log says after everything above ---------------------


def test_kubectl_delete_removes_every_child_through_the_garbage_collector(cluster: Cluster) -> None:
    job = cluster.create_job(LIFE_NS, "gone")
    children = cluster.all_children(LIFE_NS, job)
    kept = {("PersistentVolumeClaim", "gone-checkpoint")}  # checkpoint.claim.whenDeleted Retain, the default
    assert kept <= set(children)
    assert FINALIZER in (cluster.job(LIFE_NS, "gone") or {})["metadata"]["finalizers"]
    # kubectl waits until the job is gone: the operator must have released its finalizer.
    cluster.plane.kubectl("delete", DJ, "gone", "-n", LIFE_NS, "--timeout=30s")
    assert cluster.job(LIFE_NS, "gone") is None
    # The operator never deletes a Service, ConfigMap or NetworkPolicy: they go by their owner
    # reference, through kube-controller-manager's garbage collector. That one sees a new CRD's
    # objects only from its next discovery pass (every 30 s; measured 41 s after the chart's
    # install): hence this test's place near the end of the module, and its longer wait.
    cluster.wait(
        lambda: set(cluster.children(LIFE_NS, "gone")) == kept,
        f"{len(children) - 1} children garbage-collected, the checkpoint claim kept",
        GC_WAIT,
    )


def test_the_operator_log_shows_no_refused_api_call(cluster: Cluster) -> None:
    """After the scenarios above: the chart's RBAC covered every call the operator made. The
    admission refusals are the job's business (its status and events), never a call refused to
    the operator itself."""
    # A job of its own, created, seen through and deleted, so that the log holds every kind of call
    # the operator makes also when this test runs alone.
    job = cluster.create_job(LIFE_NS, "audit")
    cluster.all_children(LIFE_NS, job)
    cluster.phase_is(LIFE_NS, "audit", "Pending")
    cluster.plane.kubectl("delete", DJ, "audit", "-n", LIFE_NS, "--timeout=30s")
    assert cluster.operator.poll() is None
    text = cluster.log.read_text(errors="replace")
    assert "Daemon 'build_registry.<locals>.job' succeeded" in text, "the operator logged no job"
    # Lines are "<date> <time,ms> LEVEL logger: message": the milliseconds may read 401 or 403.
    messages = [line.split(": ", 1)[-1] for line in text.splitlines()]
    refused = [m for m in messages if re.search(r"\b(401|403)\b|forbidden|unauthori[sz]ed", m, re.IGNORECASE)]
    assert not refused, "\n".join(refused[:20])
    errors = [
        e["message"]
        for ns in OPERATED
        for e in cluster.items(f"/api/v1/namespaces/{ns}/events", fieldSelector="reason=ReconcileError")
    ]
    assert not errors, errors


async def test_a_revoked_token_is_replaced_by_the_rotated_file(
    cluster: Cluster, bound_token: BoundToken, token_file: Path
) -> None:
    """Last in the module on purpose: the API server caches a token's successful authentication
    for 10 s, and the first in-cluster test used this one long enough ago."""
    token_file.write_text(bound_token.token)
    kube = Kube(KubeConfig.load())
    loaded = kube.config
    try:
        # The kubelet rotates the file; the old token dies with the Secret it was bound to.
        sa = cluster.sa_user.rsplit(":", 1)[1]
        rotated = cluster.plane.token(RELEASE_NS, sa)
        token_file.write_text(rotated)
        cluster.plane.kubectl("delete", "secret", bound_token.secret, "-n", RELEASE_NS)
        await asyncio.to_thread(
            cluster.wait, lambda: token_refused(cluster, bound_token.token), "the old token revoked"
        )
        # The loaded config still sends the old token: 401, the credentials are loaded again.
        assert loaded.headers()["Authorization"].split()[-1] == bound_token.token
        assert await kube.create(config_map("after-rotation")) is True
        assert kube.config is not loaded
        assert kube.config.headers()["Authorization"].split()[-1] == rotated
    finally:
        await kube.close()
