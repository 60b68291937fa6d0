"""The children of a DistillationJob, as a pure function of its name, namespace and spec.

The operator creates exactly these objects and `kubedistill render FILE` prints them, so what a
user previews is what the cluster gets. Owner references are added by the operator (kopf.adopt)
because they need the live object's uid.

Naming (job names are at most 40 characters, teacher and environment names at most 20, so every
Service name and pod hostname stays a 63-character DNS label):

  ConfigMap      <job>-config                 key config.json (kubedistill.api.roleconfig.JobConfig)
  Service        <job>-trainer                headless, the trainer gang's rendezvous
  Service        <job>-rollout                headless, one DNS name per rollout pod
  Service        <job>-t-<teacher>            headless, one DNS name per teacher pod
  NetworkPolicy  <job>                        only the job's pods (and labelled scrapers) get in
  Pod            <job>-trainer-<i>            hostname <job>-trainer-<i>, subdomain <job>-trainer
  Pod            <job>-rollout-<i>            hostname <job>-rollout-<i>, subdomain <job>-rollout
  Pod            <job>-teacher-<teacher>-<i>  hostname <teacher>-<i>,    subdomain <job>-t-<teacher>
  Service        <job>-e-<env>                headless, one DNS name per environment pod (its own port)
  Pod            <job>-env-<env>-<i>          hostname <env>-<i>,        subdomain <job>-e-<env>
  PodGroup       <job>                        gangScheduler volcano or coscheduling only
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
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
from kubedistill.api.spec import ClaimRetention, DistillationJobSpec, EnvVar, GangScheduler, RoleOverrides
from kubedistill.operator.requests import default_requests
from kubedistill.operator.volumes import (
    SCRATCH_DIR,
    checkpoint_claim_name,
    provisions_checkpoint_claim,
    scratch_volumes,
    user_volumes,
)

LABEL_JOB = "kubedistill.io/job"
LABEL_ROLE = "kubedistill.io/role"
LABEL_REPLICA = "kubedistill.io/replica"
LABEL_TEACHER = "kubedistill.io/teacher"
LABEL_ENVIRONMENT = "kubedistill.io/environment"
LABEL_ATTEMPT = "kubedistill.io/attempt"
"""Pods of the gang (the trainer pods; every pod with gangScheduler kueue): the gang attempt
(status.restarts + status.disruptions when the pod was made)."""
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
SERVER_ROLES = (Role.rollout, Role.teacher, Role.environment)
"""Roles whose pods serve HTTP and are ready once /health answers; each is replaced alone when it
fails (operator/running.py), never restarting the trainer gang."""

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

# Gang schedulers: the keys each project reads (Kueue plain pod groups, Volcano, scheduler-plugins).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_ROLE_HASH_ANNOTATION = "kueue.x-k8s.io/role-hash"
"""Kueue groups a pod group's pods into PodSets by a hash of each pod's shape, which our per-pod
labels and env (replica, rank) would make unique per pod; naming the role keeps one PodSet per
role (Kueue allows at most 8)."""
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_SCHEDULER = "volcano"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
POD_GROUP_API = {
    GangScheduler.volcano: "scheduling.volcano.sh/v1beta1",
    GangScheduler.coscheduling: "scheduling.x-k8s.io/v1alpha1",
}
"""apiVersion of the PodGroup each gang scheduler reads."""


@dataclass(frozen=True)
class PodSlot:
    """One pod the spec asks for."""

    role: Role
    replica: int
    teacher: str | None = None
    environment: str | None = None

    @property
    def name(self) -> str | None:
        """The teacher's or environment's name; None for trainer and rollout pods."""
        return self.environment if self.role is Role.environment else self.teacher

    @property
    def group(self) -> str:
        return group_name(self.role, self.name)

    def pod_name(self, job: str) -> str:
        if self.role is Role.teacher:
            return f"{job}-teacher-{self.teacher}-{self.replica}"
        if self.role is Role.environment:
            return f"{job}-env-{self.environment}-{self.replica}"
        return f"{job}-{self.role.value}-{self.replica}"

    def hostname(self, job: str) -> str:
        if self.role in NAMED_ROLES:
            return f"{self.name}-{self.replica}"
        return self.pod_name(job)

    def subdomain(self, job: str) -> str:
        return service_name(job, self.role, self.name)


NAMED_ROLES = (Role.teacher, Role.environment)
"""Roles with several named groups (spec.teachers[], spec.environments[])."""
TEACHER_GROUP_PREFIX = f"{Role.teacher.value}/"
ENVIRONMENT_GROUP_PREFIX = f"{Role.environment.value}/"


def group_name(role: Role, name: str | None) -> str:
    """Status key of a pod's role group: trainer, rollout, teacher/<name> or environment/<name>."""
    return f"{role.value}/{name}" if role in NAMED_ROLES else role.value


