"""The children of a DistillationJob, as a pure function of its name, namespace and spec.

The operator creates exactly these objects and `kubedistill render FILE` prints them, so what a
user previews is what the cluster gets. Owner references are added by the operator (kopf.adopt)
because they need the live object's uid.

Naming (job names are at most 40 characters, teacher names at most 20, so every Service name
and pod hostname stays a 63-character DNS label):

  ConfigMap      <job>-config                 key config.json (kubedistill.api.roleconfig.JobConfig)
  Service        <job>-trainer                headless, the trainer gang's rendezvous
  Service        <job>-rollout                headless, one DNS name per rollout pod
  Service        <job>-t-<teacher>            headless, one DNS name per teacher pod
  NetworkPolicy  <job>                        only the job's pods (and labelled scrapers) get in
  Pod            <job>-trainer-<i>            hostname <job>-trainer-<i>, subdomain <job>-trainer
  Pod            <job>-rollout-<i>            hostname <job>-rollout-<i>, subdomain <job>-rollout
  Pod            <job>-teacher-<teacher>-<i>  hostname <teacher>-<i>,    subdomain <job>-t-<teacher>
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubedistill.api.job import API_VERSION, KIND
from kubedistill.api.roleconfig import (
    CONFIG_PATH,
    Endpoints,
    Identity,
    JobConfig,
    Ports,
    Role,
    role_env,
    role_overrides,
    user_env,
)
from kubedistill.api.spec import DistillationJobSpec, EnvVar, RoleOverrides

LABEL_JOB = "kubedistill.io/job"
LABEL_ROLE = "kubedistill.io/role"
LABEL_REPLICA = "kubedistill.io/replica"
LABEL_TEACHER = "kubedistill.io/teacher"
LABEL_ATTEMPT = "kubedistill.io/attempt"
"""Trainer pods only: the gang attempt (status.restarts when the pod was made)."""
SCRAPER_LABEL = "kubedistill.io/scraper"
"""Pods labelled `kubedistill.io/scraper: "true"` (Prometheus, the operator) may reach the job's
HTTP port through its NetworkPolicy."""

SHARED_ROLE = "shared"
"""Role label of children that serve every role (ConfigMap, NetworkPolicy)."""
ALL_REPLICAS = "all"
"""Replica label of children that are not one pod (Services, ConfigMap, NetworkPolicy)."""

CONFIG_KEY = "config.json"
CONTAINER = "kubedistill"
GPU_RESOURCE = "nvidia.com/gpu"
SERVER_ROLES = (Role.rollout, Role.teacher)

RUNTIME_UID = 1000
"""The runtime image's user (images/runtime/Dockerfile)."""
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": RUNTIME_UID,
    "runAsGroup": RUNTIME_UID,
    # Mounted volumes (checkpoint PVCs) become writable by the runtime's group.
    "fsGroup": RUNTIME_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""Pod Security Standards "restricted", merged under spec.securityContext."""
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
"""Pod Security Standards "restricted" plus a read-only root, merged under
spec.containerSecurityContext."""
SCRATCH_DIR = "/tmp"
"""The writable emptyDir of every pod; HOME points here, so every cache (HF, vLLM, torch,
triton) lands in it while the root filesystem stays read-only."""


@dataclass(frozen=True)
class PodSlot:
    """One pod the spec asks for."""

    role: Role
    replica: int
    teacher: str | None = None

    @property
    def group(self) -> str:
        return group_name(self.role, self.teacher)

    def pod_name(self, job: str) -> str:
        if self.role is Role.teacher:
            return f"{job}-teacher-{self.teacher}-{self.replica}"
        return f"{job}-{self.role.value}-{self.replica}"

    def hostname(self, job: str) -> str:
        if self.role is Role.teacher:
            return f"{self.teacher}-{self.replica}"
        return self.pod_name(job)

    def subdomain(self, job: str) -> str:
        return service_name(job, self.role, self.teacher)


TEACHER_GROUP_PREFIX = f"{Role.teacher.value}/"


def group_name(role: Role, teacher: str | None) -> str:
    """Status key of a pod's role group: trainer, rollout or teacher/<name>."""
    return f"{TEACHER_GROUP_PREFIX}{teacher}" if role is Role.teacher else role.value


def service_name(job: str, role: Role, teacher: str | None = None) -> str:
    return f"{job}-t-{teacher}" if role is Role.teacher else f"{job}-{role.value}"


def config_map_name(job: str) -> str:
    return f"{job}-config"


def pod_dns(job: str, namespace: str, slot: PodSlot) -> str:
    return f"{slot.hostname(job)}.{slot.subdomain(job)}.{namespace}.svc"


