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
    none = "none"


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


class LossAggregation(str, Enum):
    token_mean = "tokenMean"
    seq_mean_token_mean = "seqMeanTokenMean"


class LrSchedule(str, Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class PartialRolloutStrategy(str, Enum):
    resume = "resume"
    inflight = "inflight"


class ResumePolicy(str, Enum):
    auto = "auto"
    never = "never"


class SyncBackend(str, Enum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class PullPolicy(str, Enum):
    always = "Always"
    if_not_present = "IfNotPresent"
    never = "Never"


class GangScheduler(str, Enum):
    none = "none"
    kueue = "kueue"
    volcano = "volcano"
    coscheduling = "coscheduling"


KUEUE_MAX_TEACHERS = 6
"""Kueue admits a plain pod group of at most 8 pod shapes: trainer, rollout and one per teacher."""