def service_name(job: str, role: Role, name: str | None = None) -> str:
    if role is Role.teacher:
        return f"{job}-t-{name}"
    if role is Role.environment:
        return f"{job}-e-{name}"
    return f"{job}-{role.value}"


def config_map_name(job: str) -> str:
    return f"{job}-config"


def pod_group_name(job: str) -> str:
    """The Volcano or coscheduling PodGroup: one per job, kept across gang attempts (the running
    servers count toward minMember while a new trainer gang is placed)."""
    return job


def kueue_group_name(job: str, attempt: int) -> str:
    """Kueue's pod group (one Workload) of one gang attempt: a new attempt is queued afresh, so
    the old attempt's quota is released when its pods are gone."""
    return f"{job}-attempt-{attempt}"


def in_gang(spec: DistillationJobSpec, role: Role) -> bool:
    """Whether a role's pods restart with the trainer gang. With Kueue the whole job is one pod
    group per attempt, so every pod belongs to the attempt; otherwise only the trainers."""
    return role is Role.trainer or spec.scheduling.gang_scheduler is GangScheduler.kueue


def pod_dns(job: str, namespace: str, slot: PodSlot) -> str:
    return f"{slot.hostname(job)}.{slot.subdomain(job)}.{namespace}.svc"


def slots(spec: DistillationJobSpec) -> list[PodSlot]:
    """Every pod of the job, trainer first (rank order), then rollout, then each teacher, then
    each environment."""
    out = [PodSlot(Role.trainer, i) for i in range(spec.trainer.replicas)]
    out += [PodSlot(Role.rollout, i) for i in range(spec.rollout.replicas)]
    for t in spec.teachers:
        out += [PodSlot(Role.teacher, i, t.name) for i in range(t.replicas)]
    for e in spec.environments:
        out += [PodSlot(Role.environment, i, environment=e.name) for i in range(e.replicas)]
    return out


def groups(spec: DistillationJobSpec) -> dict[str, int]:
    """Desired pods per role group (trainer, rollout, teacher/<name>)."""
    out: dict[str, int] = {}
    for s in slots(spec):
        out[s.group] = out.get(s.group, 0) + 1
    return out


def server_url(job: str, namespace: str, slot: PodSlot, port: int = Ports.HTTP) -> str:
    """The base URL of a pod's HTTP server, as the job's config (and so the trainer) names it
    (an environment's listens on its own spec port)."""
    return f"http://{pod_dns(job, namespace, slot)}:{port}"


def http_port(spec: DistillationJobSpec, role: Role, name: str | None = None) -> int:
    """The port a pod of `role` serves HTTP on: Ports.HTTP, or an environment's spec port."""
    return spec.environment(name or "").port if role is Role.environment else Ports.HTTP


def rollout_selector(job: str) -> str:
    """Label selector of the job's rollout pods (status.rolloutSelector, the scale subresource's)."""
    return f"{LABEL_JOB}={job},{LABEL_ROLE}={Role.rollout.value}"