def slots(spec: DistillationJobSpec) -> list[PodSlot]:
    """Every pod of the job, trainer first (rank order), then rollout, then each teacher."""
    out = [PodSlot(Role.trainer, i) for i in range(spec.trainer.replicas)]
    out += [PodSlot(Role.rollout, i) for i in range(spec.rollout.replicas)]
    for t in spec.teachers:
        out += [PodSlot(Role.teacher, i, t.name) for i in range(t.replicas)]
    return out


def groups(spec: DistillationJobSpec) -> dict[str, int]:
    """Desired pods per role group (trainer, rollout, teacher/<name>)."""
    out: dict[str, int] = {}
    for s in slots(spec):
        out[s.group] = out.get(s.group, 0) + 1
    return out


def endpoints(job: str, namespace: str, spec: DistillationJobSpec) -> Endpoints:
    def url(slot: PodSlot) -> str:
        return f"http://{pod_dns(job, namespace, slot)}:{Ports.HTTP}"

    trainer0 = PodSlot(Role.trainer, 0)
    return Endpoints(
        trainer=url(trainer0),
        master_addr=pod_dns(job, namespace, trainer0),
        rollout=[url(PodSlot(Role.rollout, i)) for i in range(spec.rollout.replicas)],
        teachers={t.name: [url(PodSlot(Role.teacher, i, t.name)) for i in range(t.replicas)] for t in spec.teachers},
    )


def job_config(job: str, namespace: str, spec: DistillationJobSpec) -> JobConfig:
    return JobConfig(job=job, namespace=namespace, spec=spec, endpoints=endpoints(job, namespace, spec))


def labels(job: str, role: Role | str, replica: int | str, teacher: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "kubedistill",
        "app.kubernetes.io/managed-by": "kubedistill-operator",
        LABEL_JOB: job,
        LABEL_ROLE: role.value if isinstance(role, Role) else role,
        LABEL_REPLICA: str(replica),
    }
    if teacher is not None:
        out[LABEL_TEACHER] = teacher
    return out


def _meta(name: str, namespace: str, lbl: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": lbl}


def render_config_map(job: str, namespace: str, spec: DistillationJobSpec) -> dict[str, Any]:
    cfg = job_config(job, namespace, spec)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(config_map_name(job), namespace, labels(job, SHARED_ROLE, ALL_REPLICAS)),
        "data": {CONFIG_KEY: cfg.model_dump_json(by_alias=True, exclude_none=True)},
    }


def _service(job: str, namespace: str, role: Role, teacher: str | None) -> dict[str, Any]:
    ports = [{"name": "http", "port": Ports.HTTP, "targetPort": "http", "protocol": "TCP"}]
    if role is Role.trainer:
        ports += [
            {"name": "dist", "port": Ports.DIST, "targetPort": "dist", "protocol": "TCP"},
            {"name": "weight-sync", "port": Ports.WEIGHT_SYNC, "targetPort": "weight-sync", "protocol": "TCP"},
        ]
    selector = {LABEL_JOB: job, LABEL_ROLE: role.value}
    if teacher is not None:
        selector[LABEL_TEACHER] = teacher
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(service_name(job, role, teacher), namespace, labels(job, role, ALL_REPLICAS, teacher)),
        "spec": {
            # Headless: each pod gets <hostname>.<service> and the ranks rendezvous before Ready.
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": ports,
        },
    }


def render_services(job: str, namespace: str, spec: DistillationJobSpec) -> list[dict[str, Any]]:
    out = [_service(job, namespace, Role.trainer, None), _service(job, namespace, Role.rollout, None)]
    out += [_service(job, namespace, Role.teacher, t.name) for t in spec.teachers]
    return out


def render_network_policy(job: str, namespace: str) -> dict[str, Any]:
    """The job's pods reach each other on every port; pods labelled as scrapers (any namespace)
    reach only the HTTP port (metrics, health, trainer status); nothing else gets in.

    Every port, not the three named ones: those are only the rendezvous stores. NCCL's bootstrap
    and socket transport and gloo's pair connections listen on ports the OS picks, so a policy
    listing ports would let the ranks rendezvous and then hang on their first collective."""
    job_pods = {"podSelector": {"matchLabels": {LABEL_JOB: job}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, namespace, labels(job, SHARED_ROLE, ALL_REPLICAS)),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: job}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [job_pods]},
                {
                    "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {SCRAPER_LABEL: "true"}}}],
                    "ports": [{"protocol": "TCP", "port": Ports.HTTP}],
                },
            ],
        },
    }


def _overrides(spec: DistillationJobSpec, slot: PodSlot) -> RoleOverrides:
    return role_overrides(spec, slot.role, slot.teacher)


