"""Kubernetes end to end: a DistillationJob manifest applied to a real API server (the session's
control plane, tests/control_plane.py), the real operator (`kubedistill operator`, a process
logged in by a kubeconfig) reconciling it, the real kube-scheduler binding its pods to the Node
the node-agent twin registers (tests/node_agent.py), and the twin running every pod as real
processes from the pod specs alone: own network namespace and address, cluster DNS names,
volumes (the models on a hostPath, the checkpoints on the PersistentVolumeClaim the operator
provisions for a job with the default checkpoint settings, bound to a static PersistentVolume: the
cluster has no dynamic provisioner; the ServiceAccount's projected token), env with fieldRefs, non-root user,
read-only root, readiness probes, graceful deletion finished by the twin as a kubelet does.

One job lives through every scenario, in order, so that the models load a few times rather than
once per scenario (the wall time is the processes starting):
  (b) the trainer process is SIGKILLed after a checkpoint: the gang restarts and resumes from it;
  (c) the rollout pod is deleted: a new one (new address) joins the weight-sync group;
  (d) suspend removes every pod; un-suspending resumes from the checkpoint;
  (a) the job ends Succeeded with the steps in its status, and the exported model on the claim
      loads and differs from the initial weights.
The per-step history on the claim (KUBEDISTILL_HISTORY) shows that across the three trainer runs
every step was trained once from its checkpoint on, and no prompt skipped or trained twice.

The control plane is the session's, shared with other modules: the job lives in a namespace of
its own, and the twin's Node is tainted so that only this job's pods (which tolerate the taint
and select the Node) are scheduled to it. The operator runs as the admin (the chart's RBAC and a
ServiceAccount token are tests/test_k8s_operator.py's subject), with only the CRD installed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import torch

from control_plane import CONTROLLERS, SCHEDULER
from e2e_jobs import write_prompts
from kubedistill.api.job import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kubedistill.api.spec import CheckpointClaimSpec
from node_agent import TWIN_TOLERATION, ApiAccess, NodeAgent, NodeRegistration
from operator_fixtures import eventually
from real_cluster import CRD_NAME, operator_process
from test_node_agent import needs_root, twin_namespace

pytestmark = [needs_root]

NAMESPACE = "e2e-node-agent"
CRD_FILE = Path(__file__).resolve().parent.parent / "crds" / "kubedistill.io_distillationjobs.yaml"
JOB = "k8s"
# Steps take ~0.4 s here once running, and a deleted rollout pod serves for up to 5 s more
# (uvicorn's graceful shutdown): enough steps that the job is still running for each scenario.
STEPS, EVERY, N, MINI = 40, 2, 2, 4
CLAIM = f"{JOB}-checkpoint"
"""The claim the operator makes for checkpoint.path (the default /ckpt, no volume of the job there)."""


def manifest(models: Path, data: Path, node: str) -> dict[str, Any]:
    inference = {"engine": "hf", "maxModelLen": 64}
    spec = {
        "mode": "sync",
        "device": "cpu",
        "student": {"model": "/models/student"},
        "teachers": [
            {"name": "arith", "model": "/models/teacher", "inference": inference, "overrides": {"cpuThreads": 1}}
        ],
        "rollout": {
            "replicas": 1,
            "inference": inference,
            "sampling": {"samplesPerPrompt": N, "temperature": 1.0, "maxTokens": 4, "seed": 0},
            "overrides": {"cpuThreads": 1},
        },
        "trainer": {
            "replicas": 1,
            "optim": {"lr": 1e-3},
            "miniBatchSize": MINI,
            "totalSteps": STEPS,
            "mixedPrecision": "float32",
            "overrides": {"cpuThreads": 1, "env": [{"name": "KUBEDISTILL_HISTORY", "value": "/ckpt/history.jsonl"}]},
        },
        "algorithm": {"distillation": {"lossMode": "forwardKLTopK", "topK": 4}},
        "data": {"train": ["/data/train.jsonl"], "maxPromptLength": 32},
        # The default path, resume and claim: only the interval is the test's.
        "checkpoint": {"everySteps": EVERY},
        "weightSync": {"bucketMB": 4, "timeoutSeconds": 180},
        "backoffLimit": 3,
        # The twin's Node and nothing else: its taint keeps every other pod off it, and these
        # pods off any Node another test registers.
        "tolerations": [TWIN_TOLERATION],
        "nodeSelector": {"kubernetes.io/hostname": node},
        # An air-gapped cluster: nothing may reach a model hub.
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TRANSFORMERS_OFFLINE", "value": "1"}],
        "volumes": [
            {"name": "models", "hostPath": {"path": str(models), "type": "Directory"}},
            {"name": "data", "hostPath": {"path": str(data), "type": "Directory"}},
        ],
        "volumeMounts": [
            {"name": "models", "mountPath": "/models", "readOnly": True},
            {"name": "data", "mountPath": "/data", "readOnly": True},
        ],
    }
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": JOB, "namespace": NAMESPACE}, "spec": spec}


class Cluster:
    """The real API server through the kubernetes client, as the admin (in a thread each call)."""

    def __init__(self, kubeconfig: Path, namespace: str):
        self.api_client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        self.core = kubernetes.client.CoreV1Api(self.api_client)
        self.custom = kubernetes.client.CustomObjectsApi(self.api_client)
        self.ns = namespace

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", 10)
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def create_job(self, body: dict[str, Any]) -> None:
        await self.call(
            self.custom.create_namespaced_custom_object,
            GROUP,
            VERSION,
            self.ns,
            PLURAL,
            body,
            field_validation="Strict",
        )

    async def job(self, name: str) -> dict[str, Any] | None:
        try:
            job: dict[str, Any] = await self.call(
                self.custom.get_namespaced_custom_object, GROUP, VERSION, self.ns, PLURAL, name
            )
            return job
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def patch_job(self, name: str, patch: dict[str, Any]) -> None:
        await self.call(self.custom.patch_namespaced_custom_object, GROUP, VERSION, self.ns, PLURAL, name, patch)

    async def pods(self, job: str) -> dict[str, Any]:
        items = (
            await self.call(self.core.list_namespaced_pod, self.ns, label_selector=f"kubedistill.io/job={job}")
        ).items
        return {p.metadata.name: p for p in items}

    async def delete_pod(self, name: str) -> None:
        await self.call(self.core.delete_namespaced_pod, name, self.ns)


def checkpoint_volume(agent: NodeAgent, namespace: str) -> dict[str, Any]:
    """A static PersistentVolume reserved (claimRef) for the checkpoint claim the operator makes, as
    large as the claim's default size and without a class, like the claim on a cluster with no
    default StorageClass; the volume binder binds the two. The twin backs the claim with a
    directory of its own; the volume's hostPath names it."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-{CLAIM}"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "",
            "capacity": {"storage": CheckpointClaimSpec().size},
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(agent.claim_dir(CLAIM))},
            "claimRef": {"namespace": namespace, "name": CLAIM},
        },
    }