def endpoints(job: str, namespace: str, spec: DistillationJobSpec) -> Endpoints:
    def url(slot: PodSlot) -> str:
        return server_url(job, namespace, slot)

    trainer0 = PodSlot(Role.trainer, 0)
    return Endpoints(
        trainer=url(trainer0),
        master_addr=pod_dns(job, namespace, trainer0),
        rollout=[url(PodSlot(Role.rollout, i)) for i in range(spec.rollout.replicas)],
        teachers={t.name: [url(PodSlot(Role.teacher, i, t.name)) for i in range(t.replicas)] for t in spec.teachers},
        environments={
            e.name: [
                server_url(job, namespace, PodSlot(Role.environment, i, environment=e.name), e.port)
                for i in range(e.replicas)
            ]
            for e in spec.environments
        },
    )


def job_config(job: str, namespace: str, spec: DistillationJobSpec) -> JobConfig:
    return JobConfig(job=job, namespace=namespace, spec=spec, endpoints=endpoints(job, namespace, spec))


def labels(job: str, role: Role | str, replica: int | str, name: str | None = None) -> dict[str, str]:
    """A child's labels; `name`: the teacher's (kubedistill.io/teacher) or the environment's
    (kubedistill.io/environment) of those roles' children."""
    out = {
        "app.kubernetes.io/name": "kubedistill",
        "app.kubernetes.io/managed-by": "kubedistill-operator",
        LABEL_JOB: job,
        LABEL_ROLE: role.value if isinstance(role, Role) else role,
        LABEL_REPLICA: str(replica),
    }
    if name is not None:
        out[LABEL_ENVIRONMENT if role is Role.environment else LABEL_TEACHER] = name
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


def _service(job: str, namespace: str, role: Role, name: str | None, port: int = Ports.HTTP) -> dict[str, Any]:
    ports = [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]
    if role is Role.trainer:
        ports += [
            {"name": "dist", "port": Ports.DIST, "targetPort": "dist", "protocol": "TCP"},
            {"name": "weight-sync", "port": Ports.WEIGHT_SYNC, "targetPort": "weight-sync", "protocol": "TCP"},
        ]
    selector = {LABEL_JOB: job, LABEL_ROLE: role.value}
    if name is not None:
        selector[LABEL_ENVIRONMENT if role is Role.environment else LABEL_TEACHER] = name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(service_name(job, role, name), namespace, labels(job, role, ALL_REPLICAS, name)),
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
    out += [_service(job, namespace, Role.environment, e.name, e.port) for e in spec.environments]
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
    return role_overrides(spec, slot.role, slot.name)


def _gpus(spec: DistillationJobSpec, slot: PodSlot) -> int:
    if slot.role is Role.trainer:
        return spec.gpus_of(spec.trainer.gpus_per_replica)
    if slot.role is Role.rollout:
        return spec.gpus_of(spec.rollout.gpus)
    if slot.role is Role.environment:
        return 0  # an environment server takes no GPU (its overrides.resources may ask for one)
    return spec.gpus_of(spec.teacher(slot.teacher or "").gpus)


def _env_entry(e: EnvVar) -> dict[str, Any]:
    return e.model_dump(by_alias=True, exclude_none=True, mode="json")


