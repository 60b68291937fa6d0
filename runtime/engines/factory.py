"""Pick the engine a server runs from the spec (inference.engine: vllm | hf)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kubedistill.api.losses import active_contract
from kubedistill.api.spec import Device, DistillationJobSpec, InferenceSpec, LoraServeAs, ModelSpec, TeacherSpec
from kubedistill.api.spec import Engine as EngineKind
from kubedistill.runtime.engines.base import Engine
from kubedistill.runtime.weight_sync.group import local_cuda_device


def hf_engine_device(device: Device, env: Mapping[str, str]) -> str:
    """Where the hf engine computes: the CPU, or on a cuda job this process's GPU (a server pod
    sees its own GPU as cuda:0)."""
    return local_cuda_device(env) if device is Device.cuda else "cpu"


def make_engine(
    spec: DistillationJobSpec, model: ModelSpec, inference: InferenceSpec, *, max_logprobs: int = 20
) -> Engine:
    if inference.engine is EngineKind.hf:
        from kubedistill.runtime.engines.hf import HFEngine

        return HFEngine(
            model.model,
            tokenizer=model.tokenizer,
            dtype=inference.dtype.value,
            max_model_len=inference.max_model_len,
            trust_remote_code=model.trust_remote_code,
            max_num_seqs=inference.max_num_seqs,
            device=hf_engine_device(spec.device, os.environ),
        )
    from kubedistill.runtime.engines.vllm_engine import VLLMEngine

    # The student's rollout engine serves the trainer's LoRA adapters unmerged when asked; a
    # teacher never (merged versions, like full weights, need nothing at start-up).
    lora = spec.trainer.lora if not isinstance(model, TeacherSpec) else None
    adapters = lora if lora is not None and lora.serve_as is LoraServeAs.adapter else None
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
        lora_rank=adapters.rank if adapters is not None else None,
        lora_target_modules=adapters.target_modules if adapters is not None else (),
    )


def rollout_max_logprobs(spec: DistillationJobSpec) -> int:
    """Log-probs a rollout engine returns per position at most: the student's top-k when the loss
    contract asks the rollout for it (the ids the teacher scores), else only the sampled token's."""
    d = spec.algorithm.distillation
    contract = active_contract(d)
    return contract.rollout_k(d.top_k) if contract is not None else 0


def teacher_max_logprobs(spec: DistillationJobSpec) -> int:
    """Log-probs a teacher engine returns per position at most: without limit (-1) when the loss
    contract has it gather the rollout's ids (vLLM's V1 runner can only gather arbitrary ids from
    the whole distribution: vllm_engine.gather_params), its top-k when the contract reads the
    teacher's top-k, else only the scored token's."""
    d = spec.algorithm.distillation
    contract = active_contract(d)
    if contract is not None and contract.teacher_gather:
        return -1
    return contract.teacher_k(d.top_k) if contract is not None else 0