def history(agent: NodeAgent) -> list[dict[str, Any]]:
    path = agent.claim_dir(CLAIM) / "history.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def runs(lines: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The history split by trainer process (the driver's runId in every line)."""
    out: list[list[dict[str, Any]]] = []
    for h in lines:
        if not out or h["runId"] != out[-1][-1]["runId"]:
            out.append([])
        out[-1].append(h)
    return out


def newest_checkpoint(agent: NodeAgent) -> dict[str, Any]:
    steps = sorted(agent.claim_dir(CLAIM).glob("step-*/meta.json"))
    return json.loads(steps[-1].read_text()) if steps else {}


async def test_a_job_applied_to_the_api_trains_through_real_pods(
    control_plane: Any, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    plane = control_plane
    plane.needs(SCHEDULER, CONTROLLERS, why="the scheduler binds the pods; node lifecycle, volume binding")
    twin_namespace(plane, NAMESPACE)  # with what MicroShift's admission adds to every pod
    plane.kubectl("apply", "-f", str(CRD_FILE))
    plane.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    cluster = Cluster(plane.kubeconfig, NAMESPACE)
    models = tiny_models["student"].parent
    data = write_prompts(tmp_path / "data" / "train.jsonl").parent
    # A hostPath must be readable by the pod's user: pytest makes its directories 0700 and the
    # model writer its safetensors files 0600.
    for d in (models, data):
        subprocess.run(["chmod", "-R", "a+rX", str(d)], check=True)
    agent = NodeAgent(
        ApiAccess.from_kubeconfig(plane.kubeconfig), NAMESPACE, node=NodeRegistration(), probe_period_max=1.0
    )
    operator_log = tmp_path / "operator.log"
    notes: list[str] = []

    async def status() -> dict[str, Any]:
        return ((await cluster.job(JOB)) or {}).get("status") or {}

    async def until(check: Any, timeout: float, what: str) -> Any:
        async def or_crash() -> Any:
            # A pod that exits on its own with an error will not get better: stop waiting.
            crashed = [r.name for r in agent.history if r.exit_code not in (None, 0, 128 + 9, 128 + 15)]
            assert not crashed, f"pods crashed: {crashed}"
            return await check()

        try:
            return await eventually(or_crash, timeout=timeout, interval=0.2, what=what)
        except AssertionError as e:
            pods = {
                n: (
                    p.spec.node_name,
                    p.status.phase if p.status else None,
                    p.metadata.deletion_timestamp,
                    [(c.type, c.status, c.message) for c in (p.status.conditions or [])] if p.status else None,
                )
                for n, p in (await cluster.pods(JOB)).items()
            }
            runs_ = {n: (r.exit_code, r.running, r.waiting) for n, r in agent.pods.items()}
            operator = "\n".join(operator_log.read_text(errors="replace").splitlines()[-30:])
            raise AssertionError(
                f"{e}\nstory so far: {notes}\njob status: {await status()}\npods: {pods}\n"
                f"agent: {runs_}\n{agent.log_tail(40)}\n--- operator ---\n{operator}"
            ) from None

    async def pod_ip(name: str) -> str | None:
        pods = await cluster.pods(JOB)
        p = pods.get(name)
        return p.status.pod_ip if p is not None and p.status is not None and p.status.phase == "Running" else None

    await agent.start()
    pv_name = ""
    try:
        pv = checkpoint_volume(agent, NAMESPACE)
        pv_name = pv["metadata"]["name"]
        plane.apply([pv])
        with operator_process(plane.kubeconfig, [NAMESPACE], operator_log, resync_seconds=0.5):
            try:
                await cluster.create_job(manifest(models, data, agent.node_name))

                async def claim_bound() -> Any:
                    try:
                        c = await cluster.call(cluster.core.read_namespaced_persistent_volume_claim, CLAIM, NAMESPACE)
                    except kubernetes.client.ApiException as exc:
                        if exc.status == 404:
                            return None
                        raise
                    return c if c.status is not None and c.status.phase == "Bound" else None

                claim = await until(claim_bound, 60, "the operator's checkpoint claim Bound")
                # whenDeleted Retain (the default): no owner, so deleting the job keeps the checkpoints.
                assert not claim.metadata.owner_references, claim.metadata
                assert claim.spec.access_modes == ["ReadWriteOnce"], claim.spec

                async def checkpointed() -> Any:
                    # Read from the claim: the job's status lags by the operator's polling.
                    st = await status()
                    return st if newest_checkpoint(agent) and st.get("phase") == "Running" else None

                st = await until(checkpointed, 240, "a first checkpoint while Running")
                notes.append(f"checkpoint at step {newest_checkpoint(agent)['step']}, status step {st.get('step')}")
                placed = {n: p.spec.node_name for n, p in (await cluster.pods(JOB)).items()}
                assert set(placed.values()) == {agent.node_name}, placed  # the scheduler's binding

                # (b) the trainer's process SIGKILLed (as the OOM killer would): a gang restart. Once
                # the newest checkpoint's step is in the history: the driver writes a step's line
                # after its checkpoint, and a kill in between would leave that step out of it.
                async def logged() -> Any:
                    step = newest_checkpoint(agent).get("step")
                    return step if step in {h["step"] for h in history(agent)} else None

                await until(logged, 60, "the newest checkpoint's step in the history")
                pid = agent.pid(f"{JOB}-trainer-0")
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                killed_at = newest_checkpoint(agent)
                notes.append(f"killed trainer pid {pid} after checkpoint step {killed_at.get('step')}")

                async def resumed() -> Any:
                    st = await status()
                    pods = await cluster.pods(JOB)
                    t0 = pods.get(f"{JOB}-trainer-0")
                    attempt = t0.metadata.labels.get("kubedistill.io/attempt") if t0 is not None else None
                    running = t0 is not None and t0.status is not None and t0.status.phase == "Running"
                    return st if st.get("restarts") == 1 and attempt == "1" and running else None

                # The new trainer needs a rollout in its weight-sync group before its first step: the
                # rollout deleted now is one it must find again (the history checks the resume below).
                st = await until(resumed, 180, "the restarted gang running")
                notes.append(f"restarted: status step {st.get('step')}")

                # (c) the rollout pod deleted: replaced under a new address, it joins the weight-sync group.
                old_ip = await pod_ip(f"{JOB}-rollout-0")
                old_group = httpx.get(f"http://{old_ip}:8000/weights/group", timeout=5).json()
                await cluster.delete_pod(f"{JOB}-rollout-0")
                notes.append(f"deleted rollout pod at {old_ip} (group {old_group})")

                async def rejoined() -> Any:
                    ip = await pod_ip(f"{JOB}-rollout-0")
                    if ip is None or ip == old_ip:
                        return None
                    try:
                        group = httpx.get(f"http://{ip}:8000/weights/group", timeout=2).json()
                        version = httpx.get(f"http://{ip}:8000/version", timeout=2).json()["version"]
                    except (httpx.HTTPError, ValueError):
                        return None
                    return (ip, group, version) if group.get("state") == "ready" and version > 0 else None

                new_ip, new_group, version = await until(rejoined, 180, "the new rollout pod in the weight-sync group")
                assert new_group["epoch"] != old_group["epoch"]
                notes.append(f"rollout rejoined at {new_ip}: group {new_group}, weights v{version}")

                async def trained_again() -> Any:
                    return len(runs(history(agent))) >= 2

                await until(trained_again, 120, "the restarted trainer's first step")

                # (d) suspend removes every pod; un-suspending resumes from the checkpoint.
                await cluster.patch_job(JOB, {"spec": {"suspend": True}})

                async def suspended() -> Any:
                    st = await status()
                    return (
                        st
                        if st.get("phase") == "Suspended" and not await cluster.pods(JOB) and not agent.pods
                        else None
                    )

                st = await until(suspended, 60, "every pod gone, phase Suspended")
                suspended_at = newest_checkpoint(agent)
                assert st["restarts"] == 1
                runs_before = len(runs(history(agent)))
                notes.append(f"suspended after checkpoint step {suspended_at.get('step')}")
                assert suspended_at["step"] < STEPS, "the job finished before it could be suspended: raise STEPS"
                await cluster.patch_job(JOB, {"spec": {"suspend": False}})

                async def succeeded() -> Any:
                    st = await status()
                    return st if st.get("phase") == "Succeeded" else None

                st = await until(succeeded, 240, "phase Succeeded")
                notes.append(f"succeeded: {st.get('step')} steps")
                # The operator polls /status while the trainer runs: its last answer may predate the
                # last steps (the claim's checkpoints and history below are the trainer's own word).
                assert 0 < st["step"] <= STEPS and st["restarts"] == 1
                assert st["lastCheckpoint"].startswith("/ckpt/step-")
                assert newest_checkpoint(agent)["step"] == STEPS
                finished = {p.metadata.name: p.status for p in (await cluster.pods(JOB)).values()}
                t0 = finished[f"{JOB}-trainer-0"]
                assert t0.phase == "Succeeded" and t0.container_statuses[0].state.terminated.exit_code == 0
                # Ready all along on its Lease alone: the test outlives node-monitor-grace-period (50 s).
                node = await cluster.call(cluster.core.read_node, agent.node_name)
                assert [c.status for c in node.status.conditions if c.type == "Ready"] == ["True"], (
                    node.status.conditions
                )
                assert not [t.key for t in node.spec.taints or [] if t.key.startswith("node.kubernetes.io/")], node.spec
            finally:
                # As the other modules leave the shared control plane: the operator lets the job go
                # (its finalizer), the garbage collector takes its pods.
                plane.kubectl("delete", f"{PLURAL}.{GROUP}", JOB, "-n", NAMESPACE, "--timeout=30s", check=False)
    finally:
        lines = history(agent)
        log_tail = agent.log_tail(40)
        exported = agent.claim_dir(CLAIM) / "student-hf"
        export_ok = (exported / "config.json").is_file()
        if export_ok:
            from transformers import AutoModelForCausalLM

            out = dict(AutoModelForCausalLM.from_pretrained(str(exported)).named_parameters())
        errors = list(agent.errors)
        await agent.close()  # deletes its Node and Lease
        plane.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        if pv_name:
            plane.kubectl("delete", "pv", pv_name, "--wait=false", check=False)

    # The server took every status, Lease renewal and deletion of the twin (strict validation).
    assert not errors, errors
    # (a) the exported model on the checkpoint claim loads and learned something.
    assert export_ok, log_tail
    init = dict(AutoModelForCausalLM.from_pretrained(str(tiny_models["student"])).named_parameters())
    assert out.keys() == init.keys()
    assert any(not torch.equal(out[k], init[k]) for k in out), "the exported student equals its initial weights"

    # Three trainer runs: the first, the one after the SIGKILL, the one after the suspend; each
    # later run starts right after the checkpoint the previous one left.
    parts = runs(lines)
    assert len(parts) == runs_before + 1 == 3, [[h["step"] for h in p] for p in parts]
    assert parts[1][0]["step"] == killed_at["step"] + 1
    assert parts[2][0]["step"] == suspended_at["step"] + 1
    assert parts[1][0]["trainerVersion"] == killed_at["weight_version"]
    kept = [h for i, p in enumerate(parts) for h in p if i + 1 == len(parts) or h["step"] < parts[i + 1][0]["step"]]
    # A step's line is written before its checkpoint, so a pod stopped at any moment has logged
    # every step it resumes after.
    assert [h["step"] for h in kept] == list(range(1, STEPS + 1))
    trained = [g for h in kept for g in h["groups"]]
    assert len(trained) == len(set(trained)) == STEPS * MINI // N, "a group was trained twice"
    missing = set(range(max(trained) + 1)) - set(trained)
    assert not missing, f"prompts skipped: {sorted(missing)}"