def _env(job: str, namespace: str, spec: DistillationJobSpec, slot: PodSlot) -> list[dict[str, Any]]:
    """role_env (what a local process gets too), what only a pod has, then the user's variables."""
    trainer0 = PodSlot(Role.trainer, 0)
    identity = Identity(role=slot.role, replica=slot.replica, teacher=slot.teacher, environment=slot.environment)
    shared = role_env(spec, job, namespace, identity, pod_dns(job, namespace, trainer0), Ports.DIST)
    env: dict[str, dict[str, Any]] = {k: {"name": k, "value": v} for k, v in shared.items()}

    def put(name: str, value: str) -> None:
        env[name] = {"name": name, "value": value}

    put("HOME", SCRATCH_DIR)
    if slot.role is Role.environment:
        # The user's server, not a kubedistill role: its port ($(PORT) in its command) and the
        # user's variables; it reads no config.
        put("PORT", str(http_port(spec, slot.role, slot.name)))
    else:
        put("KUBEDISTILL_CONFIG", CONFIG_PATH)
        put("KUBEDISTILL_TRAINER_SERVICE", f"{service_name(job, Role.trainer)}.{namespace}.svc")
        put("KUBEDISTILL_ROLLOUT_SERVICE", f"{service_name(job, Role.rollout)}.{namespace}.svc")
    env["KUBEDISTILL_POD_IP"] = {"name": "KUBEDISTILL_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    if slot.role is Role.environment:
        for e in user_env(spec, slot.role, slot.name):
            env[e.name] = _env_entry(e)
        return list(env.values())
    if slot.role is Role.trainer:
        # One pod = one node of the gang; it runs max(gpus, 1) ranks starting at RANK (torchrun
        # gives each of several its own RANK and LOCAL_RANK: role_command).
        per_pod = max(_gpus(spec, slot), 1)
        put("RANK", str(slot.replica * per_pod))
        put("NODE_RANK", str(slot.replica))
        put("LOCAL_WORLD_SIZE", str(per_pod))
    put("MASTER_ADDR", pod_dns(job, namespace, trainer0))
    put("MASTER_PORT", str(Ports.DIST))
    for e in user_env(spec, slot.role, slot.name):
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
    gpus = _gpus(spec, slot)
    requests = {**default_requests(slot.role, gpus), **over.requests}
    limits = dict(over.limits)
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


def render_pod(job: str, namespace: str, spec: DistillationJobSpec, slot: PodSlot, attempt: int = 0) -> dict[str, Any]:
    lbl = labels(job, slot.role, slot.replica, slot.name)
    if in_gang(spec, slot.role):
        lbl[LABEL_ATTEMPT] = str(attempt)
    scratch = scratch_volumes(job, spec, slot.role, slot.replica)
    volumes, mounts = user_volumes(spec, slot.role, slot.replica, slot.name)
    ports = [{"name": "http", "containerPort": http_port(spec, slot.role, slot.name), "protocol": "TCP"}]
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
            *mounts,
        ],
        "resources": _resources(spec, slot),
        "securityContext": merged(CONTAINER_SECURITY_CONTEXT, spec.container_security_context),
    }
    if slot.role is Role.environment:
        # The user's server in the user's image (spec.image unless its own); its command, else the
        # image's entrypoint. Kubernetes replaces $(PORT) in it with the variable _env sets.
        environment = spec.environment(slot.environment or "")
        container["image"] = environment.image or spec.image
        if environment.command:
            container["command"] = list(environment.command)
        else:
            del container["command"]
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
            *volumes,
        ],
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if spec.tolerations:
        pod_spec["tolerations"] = list(spec.tolerations)
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    annotations = _scheduling(job, spec, slot, attempt, lbl, pod_spec)
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    meta = _meta(slot.pod_name(job), namespace, lbl)
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def _scheduling(
    job: str, spec: DistillationJobSpec, slot: PodSlot, attempt: int, lbl: dict[str, str], pod_spec: dict[str, Any]
) -> dict[str, str]:
    """Put spec.scheduling on a pod (labels and pod spec in place); the pod's annotations."""
    sched = spec.scheduling
    annotations: dict[str, str] = {}
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    scheduler = sched.scheduler_name
    if sched.gang_scheduler is GangScheduler.kueue:
        lbl[KUEUE_QUEUE_LABEL] = sched.queue or ""
        lbl[KUEUE_GROUP_LABEL] = kueue_group_name(job, attempt)
        annotations[KUEUE_TOTAL_ANNOTATION] = str(len(slots(spec)))
        annotations[KUEUE_ROLE_HASH_ANNOTATION] = (
            slot.role.value if slot.name is None else f"{'e' if slot.role is Role.environment else 't'}-{slot.name}"
        )
    elif sched.gang_scheduler is GangScheduler.volcano:
        annotations[VOLCANO_GROUP_ANNOTATION] = pod_group_name(job)
        scheduler = scheduler or VOLCANO_SCHEDULER
    elif sched.gang_scheduler is GangScheduler.coscheduling:
        lbl[COSCHEDULING_GROUP_LABEL] = pod_group_name(job)
    if scheduler:
        pod_spec["schedulerName"] = scheduler
    return annotations


