"""The DistillationJob spec's enumerations, apart from the models so that the API's rules and the
loss contracts (kubedistill.api.rules, kubedistill.api.losses) read them without importing the
spec, which checks itself with those rules."""

from __future__ import annotations

from enum import Enum


class Mode(str, Enum):
    sync = "sync"
    one_step_off = "oneStepOff"
    fully_async = "fullyAsync"


class Device(str, Enum):
    cuda = "cuda"
    cpu = "cpu"


class Engine(str, Enum):
    vllm = "vllm"
    hf = "hf"


class DType(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class LossMode(str, Enum):
    k1 = "k1"
    k3 = "k3"
    forward_kl_top_k = "forwardKLTopK"
    reverse_kl_top_k = "reverseKLTopK"


class Advantage(str, Enum):
    grpo = "grpo"
    rloo = "rloo"
    group_mean = "groupMean"


class AdvantageBaseline(str, Enum):
    none = "none"
    batch_mean = "batchMean"


class ProximalPolicy(str, Enum):
    recompute = "recompute"
    current = "current"


class ImportanceLevel(str, Enum):
    token = "token"
    sequence = "sequence"


class ImportanceMode(str, Enum):
    truncate = "truncate"
    mask = "mask"
    none = "none"


class LossAggregation(str, Enum):
    token_mean = "tokenMean"
    seq_mean_token_mean = "seqMeanTokenMean"


class LrSchedule(str, Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class LoraServeAs(str, Enum):
    merged = "merged"
    adapter = "adapter"


class LoraExport(str, Enum):
    merged = "merged"
    adapter = "adapter"


class PartialRolloutStrategy(str, Enum):
    resume = "resume"
    inflight = "inflight"


class ResumePolicy(str, Enum):
    auto = "auto"
    never = "never"


class ClaimRetention(str, Enum):
    """What happens to the checkpoint claim the operator made when its job is deleted."""

    retain = "Retain"
    delete = "Delete"


class SyncBackend(str, Enum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


AUTO_DENSITY_THRESHOLD = 0.0625
"""weightSync.delta.densityThreshold's default and most in mode auto: auto sends changed positions as
indices only (2 bytes a change more than a mask's values), and past 1/16 changed a mask beats them
on bytes (runtime/weight_sync/delta.py)."""


class DeltaMode(str, Enum):
    auto = "auto"
    always = "always"
    never = "never"


class PullPolicy(str, Enum):
    always = "Always"
    if_not_present = "IfNotPresent"
    never = "Never"


class GangScheduler(str, Enum):
    none = "none"
    kueue = "kueue"
    volcano = "volcano"
    coscheduling = "coscheduling"


class EnvironmentProtocol(str, Enum):
    openenv = "openenv"
    """OpenEnv's HTTP protocol: POST /reset, POST /step, GET /health (openenv-core's servers)."""


class ObservationRole(str, Enum):
    tool = "tool"
    user = "user"


KUEUE_MAX_TEACHERS = 6
"""Kueue admits a plain pod group of at most 8 pod shapes: trainer, rollout and one per teacher."""
VLLM_GPU_MEMORY_UTILIZATION = 0.85
"""inference.gpuMemoryUtilization's default: the only value engine hf (which has none) accepts."""


VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM accepts (vllm.config.lora.MaxLoRARanks). A rollout engine serving
adapters (spec.trainer.lora.serveAs adapter) starts with the smallest one at or above the rank."""
LORA_MAX_RANK = VLLM_MAX_LORA_RANKS[-1]
"""spec.trainer.lora.rank's bound: the largest rank vLLM serves as an adapter."""
ALL_LINEAR = "all-linear"
"""spec.trainer.lora.targetModules' shorthand (PEFT's): every linear layer but the output head."""
MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
"""A module's leaf name (q_proj, gate_proj, ...): the last component of its dotted name, which is
what a PEFT adapter_config.json lists and vLLM matches."""


def vllm_max_lora_rank(rank: int) -> int:
    """The max_lora_rank a vLLM engine serving adapters of this rank starts with."""
    for r in VLLM_MAX_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank}: vLLM serves adapters of rank {VLLM_MAX_LORA_RANKS[-1]} at most")


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"