def _gpus(spec: DistillationJobSpec, slot: PodSlot) -> int:
    if slot.role is Role.trainer:
        return spec.gpus_of(spec.trainer.gpus_per_replica)
    if slot.role is Role.rollout:
        return spec.gpus_of(spec.rollout.gpus)
    return spec.gpus_of(spec.teacher(slot.teacher or "").gpus)


def _env_entry(e: EnvVar) -> dict[str, Any]:
    return e.model_dump(by_alias=True, exclude_none=True, mode="json")


def _env(job: str, namespace: str, spec: DistillationJobSpec, slot: PodSlot) -> list[dict[str, Any]]:
    """role_env (what a local process gets too), what only a pod has, then the user's variables."""
    trainer0 = PodSlot(Role.trainer, 0)
    identity = Identity(role=slot.role, replica=slot.replica, teacher=slot.teacher)
    shared = role_env(spec, job, namespace, identity, pod_dns(job, namespace, trainer0), Ports.DIST)
    env: dict[str, dict[str, Any]] = {k: {"name": k, "value": v} for k, v in shared.items()}

    def put(name: str, value: str) -> None:
        env[name] = {"name": name, "value": value}

    put("HOME", SCRATCH_DIR)
    put("KUBEDISTILL_CONFIG", CONFIG_PATH)
    put("KUBEDISTILL_TRAINER_SERVICE", f"{service_name(job, Role.trainer)}.{namespace}.svc")
    put("KUBEDISTILL_ROLLOUT_SERVICE", f"{service_name(job, Role.rollout)}.{namespace}.svc")
    env["KUBEDISTILL_POD_IP"] = {"name": "KUBEDISTILL_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    if slot.role is Role.trainer:
        # One pod = one node of the gang; it runs max(gpus, 1) ranks starting at RANK (torchrun
        # gives each of several its own RANK and LOCAL_RANK: role_command).
        per_pod = max(_gpus(spec, slot), 1)
        put("RANK", str(slot.replica * per_pod))
        put("NODE_RANK", str(slot.replica))
        put("LOCAL_WORLD_SIZE", str(per_pod))
    put("MASTER_ADDR", pod_dns(job, namespace, trainer0))
    put("MASTER_PORT", str(Ports.DIST))
    for e in user_env(spec, slot.role, slot.teacher):
        env[e.name] = _env_entry(e)
    return list(env.values())


def role_command(job: str, namespace: str, spec: DistillationJobSpec, slot: PodSlot) -> list[str]:
    """The pod's command. A trainer pod with several GPUs runs one rank per GPU: torchrun starts
    them (RANK, LOCAL_RANK, WORLD_SIZE per process), rendezvousing at trainer pod 0, and fails the
    pod when any rank fails, so the operator restarts the gang."""
    role = ["role", slot.role.value, "--config", CONFIG_PATH]
    per_pod = _gpus(spec, slot) if slot.role is Role.trainer else 0
    if per_pod <= 1:
        return ["kubedistill", *role]
    return [
        *torchrun_launcher(
            nodes=spec.trainer.replicas,
            per_node=per_pod,
            node_rank=slot.replica,
            master_addr=pod_dns(job, namespace, PodSlot(Role.trainer, 0)),
            master_port=Ports.DIST,
        ),
        "-m",
        "kubedistill.cli",
        *role,
    ]


def torchrun_launcher(nodes: int, per_node: int, node_rank: int, master_addr: str, master_port: int) -> list[str]:
    """torchrun with a static rendezvous: every pod knows the gang's size and its place in it."""
    return [
        "torchrun",
        f"--nnodes={nodes}",
        f"--nproc-per-node={per_node}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
    ]


def _resources(spec: DistillationJobSpec, slot: PodSlot) -> dict[str, Any]:
    over = _overrides(spec, slot).resources
    requests = dict(over.requests)
    limits = dict(over.limits)
    gpus = _gpus(spec, slot)
    if gpus > 0:
        requests[GPU_RESOURCE] = str(gpus)
        limits[GPU_RESOURCE] = str(gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def merged(base: dict[str, Any], over: dict[str, Any] | None) -> dict[str, Any]:
    """`over` deep-merged into `base`: nested objects merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in (over or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def _covered(path: str, mounts: list[dict[str, Any]]) -> bool:
    """Whether a user volumeMount holds `path`."""
    for m in mounts:
        root = str(m.get("mountPath", "")).rstrip("/")
        if root and (path == root or path.startswith(root + "/")):
            return True
    return False


def _scratch_volumes(spec: DistillationJobSpec, slot: PodSlot) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(volume, mount) pairs for what the runtime writes under a read-only root: the scratch
    directory, and on trainer pods the checkpoint path when no user volume holds it (the
    checkpoints then live as long as the pod, as they would on the container's own disk)."""
    out = [({"name": "scratch", "emptyDir": {}}, {"name": "scratch", "mountPath": SCRATCH_DIR})]
    ckpt = spec.checkpoint.path.rstrip("/") or "/"
    if (
        slot.role is Role.trainer
        and ckpt.startswith("/")
        and ckpt != SCRATCH_DIR
        and not ckpt.startswith(SCRATCH_DIR + "/")
        and not _covered(ckpt, spec.volume_mounts)
    ):
        out.append(({"name": "checkpoint", "emptyDir": {}}, {"name": "checkpoint", "mountPath": ckpt}))
    return out


def render_pod(job: str, namespace: str, spec: DistillationJobSpec, slot: PodSlot, attempt: int = 0) -> dict[str, Any]:
    lbl = labels(job, slot.role, slot.replica, slot.teacher)
    if slot.role is Role.trainer:
        lbl[LABEL_ATTEMPT] = str(attempt)
    scratch = _scratch_volumes(spec, slot)
    ports = [{"name": "http", "containerPort": Ports.HTTP, "protocol": "TCP"}]
    if slot.role is Role.trainer:
        ports += [
            {"name": "dist", "containerPort": Ports.DIST, "protocol": "TCP"},
            {"name": "weight-sync", "containerPort": Ports.WEIGHT_SYNC, "protocol": "TCP"},
        ]
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy.value,
        "command": role_command(job, namespace, spec, slot),
        "env": _env(job, namespace, spec, slot),
        "ports": ports,
        "volumeMounts": [
            {"name": "kubedistill-config", "mountPath": "/etc/kubedistill", "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *(mount for _, mount in scratch),
            *spec.volume_mounts,
        ],
        "resources": _resources(spec, slot),
        "securityContext": merged(CONTAINER_SECURITY_CONTEXT, spec.container_security_context),
    }
    if slot.role in SERVER_ROLES:
        # Servers load a model before they answer; the trainer is ready once it runs.
        container["readinessProbe"] = {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        }
    node_selector = {**spec.node_selector, **_overrides(spec, slot).node_selector}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the operator owns restarts (gang semantics)
        "hostname": slot.hostname(job),
        "subdomain": slot.subdomain(job),
        "enableServiceLinks": False,
        "securityContext": merged(POD_SECURITY_CONTEXT, spec.security_context),
        "containers": [container],
        "volumes": [
            {"name": "kubedistill-config", "configMap": {"name": config_map_name(job)}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            *(volume for volume, _ in scratch),
            *spec.volumes,
        ],
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if spec.tolerations:
        pod_spec["tolerations"] = list(spec.tolerations)
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    if spec.scheduler_name:
        pod_spec["schedulerName"] = spec.scheduler_name
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(slot.pod_name(job), namespace, lbl),
        "spec": pod_spec,
    }


def static_refs(job: str, spec: DistillationJobSpec) -> list[tuple[str, str]]:
    """(kind, name) of what render_static returns, without rendering it."""
    out = [("ConfigMap", config_map_name(job))]
    out += [("Service", service_name(job, Role.trainer)), ("Service", service_name(job, Role.rollout))]
    out += [("Service", service_name(job, Role.teacher, t.name)) for t in spec.teachers]
    return [*out, ("NetworkPolicy", job)]


def render_static(job: str, namespace: str, spec: DistillationJobSpec) -> list[dict[str, Any]]:
    """The children that live as long as the job: ConfigMap, Services, NetworkPolicy."""
    return [
        render_config_map(job, namespace, spec),
        *render_services(job, namespace, spec),
        render_network_policy(job, namespace),
    ]


def render_pods(job: str, namespace: str, spec: DistillationJobSpec, attempt: int = 0) -> list[dict[str, Any]]:
    return [render_pod(job, namespace, spec, s, attempt) for s in slots(spec)]


def render_children(job: str, namespace: str, spec: DistillationJobSpec, attempt: int = 0) -> list[dict[str, Any]]:
    """Every child of the job, in creation order (config and services before the pods)."""
    return [*render_static(job, namespace, spec), *render_pods(job, namespace, spec, attempt)]


def render_job_yaml(job_doc: dict[str, Any], namespace: str = "default") -> str:
    """`kubedistill render`: the children of a validated DistillationJob manifest as YAML."""
    from kubedistill.api import kubeyaml
    from kubedistill.api.job import DistillationJob

    job = DistillationJob.model_validate(job_doc)
    ns = job.metadata.namespace or namespace
    docs = render_children(job.metadata.name, ns, job.spec)
    # Round-trip through JSON so YAML gets plain types only.
    return kubeyaml.dump_all([json.loads(json.dumps(d)) for d in docs], sort_keys=False)


__all__ = [
    "API_VERSION",
    "KIND",
    "PodSlot",
    "render_children",
    "render_pods",
    "render_static",
    "static_refs",
    "slots",
    "groups",
]