# Resource quantities, enough to sum pod requests into a PodGroup's minResources.
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes resource quantity ("8", "500m", "64Gi", "1e3") in base units."""
    q = text.strip()
    for suffix, power in _BINARY_SUFFIXES.items():
        if q.endswith(suffix):
            return _number(q[: -len(suffix)], text) * (Decimal(2) ** power)
    if q and q[-1] in _DECIMAL_SUFFIXES and not q[-1].isdigit():
        return _number(q[:-1], text) * (Decimal(10) ** _DECIMAL_SUFFIXES[q[-1]])
    return _number(q, text)


def _number(digits: str, text: str) -> Decimal:
    try:
        return Decimal(digits)
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)") from None


def format_quantity(value: Decimal) -> str:
    """An exact canonical form: binary suffixes from Mi up for whole multiples (memory), plain
    integers below (CPU and GPU counts), millis for fractions (Kubernetes rounds quantities up to
    the milli)."""
    if value != value.to_integral_value():
        return f"{int((value * 1000).to_integral_value(rounding='ROUND_CEILING'))}m"
    whole = int(value)
    for suffix, power in reversed(_BINARY_SUFFIXES.items()):
        if power >= 20 and whole and whole % (2**power) == 0:
            return f"{whole // 2**power}{suffix}"
    return str(whole)


def pod_requests(spec: DistillationJobSpec, slot: PodSlot) -> dict[str, Decimal]:
    """What the scheduler reserves for a pod: its requests, and limits where a resource has no
    request (the API server defaults the request to the limit)."""
    res = _resources(spec, slot)
    total = {k: parse_quantity(v) for k, v in res.get("limits", {}).items()}
    total.update({k: parse_quantity(v) for k, v in res.get("requests", {}).items()})
    return total


def min_member(spec: DistillationJobSpec) -> int:
    return spec.scheduling.min_member or len(slots(spec))


def min_resources(spec: DistillationJobSpec) -> dict[str, str]:
    """The requests of the first minMember pods (trainer first: the gang that must run), summed."""
    total: dict[str, Decimal] = {}
    for slot in slots(spec)[: min_member(spec)]:
        for name, amount in pod_requests(spec, slot).items():
            total[name] = total.get(name, Decimal(0)) + amount
    return {name: format_quantity(total[name]) for name in sorted(total)}


def render_pod_group(job: str, namespace: str, spec: DistillationJobSpec) -> dict[str, Any] | None:
    """The PodGroup of gangScheduler volcano or coscheduling (None for the others)."""
    sched = spec.scheduling
    api = POD_GROUP_API.get(sched.gang_scheduler)
    if api is None:
        return None
    body: dict[str, Any] = {"minMember": min_member(spec)}
    resources = min_resources(spec)
    if resources:
        body["minResources"] = resources
    if sched.gang_scheduler is GangScheduler.volcano:
        if sched.queue:
            body["queue"] = sched.queue
        if sched.priority_class_name:
            body["priorityClassName"] = sched.priority_class_name
    elif sched.schedule_timeout_seconds is not None:
        body["scheduleTimeoutSeconds"] = sched.schedule_timeout_seconds
    return {
        "apiVersion": api,
        "kind": "PodGroup",
        "metadata": _meta(pod_group_name(job), namespace, labels(job, SHARED_ROLE, ALL_REPLICAS)),
        "spec": body,
    }


def static_refs(job: str, spec: DistillationJobSpec) -> list[tuple[str, str]]:
    """(kind, name) of what render_static returns, without rendering it."""
    out = [("ConfigMap", config_map_name(job))]
    out += [("Service", service_name(job, Role.trainer)), ("Service", service_name(job, Role.rollout))]
    out += [("Service", service_name(job, Role.teacher, t.name)) for t in spec.teachers]
    out += [("Service", service_name(job, Role.environment, e.name)) for e in spec.environments]
    out.append(("NetworkPolicy", job))
    if provisions_checkpoint_claim(spec):
        out.append(("PersistentVolumeClaim", checkpoint_claim_name(job)))
    if spec.scheduling.gang_scheduler in POD_GROUP_API:
        out.append(("PodGroup", pod_group_name(job)))
    return out


RETAINED_ANNOTATION = "kubedistill.io/retained"
"""Set on a child the job must not own (a checkpoint claim with whenDeleted Retain): the operator
creates it without an owner reference, so the garbage collector leaves it when the job goes."""


def render_checkpoint_claim(job: str, namespace: str, spec: DistillationJobSpec) -> dict[str, Any] | None:
    """The checkpoint claim trainer pod 0 mounts at checkpoint.path (volumes.scratch_volumes), when
    no user volume holds that path. ReadWriteOnce: no other pod opens it."""
    if not provisions_checkpoint_claim(spec):
        return None
    c = spec.checkpoint.claim
    meta = _meta(checkpoint_claim_name(job), namespace, labels(job, SHARED_ROLE, ALL_REPLICAS))
    if c.when_deleted is ClaimRetention.retain:
        meta["annotations"] = {RETAINED_ANNOTATION: "true"}
    claim_spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": c.size}}}
    if c.storage_class_name is not None:
        claim_spec["storageClassName"] = c.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim_spec}


def owned_by_job(obj: Mapping[str, Any]) -> bool:
    """Whether a child gets the job's owner reference (and goes with the job)."""
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(RETAINED_ANNOTATION) != "true"


