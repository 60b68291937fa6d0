"""How `kubedistill run` fits a job's roles on fewer GPUs than they ask for (one GPU for trainer,
rollout and teacher, as bench/gpu_smoke.sh does): the launcher places each role process with a fraction
of a GPU, each vLLM server is held to a share of the GPU's memory so the trainer keeps the rest,
and processes in one NCCL group get distinct NCCL host ids, since NCCL refuses two ranks on the
same GPU ("Duplicate GPU detected") unless they look like different hosts (it then connects them
through its socket transport, over loopback), and servers sharing a GPU start one after the other
(start_waves). Pure: the caller applies the plan."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from kubedistill.api.roleconfig import Role

SERVER_MEMORY_SHARE = 0.9
"""Of a process's share of a GPU, what a vLLM server may take (gpu_memory_utilization): the rest
is headroom for CUDA contexts and the allocator."""


class GpuDemand(BaseModel):
    """One role process and the GPUs it asks for."""

    model_config = ConfigDict(frozen=True)
    name: str
    role: Role
    gpus: int


class GpuShare(BaseModel):
    """What a process gets: its share of GPUs (Ray's num_gpus), for a vLLM server its memory share, extra env."""

    model_config = ConfigDict(frozen=True)
    num_gpus: float
    memory_utilization: float | None = None
    env: dict[str, str] = {}


def share_gpus(demands: Sequence[GpuDemand], available: int, nccl: bool) -> dict[str, GpuShare]:
    """Each process's share when `available` GPUs must hold them all. Nothing changes when they
    fit. Otherwise every GPU process must ask for exactly one GPU (a tensor-parallel server or a
    multi-GPU trainer cannot be split), and up to k = ceil(n / available) of them share a GPU:
    num_gpus 1/k (rounded down, so k of them fit), a server gpu_memory_utilization 0.9/k."""
    gpu_procs = [d for d in demands if d.gpus > 0]
    wanted = sum(d.gpus for d in gpu_procs)
    if wanted <= available:
        return {d.name: GpuShare(num_gpus=d.gpus) for d in demands}
    if available < 1:
        raise ValueError(
            f"the job asks for {wanted} GPUs and this machine (or Ray cluster) has none; "
            "run on a GPU machine or use device: cpu"
        )
    multi = [d for d in gpu_procs if d.gpus > 1]
    if multi:
        raise ValueError(
            f"the job asks for {wanted} GPUs and {available} are here: only single-GPU roles can share one, "
            f"but {multi[0].name} asks for {multi[0].gpus}"
        )
    per_gpu = math.ceil(len(gpu_procs) / available)
    fraction = math.floor(100 / per_gpu) / 100
    memory = math.floor(100 * SERVER_MEMORY_SHARE / per_gpu) / 100
    out: dict[str, GpuShare] = {}
    for d in demands:
        if d.gpus == 0:
            out[d.name] = GpuShare(num_gpus=0)
            continue
        env = {"NCCL_HOSTID": f"kubedistill-{d.name}", "NCCL_NET": "Socket"} if nccl else {}
        server = d.role in (Role.rollout, Role.teacher)
        out[d.name] = GpuShare(num_gpus=fraction, memory_utilization=memory if server else None, env=env)
    return out


class Started(BaseModel):
    """One process as the launcher starts it: its role and its share of a GPU."""

    model_config = ConfigDict(frozen=True)
    name: str
    role: Role
    num_gpus: float


def start_waves(processes: Sequence[Started]) -> list[list[str]]:
    """The processes' names in waves: a wave starts once every server of the previous one answers
    /health. Environment servers (spec.environments) come first, in a wave of their own, so the
    trainer's first episode finds them up (they start in seconds: no model to load). vLLM sizes
    its KV cache from the GPU memory it finds free while it profiles, so servers sharing a GPU (a
    fraction of one each) start one after the other, each after the previous one is up; everything
    else (the trainer, servers with GPUs of their own or none, as on CPU) starts at once, in the
    first wave after the environments, in the order given."""
    environments = [p.name for p in processes if p.role is Role.environment]
    sharing = [p.name for p in processes if p.role in (Role.rollout, Role.teacher) and 0 < p.num_gpus < 1]
    first = [p.name for p in processes if p.name not in sharing[1:] and p.name not in environments]
    return [*([environments] if environments else []), first, *([name] for name in sharing[1:])]
