"""Pick the engine a server runs from the spec (inference.engine: vllm | hf)."""

from __future__ import annotations

from kubedistill.api.spec import DistillationJobSpec, InferenceSpec, LossMode, ModelSpec
from kubedistill.api.spec import Engine as EngineKind
from kubedistill.runtime.engines.base import Engine


def make_engine(
    spec: DistillationJobSpec, model: ModelSpec, inference: InferenceSpec, *, max_logprobs: int = 20
) -> Engine:
    if inference.engine is EngineKind.hf:
        from kubedistill.runtime.engines.hf import HFEngine

        return HFEngine(
            model.model,
            dtype=inference.dtype.value,
            max_model_len=inference.max_model_len,
            trust_remote_code=model.trust_remote_code,
            max_num_seqs=inference.max_num_seqs,
        )
    from kubedistill.runtime.engines.vllm_engine import VLLMEngine

    return VLLMEngine(
        model.model,
        tokenizer=model.tokenizer,
        device=spec.device.value,
        dtype=inference.dtype.value,
        max_model_len=inference.max_model_len,
        tensor_parallel_size=inference.tensor_parallel_size,
        gpu_memory_utilization=inference.gpu_memory_utilization,
        enforce_eager=inference.enforce_eager,
        kv_cache_gib=inference.kv_cache_gib,
        max_num_seqs=inference.max_num_seqs,
        max_logprobs=max_logprobs if max_logprobs < 0 else max(max_logprobs, 20),
        trust_remote_code=model.trust_remote_code,
    )


def rollout_max_logprobs(spec: DistillationJobSpec) -> int:
    """Log-probs a rollout engine returns per position at most: the student's top-k for lossMode
    reverseKLTopK (the ids the teacher scores), else only the sampled token's."""
    d = spec.algorithm.distillation
    return d.top_k if d.enabled and d.loss_mode is LossMode.reverse_kl_top_k else 0


def teacher_max_logprobs(spec: DistillationJobSpec) -> int:
    """Log-probs a teacher engine returns per position at most: its top-k, or for lossMode
    reverseKLTopK without limit (-1): vLLM's V1 runner can only gather arbitrary ids from the whole
    distribution (vllm_engine.gather_params)."""
    d = spec.algorithm.distillation
    return -1 if d.enabled and d.loss_mode is LossMode.reverse_kl_top_k else d.top_k
