"""bench/gpu_check.sh, the check a borrowed GPU runs (docs/gpu.md): its dry run, which runs every
part at tiny shapes on the CPU with vLLM and Ray hidden, and the pure choices its GPU run and the
hf engine on a GPU rest on."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kubedistill.api.spec import Device
from kubedistill.runtime.engines.factory import hf_engine_device
from kubedistill.runtime.engines.hf import member_address
from kubedistill.runtime.weight_sync.group import GroupAddress

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def gpu_check_dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`bash bench/gpu_check.sh --dry-run`'s folder (report.json, work/, log.txt: its output)."""
    out = tmp_path_factory.mktemp("gpu-check-dry-run")
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    argv = ["bash", str(SCRIPT), "--dry-run", "--out", str(out / "report.json"), "--workdir", str(out / "work")]
    with open(out / "log.txt", "w") as log:
        subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    return out


@pytest.mark.standalone
def test_dry_run_passes_every_part_without_vllm_or_ray(gpu_check_dry_run: Path) -> None:
    tmp_path = gpu_check_dry_run
    log = (tmp_path / "log.txt").read_text()
    assert log.strip().splitlines()[-1].startswith("gpu_check: PASSED"), log[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    parts = report["parts"]
    assert report["ok"] and set(parts) == {"text", "lora", "vl", "fixed", "delta", "fork"}, parts
    text = parts["text"]
    # The engine's samples trained on at once: the trainer's log-probs (bf16 compute) against the
    # engine's (float32) on the same weights, before and after a sync of the trained weights.
    tiny = _check_module().TINY
    for key in ("logprobs_lag0_before_sync", "logprobs_lag0_after_sync"):
        assert text[key]["tokens"] == tiny.gen_requests * tiny.gen_tokens
        assert text[key]["abs_mean"] < 0.02, text[key]
    assert text["group_backend"] == "gloo" and len(text["sync"]) == 2
    assert text["checksums"]["differ"] == 0 and text["checksums"]["compared"] > 10
    for name in ("text", "lora", "vl"):
        train = parts[name]["train"]
        assert len(train["step_seconds"]) == tiny.timed_steps and train["tokens_per_step"] > 0
    # LoRA trains only its adapters; the VL batch carried images of grid x grid patches.
    assert 0 < parts["lora"]["trainable_parameters"] < 100_000
    assert parts["vl"]["image_tokens_per_image"] == tiny.image_grid**2 // 4
    # The fixed costs: a step's wall time holds its compute; a sync's segments add up to it.
    fixed = parts["fixed"]
    assert 0 < fixed["train_step"]["compute_ms"] <= fixed["train_step"]["wall_ms"]
    sync = fixed["sync_ms"]
    assert sum(sync[k] for k in ("pause", "transfer", "load", "resume")) <= sync["total"] + 0.5
    # Delta syncs at lr 1e-6 left the server with the trainer's weights, bit for bit (in float32,
    # the dry run's engine dtype, every weight changes: the deltas carry whole tensors).
    delta = parts["delta"]
    assert delta["checksums_after_deltas"]["differ"] == 0 and len(delta["density"]) == tiny.small_steps
    assert 0 < delta["bytes_over_full"] <= 1.01 and delta["full_sync_ms"] > 0
    # A role forked from the zygote ran its first steps on the device, as a fresh one did.
    fork = parts["fork"]
    assert fork["forked_role_uses_device"] and fork["forked_role_s"] > 0 and fork["fresh_role_s"] > 0
    # The rollout server of the text part ran as its own process and is gone.
    assert (tmp_path / "work" / "text" / "rollout.log").is_file()


def test_unknown_parts_are_refused() -> None:
    out = _run("--dry-run", "--parts", "text,sound")
    allowed = "text, lora, vl, fixed, delta, fork"
    assert out.returncode == 2 and f"--parts: unknown ['sound'] (allowed: {allowed})" in out.stderr


def test_peak_and_flops() -> None:
    gc = _check_module()
    assert gc.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gc.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert gc.peak_bf16_tflops("NVIDIA GeForce RTX 4090") is None
    # One layer of width 4, 1 head of 4, 1 KV head, MLP 8, vocab 10: per token 2 x (4x12 + 16 + 96)
    # = 320 in the layer; attention 2 x 4 x n^2 per sample; the head 2 x 4 x 10 per response token.
    shape = gc.TextShape(vocab=10, hidden=4, intermediate=8, layers=1, heads=1, kv_heads=1, head_dim=4)
    assert gc.train_flops(shape, [3, 2], [1, 1]) == 3 * (320 * 5 + 8 * (9 + 4) + 80 * 2)


def test_hf_engine_device_follows_the_job() -> None:
    assert hf_engine_device(Device.cpu, {"LOCAL_RANK": "1"}) == "cpu"
    assert hf_engine_device(Device.cuda, {}) == "cuda:0"
    assert hf_engine_device(Device.cuda, {"LOCAL_RANK": "1"}) == "cuda:1"


def test_hf_engine_joins_nccl_on_its_own_gpu() -> None:
    gloo = GroupAddress("h", 1, 1, 2, "gloo")
    assert member_address(gloo, torch.device("cpu")) is gloo
    nccl = GroupAddress("h", 1, 1, 2, "nccl")
    assert member_address(nccl, torch.device("cuda", 1)).device == "cuda:1"
    assert member_address(nccl, torch.device("cuda")).device == "cuda:0"
    with pytest.raises(ValueError, match="needs the hf engine on a GPU; it runs on cpu"):
        member_address(nccl, torch.device("cpu"))
