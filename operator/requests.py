"""The CPU and memory a pod requests when its role's overrides do not say.

Without requests a pod is BestEffort: the first evicted under node pressure, and placed with no
regard for the host memory its process needs. The rule, by role and GPU count (the operator
cannot see the model's size, which lives on a volume):

| role | per GPU | on device cpu |
| --- | --- | --- |
| trainer | 8 CPUs, 32Gi | 250m CPU, 2Gi |
| rollout, teacher | 4 CPUs, 16Gi | 250m CPU, 2Gi |

A trainer's rank 0 gathers the full model and its AdamW state into host memory when it saves a
checkpoint (16 bytes per parameter: a 4B student needs 64 GB); a vLLM server keeps its CPU swap
space and the weights it loads in host memory. Bigger students raise
`overrides.resources.requests.memory` (docs/operator.md#resources). Requests only: no limits, so
a burst above them uses what the node has free instead of being killed."""

from __future__ import annotations

from kubedistill.api.roleconfig import Role

PER_GPU: dict[Role, tuple[int, int]] = {Role.trainer: (8, 32), Role.rollout: (4, 16), Role.teacher: (4, 16)}
"""(CPUs, GiB of memory) per GPU of a pod, by role."""
CPU_POD = {"cpu": "250m", "memory": "2Gi"}
"""The requests of a pod on device cpu: a dev or CI job whose three pods must fit a 2-core node."""


def default_requests(role: Role, gpus: int) -> dict[str, str]:
    """The requests of a pod of `role` with `gpus` GPUs (0 on device cpu), before its overrides."""
    if gpus <= 0:
        return dict(CPU_POD)
    cpus, gib = (c * gpus for c in PER_GPU[role])
    return {"cpu": str(cpus), "memory": f"{gib}Gi"}
