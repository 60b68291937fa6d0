"""The children the operator renders for a job (pure; no cluster)."""

from __future__ import annotations

import argparse
import json
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from k8s_offline import read_manifest
from kubedistill.api import kubeyaml
from kubedistill.api.job import API_VERSION, GROUP, KIND, SINGULAR, DistillationJob
from kubedistill.api.roleconfig import CONFIG_PATH, JobConfig, Ports
from kubedistill.api.spec import RolloutSpec
from kubedistill.api.status import Phase
from kubedistill.api.validate import load_job
from kubedistill.operator import main as operator_main
from kubedistill.operator.kube import RESOURCES, UNWATCHED
from kubedistill.operator.metrics import METRICS, OperatorMetrics
from kubedistill.operator.render import (
    POD_GROUP_API,
    SCRATCH_DIR,
    format_quantity,
    parse_quantity,
    render_children,
    render_static,
    static_refs,
)
from kubedistill.runtime.metrics import METRICS as RUNTIME_METRICS
from operator_rbac import CLUSTER, GANG_SCHEDULER_RULES, NAMESPACED, rules
from pod_security import restricted_violations
from podgroup_schemas import pod_group_errors

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
K8S_VERSION = "1.33.0"


def _job(path: Path) -> DistillationJob:
    return load_job(path)


def _children(path: Path, ns: str = "ml") -> list[dict[str, Any]]:
    job = _job(path)
    return render_children(job.metadata.name, ns, job.spec)