def render_static(job: str, namespace: str, spec: DistillationJobSpec) -> list[dict[str, Any]]:
    """The children that live as long as the job: ConfigMap, Services, NetworkPolicy, the
    checkpoint claim, and the PodGroup of a Volcano or coscheduling gang (before the pods: the
    scheduler needs it)."""
    out = [
        render_config_map(job, namespace, spec),
        *render_services(job, namespace, spec),
        render_network_policy(job, namespace),
    ]
    claim = render_checkpoint_claim(job, namespace, spec)
    if claim is not None:
        out.append(claim)
    group = render_pod_group(job, namespace, spec)
    if group is not None:
        out.append(group)
    return out


KEPT_CURRENT: dict[str, str] = {"ConfigMap": "data", "PodGroup": "spec"}
"""Static children whose content follows the spec while the job lives (kind -> the top-level
field the operator owns): the ConfigMap lists one endpoint per rollout replica, a PodGroup's
minMember and minResources count the pods. Both change with spec.rollout.replicas."""


def content_digest(kind: str, obj: Mapping[str, Any]) -> str:
    """A digest of the part of a KEPT_CURRENT child the operator owns, the same for the object it
    renders and the object the API server returns (field order ignored; the kind is passed, since
    objects in a list or watch may come without it)."""
    owned = obj.get(KEPT_CURRENT[kind])
    text = json.dumps(owned, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def render_kept_current(job: str, namespace: str, spec: DistillationJobSpec) -> list[dict[str, Any]]:
    """The KEPT_CURRENT children of the job (the ConfigMap, and the PodGroup if any)."""
    out = [render_config_map(job, namespace, spec)]
    group = render_pod_group(job, namespace, spec)
    if group is not None:
        out.append(group)
    return out


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
