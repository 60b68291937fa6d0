"""Each role's replicas, GPUs and overrides (spec.trainer, spec.rollout, spec.teachers[],
spec.environments[]) shape that role's pods and local processes, and no other role's; the
job-wide pod settings reach every pod. The same code serves every role
(kubedistill.api.roleconfig.role_overrides), so each field is shown for the trainer, the rollout
servers, a teacher and an environment alike."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from kubedistill.api.job import DistillationJob
from kubedistill.api.roleconfig import Role
from kubedistill.operator.render import render_children
from kubedistill.runtime.entrypoints.local import local_processes
from operator_fixtures import BASE_SPEC, job_manifest

CACHE = {"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}}
OVERRIDES: dict[str, Any] = {
    "resources": {"requests": {"memory": "3Gi"}, "limits": {"memory": "5Gi"}},
    "env": [
        {"name": "ROLE_ONLY", "value": "yes"},
        {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
    ],
    "nodeSelector": {"pool": "mine"},
    "cpuThreads": 3,
    "volumes": [CACHE],
    "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
}
# The pod and the local process of each role in SPEC (teacher "math", environment "calc").
POD = {
    Role.trainer: "j-trainer-0",
    Role.rollout: "j-rollout-0",
    Role.teacher: "j-teacher-math-0",
    Role.environment: "j-env-calc-0",
}
PROCESS = {
    Role.trainer: "trainer-0",
    Role.rollout: "rollout-0",
    Role.teacher: "teacher-math-0",
    Role.environment: "env-calc-0",
}
SPEC: dict[str, Any] = {
    **copy.deepcopy(BASE_SPEC),
    "environments": [{"name": "calc", "command": ["python", "-m", "calc_env", "--port", "$(PORT)"]}],
    "rollout": {**BASE_SPEC["rollout"], "multiTurn": {}},
}
"""BASE_SPEC with an environment server (multi-turn rollouts)."""


def _job(role: Role, overrides: dict[str, Any]) -> DistillationJob:
    spec = copy.deepcopy(SPEC)
    named = {Role.teacher: spec["teachers"], Role.environment: spec["environments"]}
    target = named[role][0] if role in named else spec[role.value]
    target["overrides"] = overrides
    return DistillationJob.model_validate(job_manifest("j", spec))


def _env(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_a_roles_overrides_reach_its_pods_only(role: Role) -> None:
    job = _job(role, OVERRIDES)
    pods = {o["metadata"]["name"]: o for o in render_children("j", "ml", job.spec) if o["kind"] == "Pod"}
    for other, name in POD.items():
        pod = pods[name]
        c = pod["spec"]["containers"][0]
        env = _env(pod)
        mine = other is role
        assert (c["resources"]["requests"]["memory"] == "3Gi") is mine, name
        assert (c["resources"].get("limits") == {"memory": "5Gi"}) is mine, name
        assert ("ROLE_ONLY" in env and env["ROLE_ONLY"]["value"] == "yes") is mine, name
        assert (env.get("FROM_SECRET", {}).get("valueFrom") == {"secretKeyRef": {"name": "s", "key": "k"}}) is mine
        assert (env.get("OMP_NUM_THREADS", {}).get("value") == "3") is mine, name
        assert (pod["spec"].get("nodeSelector") == {"pool": "mine"}) is mine, name
        assert (CACHE in pod["spec"]["volumes"]) is mine, name
        assert ({"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]) is mine, name


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_a_roles_overrides_reach_its_local_process_only(role: Role, tmp_path: Path) -> None:
    local = {k: v for k, v in OVERRIDES.items() if k in ("env", "cpuThreads")}
    local["env"] = [{"name": "ROLE_ONLY", "value": "yes"}]
    _, procs = local_processes(_job(role, local), tmp_path / "config.json")
    by_name = {p.name: p for p in procs}
    for other, name in PROCESS.items():
        p = by_name[name]
        mine = other is role
        assert (p.env.get("ROLE_ONLY") == "yes") is mine, name
        assert (p.env.get("OMP_NUM_THREADS") == "3") is mine, name
        assert (p.cpus == 3.0) is mine, name


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_a_roles_value_from_is_refused_by_a_local_run(role: Role, tmp_path: Path) -> None:
    secret = {"env": [{"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
    with pytest.raises(ValueError, match="FROM_SECRET: valueFrom .* cannot be resolved by `kubedistill run`"):
        local_processes(_job(role, secret), tmp_path / "config.json")


def test_the_job_wide_pod_settings_reach_every_pod() -> None:
    spec = copy.deepcopy(SPEC)
    spec.update(
        image="registry.example/kd:1",
        imagePullPolicy="Always",
        imagePullSecrets=["pull"],
        tolerations=[{"key": "gpu", "operator": "Exists"}],
        affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        serviceAccountName="kd",
        nodeSelector={"pool": "job"},
        env=[
            {"name": "JOB", "value": "1"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
        volumes=[CACHE],
        volumeMounts=[{"name": "cache", "mountPath": "/cache"}],
    )
    job = DistillationJob.model_validate(job_manifest("j", spec))
    pods = [o for o in render_children("j", "ml", job.spec) if o["kind"] == "Pod"]
    assert {p["metadata"]["name"] for p in pods} >= set(POD.values())
    for pod in pods:
        s, c = pod["spec"], pod["spec"]["containers"][0]
        assert (c["image"], c["imagePullPolicy"]) == ("registry.example/kd:1", "Always")
        assert s["imagePullSecrets"] == [{"name": "pull"}] and s["serviceAccountName"] == "kd"
        assert s["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
        assert s["affinity"] == {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
        assert s["nodeSelector"] == {"pool": "job"}
        env = _env(pod)
        assert env["JOB"]["value"] == "1" and env["TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "s", "key": "k"}}
        assert CACHE in s["volumes"] and {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]


def test_each_roles_replicas_and_gpus_make_its_pods_and_processes(tmp_path: Path) -> None:
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(device="cuda")
    spec["trainer"] = {"replicas": 2, "gpusPerReplica": 2, "miniBatchSize": 4}
    spec["rollout"] = {"replicas": 3, "gpus": 1}
    spec["teachers"] = [{"name": "math", "model": "/m", "replicas": 2, "gpus": 4}]
    job = DistillationJob.model_validate(job_manifest("j", spec))
    pods = {o["metadata"]["name"]: o for o in render_children("j", "ml", job.spec) if o["kind"] == "Pod"}
    gpus = {n: p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for n, p in pods.items()}
    assert gpus == {
        "j-trainer-0": "2", "j-trainer-1": "2",
        "j-rollout-0": "1", "j-rollout-1": "1", "j-rollout-2": "1",
        "j-teacher-math-0": "4", "j-teacher-math-1": "4",
    }  # fmt: skip
    config, procs = local_processes(job, tmp_path / "config.json")
    # Locally every trainer rank is its own process on one GPU: 2 pods x 2 GPUs = 4 ranks.
    assert sorted((p.name, p.gpus) for p in procs) == [
        ("rollout-0", 1), ("rollout-1", 1), ("rollout-2", 1),
        ("teacher-math-0", 4), ("teacher-math-1", 4),
        ("trainer-0", 1), ("trainer-1", 1), ("trainer-2", 1), ("trainer-3", 1),
    ]  # fmt: skip
    assert len(config.endpoints.rollout) == 3 and len(config.endpoints.teachers["math"]) == 2


def test_sigterm_ends_a_role_that_is_pid_1_as_it_ends_any_other_process(tmp_path: Path) -> None:
    """In a container the role is PID 1, where the kernel drops a signal left at its default:
    `kubectl delete pod` of a trainer would have trained on for the grace period (found on a real
    kubelet, tests/test_real_node.py). Here the role's own setup runs as PID 1 of a new PID
    namespace (unshare, as root: CI runs as root), and SIGTERM ends it at once, with 143."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from kubedistill.runtime.entrypoints.roles import terminate_as_pid1

    assert terminate_as_pid1(pid=4242) is False  # not PID 1: the default already terminates
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("needs root and unshare (a new PID namespace): CI runs as root", pytrace=False)
    ready = tmp_path / "ready"
    code = (
        "import sys, time, pathlib; from kubedistill.runtime.entrypoints.roles import terminate_as_pid1; "
        f"assert terminate_as_pid1(); pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    )
    for install in (False, True):
        body = code if install else code.replace("assert terminate_as_pid1(); ", "")
        proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", body])
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        ready.unlink()
        inner = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(inner[0]), signal.SIGTERM)
        try:
            code_ = proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            code_ = None
            proc.kill()
            proc.wait()
        # Without the handler PID 1 ignores SIGTERM; with it, the role ends as a signal would.
        assert code_ == (143 if install else None), (install, code_)