def _by(children: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in children if c["kind"] == kind}


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_object_validates_strictly(example: Path) -> None:
    children = _children(example)
    assert children
    for obj in children:
        if obj["kind"] == "PodGroup":  # not a built-in kind: checked against its project's API
            assert pod_group_errors(obj) == [], obj["metadata"]["name"]
            continue
        # Raises ValidationError on any schema violation or unknown field.
        kubernetes_validate.validate(json.loads(json.dumps(obj)), K8S_VERSION, strict=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_pod_passes_pod_security_restricted(example: Path) -> None:
    pods = _by(_children(example), "Pod")
    assert pods
    for name, pod in pods.items():
        assert restricted_violations(pod) == [], name
        c = pod["spec"]["containers"][0]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        # Under a read-only root the runtime writes only to emptyDirs: HOME (every cache) is one.
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert _env(pod)["HOME"] == SCRATCH_DIR and "emptyDir" in volumes[mounts[SCRATCH_DIR]]


def test_restricted_check_catches_what_pod_security_refuses() -> None:
    pod = _by(_children(EXAMPLES[0]), "Pod")
    good = next(iter(pod.values()))
    bad = json.loads(json.dumps(good))
    del bad["spec"]["securityContext"]
    bad["spec"]["containers"][0]["securityContext"] = {}
    bad["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    problems = " | ".join(restricted_violations(bad))
    for rule in ("allowPrivilegeEscalation", "capabilities", "runAsNonRoot", "seccompProfile", "hostPath"):
        assert rule in problems


def test_security_context_overrides_merge_over_the_restricted_default(tmp_path: Path) -> None:
    doc = read_manifest(ROOT / "examples" / "one-gpu.yaml")
    doc["spec"]["securityContext"] = {
        "runAsUser": 2000,
        "seccompProfile": {"type": "Localhost", "localhostProfile": "p"},
    }
    doc["spec"]["containerSecurityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}, "readOnlyRootFilesystem": False}
    job = DistillationJob.model_validate(doc)
    pod = next(iter(_by(render_children(job.metadata.name, "ml", job.spec), "Pod").values()))
    psc, csc = pod["spec"]["securityContext"], pod["spec"]["containers"][0]["securityContext"]
    assert psc["runAsUser"] == 2000 and psc["runAsNonRoot"] is True and psc["fsGroup"] == 1000
    assert psc["seccompProfile"] == {"type": "Localhost", "localhostProfile": "p"}
    assert csc == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": False,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    # A capability beyond the restricted set is the user's explicit choice: PodSecurity would say so.
    assert restricted_violations(pod) == [
        "non-default capabilities ['IPC_LOCK'] in 'kubedistill'",
        "unrestricted capabilities (container 'kubedistill' must drop ALL, add at most NET_BIND_SERVICE)",
    ]


def test_checkpoint_path_is_the_operators_claim_on_trainer_pod_0_unless_a_user_volume_holds_it() -> None:
    """checkpoint.path on Kubernetes: trainer pod 0 (which writes checkpoints) mounts the claim the
    operator provisions there; a user volume that holds the path replaces it; no other pod mounts
    anything at the path."""
    from kubedistill.operator.volumes import checkpoint_claim_name

    def mounted_at(pod: dict, path: str) -> list[dict]:
        """The volumes of a pod's container mounts at `path`."""
        names = [m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == path]
        return [v for v in pod["spec"]["volumes"] if v["name"] in names]

    doc = read_manifest(ROOT / "examples" / "one-gpu.yaml")
    doc["spec"]["checkpoint"] = {"path": "/ckpt/run1"}
    doc["spec"]["trainer"].pop("overrides", None)
    doc["spec"].pop("volumeMounts", None)
    doc["spec"].pop("volumes", None)
    job = DistillationJob.model_validate(doc)
    name = job.metadata.name
    pods = _by(render_children(name, "ml", job.spec), "Pod")
    claim = {"name": "checkpoint", "persistentVolumeClaim": {"claimName": checkpoint_claim_name(name)}}
    assert mounted_at(pods[f"{name}-trainer-0"], "/ckpt/run1") == [claim]
    assert all(not mounted_at(p, "/ckpt/run1") for n, p in pods.items() if n != f"{name}-trainer-0")
    doc["spec"]["volumes"] = [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}]
    doc["spec"]["volumeMounts"] = [{"name": "ckpt", "mountPath": "/ckpt"}]
    job = DistillationJob.model_validate(doc)
    trainer = _by(render_children(name, "ml", job.spec), "Pod")[f"{name}-trainer-0"]
    assert mounted_at(trainer, "/ckpt/run1") == []
    assert mounted_at(trainer, "/ckpt") == [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}]
    assert "checkpoint" not in {v["name"] for v in trainer["spec"]["volumes"]}


def test_multi_teacher_layout() -> None:
    children = _children(ROOT / "examples" / "multi-teacher-6gpu.yaml")
    job = "qwen3-vl-multi-teacher"
    pods = _by(children, "Pod")
    assert sorted(pods) == sorted(
        [
            f"{job}-trainer-0",
            f"{job}-trainer-1",
            f"{job}-rollout-0",
            f"{job}-rollout-1",
            f"{job}-teacher-math-0",
            f"{job}-teacher-vision-0",
        ]
    )
    assert sorted(_by(children, "Service")) == sorted(
        [f"{job}-trainer", f"{job}-rollout", f"{job}-t-math", f"{job}-t-vision"]
    )
    assert list(_by(children, "ConfigMap")) == [f"{job}-config"]
    assert list(_by(children, "NetworkPolicy")) == [job]
    # Children come config/services first, pods last.
    kinds = [c["kind"] for c in children]
    assert kinds == sorted(kinds, key=lambda k: k == "Pod")
    for c in children:
        labels = c["metadata"]["labels"]
        assert labels["kubedistill.io/job"] == job
        assert "kubedistill.io/role" in labels and "kubedistill.io/replica" in labels
        assert len(c["metadata"]["name"]) <= 253


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_static_refs_name_exactly_the_static_children(example: Path) -> None:
    job = _job(example)
    rendered = render_static(job.metadata.name, "ml", job.spec)
    assert static_refs(job.metadata.name, job.spec) == [(o["kind"], o["metadata"]["name"]) for o in rendered]


def test_pod_identity_env_and_resources() -> None:
    children = _children(ROOT / "examples" / "multi-teacher-6gpu.yaml")
    job = "qwen3-vl-multi-teacher"
    pods = _by(children, "Pod")
    t1 = pods[f"{job}-trainer-1"]
    env = _env(t1)
    assert env["KUBEDISTILL_ROLE"] == "trainer" and env["KUBEDISTILL_REPLICA"] == "1"
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == f"{job}-trainer-0.{job}-trainer.ml.svc"
    assert env["MASTER_PORT"] == str(Ports.DIST)
    assert env["KUBEDISTILL_JOB"] == job and env["KUBEDISTILL_NAMESPACE"] == "ml"
    assert env["NCCL_DEBUG"] == "WARN"
    c = t1["spec"]["containers"][0]
    assert c["command"] == ["kubedistill", "role", "trainer", "--config", CONFIG_PATH]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "readinessProbe" not in c
    assert t1["spec"]["hostname"] == f"{job}-trainer-1" and t1["spec"]["subdomain"] == f"{job}-trainer"
    assert t1["spec"]["restartPolicy"] == "Never"
    assert t1["spec"]["priorityClassName"] == "training"
    assert t1["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in t1["spec"]["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # Only rank 0 writes checkpoints: the checkpoint claim stays off every other pod (ReadWriteOnce).
    assert {"name": "ckpt", "mountPath": "/ckpt"} not in c["volumeMounts"]
    assert "ckpt" not in {v["name"] for v in t1["spec"]["volumes"]}
    t0 = pods[f"{job}-trainer-0"]
    assert {"name": "ckpt", "mountPath": "/ckpt"} in t0["spec"]["containers"][0]["volumeMounts"]
    assert "ckpt" in {v["name"] for v in t0["spec"]["volumes"]}
    # Requests by role and GPU count (operator/requests.py), so no pod is BestEffort.
    assert c["resources"]["requests"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}
    assert c["ports"][0] == {"name": "http", "containerPort": Ports.HTTP, "protocol": "TCP"}

    teacher = pods[f"{job}-teacher-vision-0"]
    tc = teacher["spec"]["containers"][0]
    assert _env(teacher)["KUBEDISTILL_TEACHER"] == "vision"
    assert "RANK" not in _env(teacher)
    assert tc["command"][:3] == ["kubedistill", "role", "teacher"]
    assert tc["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert teacher["spec"]["hostname"] == "vision-0" and teacher["spec"]["subdomain"] == f"{job}-t-vision"
    assert "ckpt" not in {v["name"] for v in teacher["spec"]["volumes"]}
    assert "models" in {v["name"] for v in teacher["spec"]["volumes"]}
    assert tc["resources"]["requests"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}


def test_config_map_holds_the_job_config_with_one_url_per_replica() -> None:
    children = _children(ROOT / "examples" / "multi-teacher-6gpu.yaml")
    job = "qwen3-vl-multi-teacher"
    cm = _by(children, "ConfigMap")[f"{job}-config"]
    cfg = JobConfig.model_validate_json(cm["data"]["config.json"])
    assert cfg.job == job and cfg.namespace == "ml"
    assert cfg.endpoints.rollout == [f"http://{job}-rollout-{i}.{job}-rollout.ml.svc:{Ports.HTTP}" for i in range(2)]
    assert cfg.endpoints.teachers == {
        "math": [f"http://math-0.{job}-t-math.ml.svc:{Ports.HTTP}"],
        "vision": [f"http://vision-0.{job}-t-vision.ml.svc:{Ports.HTTP}"],
    }
    assert cfg.endpoints.trainer == f"http://{job}-trainer-0.{job}-trainer.ml.svc:{Ports.HTTP}"
    assert cfg.endpoints.master_addr == f"{job}-trainer-0.{job}-trainer.ml.svc"
    assert cfg.spec == _job(ROOT / "examples" / "multi-teacher-6gpu.yaml").spec
    # The exact serialisation the runtime team reads.
    assert cm["data"]["config.json"] == cfg.model_dump_json(by_alias=True, exclude_none=True)


def test_services_are_headless_and_publish_not_ready() -> None:
    services = _by(_children(ROOT / "examples" / "one-gpu.yaml"), "Service")
    for svc in services.values():
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["selector"]["kubedistill.io/job"] == svc["metadata"]["labels"]["kubedistill.io/job"]


def test_network_policy_admits_job_pods_and_labelled_scrapers_only() -> None:
    job = _job(ROOT / "examples" / "one-gpu.yaml")
    np = _by(render_children(job.metadata.name, "ml", job.spec), "NetworkPolicy")[job.metadata.name]
    spec = np["spec"]
    assert spec["podSelector"] == {"matchLabels": {"kubedistill.io/job": job.metadata.name}}
    assert spec["policyTypes"] == ["Ingress"]
    own_pod = {"kubedistill.io/job": job.metadata.name, "kubedistill.io/role": "rollout"}
    scraper = {"app": "prometheus", "kubedistill.io/scraper": "true"}
    stranger = {"kubedistill.io/job": "another-job"}
    # The rendezvous stores, and the ports the OS picks for NCCL's bootstrap and socket transport
    # and for gloo's pair connections (anywhere in the ephemeral range).
    for port in (Ports.HTTP, Ports.DIST, Ports.WEIGHT_SYNC, 32768, 45123, 60999):
        assert _admits(spec, own_pod, port), port
        assert _admits(spec, scraper, port) == (port == Ports.HTTP), port
        assert not _admits(spec, stranger, port), port


def _admits(policy: dict[str, Any], source: dict[str, str], port: int) -> bool:
    """Whether an ingress NetworkPolicy admits TCP from a pod with `source` labels (any namespace
    for a rule with namespaceSelector {}, else the policy's own) on `port`."""
    for rule in policy["ingress"]:
        peers = rule.get("from", [])
        matched = not peers or any(
            all(source.get(k) == v for k, v in peer.get("podSelector", {}).get("matchLabels", {}).items())
            and ("namespaceSelector" in peer or source.get("kubedistill.io/job") is not None)
            for peer in peers
        )
        ports = rule.get("ports")
        if matched and (not ports or any(p.get("protocol", "TCP") == "TCP" and p["port"] == port for p in ports)):
            return True
    return False


def test_cpu_job_threads_kv_cache_and_role_overrides() -> None:
    doc = read_manifest(ROOT / "examples" / "quickstart-cpu.yaml")
    doc["spec"]["rollout"]["inference"] = {"engine": "vllm", "kvCacheGiB": 1}
    doc["spec"]["env"] = [{"name": "SHARED", "value": "job"}, {"name": "OMP_NUM_THREADS", "value": "7"}]
    doc["spec"]["nodeSelector"] = {"pool": "cpu"}
    doc["spec"]["scheduling"] = {"schedulerName": "custom-scheduler"}
    doc["spec"]["serviceAccountName"] = "trainer-sa"
    doc["spec"]["imagePullPolicy"] = "Always"
    doc["spec"]["trainer"]["overrides"] = {
        "cpuThreads": 3,
        "nodeSelector": {"zone": "a"},
        "env": [{"name": "SHARED", "value": "trainer"}],
        "resources": {"requests": {"cpu": "4", "memory": "8Gi"}},
    }
    job = DistillationJob.model_validate(doc)
    pods = _by(render_children(job.metadata.name, "ml", job.spec), "Pod")
    trainer = pods["quickstart-cpu-trainer-0"]
    env = _env(trainer)
    # The user's OMP_NUM_THREADS in spec.env wins over cpuThreads; role env wins over job env.
    assert env["OMP_NUM_THREADS"] == "7" and env["SHARED"] == "trainer"
    assert [e["name"] for e in trainer["spec"]["containers"][0]["env"]].count("SHARED") == 1
    assert trainer["spec"]["nodeSelector"] == {"pool": "cpu", "zone": "a"}
    assert trainer["spec"]["schedulerName"] == "custom-scheduler"
    assert trainer["spec"]["serviceAccountName"] == "trainer-sa"
    c = trainer["spec"]["containers"][0]
    assert c["imagePullPolicy"] == "Always"
    assert c["resources"] == {"requests": {"cpu": "4", "memory": "8Gi"}}  # no GPUs on cpu
    rollout_env = _env(pods["quickstart-cpu-rollout-0"])
    assert rollout_env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert rollout_env["OMP_NUM_THREADS"] == "7"
    kubernetes_validate.validate(json.loads(json.dumps(trainer)), K8S_VERSION, strict=True)


def test_cpu_threads_become_omp_num_threads() -> None:
    job = _job(ROOT / "examples" / "quickstart-cpu.yaml")
    pods = _by(render_children(job.metadata.name, "ml", job.spec), "Pod")
    assert _env(pods["quickstart-cpu-teacher-arith-0"])["OMP_NUM_THREADS"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in _env(pods["quickstart-cpu-teacher-arith-0"])  # hf engine


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    operator_main.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_render_command_prints_the_children(capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / "examples" / "multi-teacher-6gpu.yaml"
    assert _run_cli(["render", str(path), "--namespace", "ml"]) == 0
    docs = kubeyaml.load_all(capsys.readouterr().out)
    assert docs == json.loads(json.dumps(_children(path, "ml")))


def test_render_command_refuses_a_bad_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / "tests" / "manifests" / "broken" / "bad-enum.yaml"
    assert _run_cli(["render", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.strip() and "Traceback" not in err and str(path) in err


def test_metrics_table_names() -> None:
    names = {d.full_name for d in METRICS}
    assert names == {
        "kubedistill_operator_jobs",
        "kubedistill_operator_reconcile_seconds",
        "kubedistill_operator_reconcile_errors",
        "kubedistill_operator_children_created",
        "kubedistill_operator_children_deleted",
        "kubedistill_operator_children_refused",
        "kubedistill_operator_role_ready",
        "kubedistill_operator_job_restarts",
    }
    m = OperatorMetrics()
    m.job_phase("ml", "a", Phase.running)
    m.job_phase("ml", "b", Phase.running)
    m.job_phase("ml", "b", Phase.failed)
    m.reconcile_errors.inc()
    m.children_created.labels(kind="Pod").inc(3)
    assert m.registry.get_sample_value("kubedistill_operator_jobs", {"phase": "Running"}) == 1
    assert m.registry.get_sample_value("kubedistill_operator_jobs", {"phase": "Failed"}) == 1
    assert m.registry.get_sample_value("kubedistill_operator_reconcile_errors_total") == 1
    assert m.registry.get_sample_value("kubedistill_operator_children_created_total", {"kind": "Pod"}) == 3


def _yaml_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", markdown, flags=re.S | re.M)


def test_the_hpa_in_the_docs_validates_and_scales_a_distillation_job() -> None:
    """docs/operator.md#autoscaling-on-the-trainers-idle-ratio: the HPA is a valid
    autoscaling/v2 object whose target is a DistillationJob (through its scale subresource) and
    whose metric the trainer exports; the prometheus-adapter rule beside it serves that metric
    as an Object metric of the job."""
    blocks = _yaml_blocks((ROOT / "docs" / "operator.md").read_text())
    (hpa,) = [doc for b in blocks if "kind: HorizontalPodAutoscaler" in b for doc in kubeyaml.load_all(b)]
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    spec = hpa["spec"]
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == (API_VERSION, KIND)
    assert (
        1
        <= spec["minReplicas"]
        <= spec["maxReplicas"]
        <= RolloutSpec.model_json_schema()["properties"]["replicas"]["maximum"]
    )
    (metric,) = spec["metrics"]
    assert metric["type"] == "Object" and metric["object"]["describedObject"] == target
    name = metric["object"]["metric"]["name"]
    assert name in {d.full_name for d in RUNTIME_METRICS if "trainer" in d.roles}
    (adapter,) = [doc for b in blocks if "seriesQuery" in b for doc in kubeyaml.load_all(b)]
    (rule,) = adapter["rules"]
    assert rule["seriesQuery"].startswith(name + "{") and rule["name"]["as"] == name
    assert rule["resources"]["overrides"]["job"] == {"group": GROUP, "resource": SINGULAR}


def test_rbac_covers_every_call_the_operator_makes() -> None:
    def allowed(group: str, resource: str, verb: str, rule_list: list[dict[str, list[str]]]) -> bool:
        return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rule_list)

    for kind, r in RESOURCES.items():
        for verb in ("list", "watch", "delete"):
            assert allowed(r.group, r.plural, verb, NAMESPACED), (kind, verb)
        if kind != "DistillationJob":
            assert allowed(r.group, r.plural, "create", NAMESPACED), kind
    assert allowed("", "configmaps", "patch", NAMESPACED)  # kept current: render.KEPT_CURRENT
    for rule in GANG_SCHEDULER_RULES.values():
        assert "patch" in rule["verbs"] and "podgroups" in rule["resources"]
    assert allowed("kubedistill.io", "distillationjobs/status", "patch", NAMESPACED)
    assert allowed("kubedistill.io", "distillationjobs", "patch", NAMESPACED)  # finalizer, annotations
    # Children's ownerReferences set blockOwnerDeletion (kopf.adopt): OwnerReferencesPermissionEnforcement.
    assert allowed("kubedistill.io", "distillationjobs/finalizers", "update", NAMESPACED)
    assert allowed("", "events", "create", NAMESPACED)
    assert allowed("apiextensions.k8s.io", "customresourcedefinitions", "list", CLUSTER)
    everything = rules(all_namespaces=True)
    assert everything["role"] == [] and len(everything["clusterRole"]) == len(CLUSTER) + len(NAMESPACED)


def test_a_trainer_pod_with_several_gpus_runs_one_rank_per_gpu_under_torchrun() -> None:
    doc = read_manifest(ROOT / "examples" / "one-gpu.yaml")
    doc["spec"]["trainer"].update(replicas=2, gpusPerReplica=2)
    job = DistillationJob.model_validate(doc)
    name = job.metadata.name
    pods = _by(render_children(name, "ml", job.spec), "Pod")
    trainer1 = pods[f"{name}-trainer-1"]["spec"]["containers"][0]
    assert trainer1["command"] == [
        "torchrun", "--nnodes=2", "--nproc-per-node=2", "--node-rank=1",
        f"--master-addr={name}-trainer-0.{name}-trainer.ml.svc", f"--master-port={Ports.DIST}",
        "-m", "kubedistill.cli", "role", "trainer", "--config", CONFIG_PATH,
    ]  # fmt: skip
    assert trainer1["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert _env(pods[f"{name}-trainer-1"])["WORLD_SIZE"] == "4"
    # One-GPU pods (and every server) run the role directly.
    assert pods[f"{name}-rollout-0"]["spec"]["containers"][0]["command"][:3] == ["kubedistill", "role", "rollout"]


# --- spec.scheduling: what each gang scheduler gets ------------------------------------------------


def test_volcano_pod_group_sums_the_pods_requests_and_every_pod_names_it() -> None:
    children = _children(ROOT / "examples" / "gang-volcano.yaml")
    (group,) = _by(children, "PodGroup").values()
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["metadata"]["name"] == "gang-volcano"
    # 2 trainers (16 CPU, 96Gi), 2 rollout (8, 32Gi), 1 teacher (8, 48Gi), one GPU each.
    assert group["spec"] == {
        "minMember": 5,
        "minResources": {"cpu": "56", "memory": "304Gi", "nvidia.com/gpu": "5"},
        "queue": "research",
        "priorityClassName": "training",
    }
    pods = _by(children, "Pod")
    assert len(pods) == 5
    for pod in pods.values():
        assert pod["metadata"]["annotations"] == {"scheduling.k8s.io/group-name": "gang-volcano"}
        assert pod["spec"]["schedulerName"] == "volcano" and pod["spec"]["priorityClassName"] == "training"
    # The group before the pods: the scheduler places a pod by its group.
    kinds = [c["kind"] for c in children]
    assert kinds.index("PodGroup") < kinds.index("Pod")


def test_coscheduling_pod_group_min_member_counts_the_trainers_first() -> None:
    doc = read_manifest(ROOT / "examples" / "gang-coscheduling.yaml")
    doc["spec"]["scheduling"]["minMember"] = 3
    job = DistillationJob.model_validate(doc)
    children = render_children(job.metadata.name, "ml", job.spec)
    (group,) = _by(children, "PodGroup").values()
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    # The first 3 pods: both trainers (16 CPU, 96Gi each) and rollout 0 (8, 32Gi).
    assert group["spec"] == {
        "minMember": 3,
        "minResources": {"cpu": "40", "memory": "224Gi", "nvidia.com/gpu": "3"},
        "scheduleTimeoutSeconds": 600,
    }
    assert pod_group_errors(group) == []
    for pod in _by(children, "Pod").values():
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == job.metadata.name
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        assert "annotations" not in pod["metadata"]


def test_kueue_labels_every_pod_with_its_queue_and_the_attempts_group() -> None:
    job = _job(ROOT / "examples" / "gang-kueue.yaml")
    assert not _by(render_children(job.metadata.name, "ml", job.spec), "PodGroup")
    for attempt in (0, 3):
        pods = _by(render_children(job.metadata.name, "ml", job.spec, attempt=attempt), "Pod")
        assert len(pods) == 5
        for name, pod in pods.items():
            meta = pod["metadata"]
            assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "research"
            assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == f"gang-kueue-attempt-{attempt}"
            # With Kueue the whole job is the gang: servers carry the attempt too.
            assert meta["labels"]["kubedistill.io/attempt"] == str(attempt), name
            assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "5"
            assert "schedulerName" not in pod["spec"] and pod["spec"]["priorityClassName"] == "training"
        # One PodSet per role, however many replicas (Kueue allows 8 per group).
        hashes = {n: p["metadata"]["annotations"]["kueue.x-k8s.io/role-hash"] for n, p in pods.items()}
        assert sorted(set(hashes.values())) == ["rollout", "t-teacher", "trainer"]


def test_no_gang_scheduler_leaves_pods_ungrouped() -> None:
    job = _job(ROOT / "examples" / "multi-teacher-6gpu.yaml")
    children = render_children(job.metadata.name, "ml", job.spec)
    assert not _by(children, "PodGroup")
    pods = _by(children, "Pod")
    for name, pod in pods.items():
        assert "annotations" not in pod["metadata"] and "schedulerName" not in pod["spec"]
        assert not [k for k in pod["metadata"]["labels"] if "kueue" in k or "scheduling" in k]
        assert ("kubedistill.io/attempt" in pod["metadata"]["labels"]) == ("trainer" in name)


def test_pod_group_schemas_catch_mistakes() -> None:
    (group,) = _by(_children(ROOT / "examples" / "gang-volcano.yaml"), "PodGroup").values()
    bad = json.loads(json.dumps(group))
    bad["spec"]["minAvailable"] = 5  # Volcano's Job field, not the PodGroup's
    assert pod_group_errors(bad)
    bad = json.loads(json.dumps(group))
    bad["spec"]["minResources"]["memory"] = "304 GiB"
    assert pod_group_errors(bad)
    bad = json.loads(json.dumps(group))
    bad["apiVersion"] = "scheduling.x-k8s.io/v1alpha1"  # coscheduling has no queue
    assert any("queue" in e for e in pod_group_errors(bad))


@pytest.mark.parametrize(
    "amounts, total",
    [
        (["500m", "1500m"], "2"),
        (["1Gi", "512Mi"], "1536Mi"),
        (["1.5"], "1500m"),
        (["1e3", "24"], "1024"),
        (["1k", "1M"], "1001000"),
        (["64Gi", "64Gi"], "128Gi"),
    ],
)
def test_quantities_sum_exactly(amounts: list[str], total: str) -> None:
    assert format_quantity(sum((parse_quantity(a) for a in amounts), Decimal(0))) == total


def test_a_bad_quantity_is_named() -> None:
    with pytest.raises(ValueError, match="'8 cores' is not a Kubernetes quantity"):
        parse_quantity("8 cores")


def test_rbac_lets_the_operator_create_each_pod_group() -> None:
    for gang, api_version in POD_GROUP_API.items():
        group = api_version.split("/")[0]
        (rule,) = rules(all_namespaces=False, gang_schedulers=[gang.value])["role"][len(NAMESPACED) :]
        assert group in rule["apiGroups"] and "podgroups" in rule["resources"] and "create" in rule["verbs"]
        assert UNWATCHED["PodGroup"] == "podgroups"
