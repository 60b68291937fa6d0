"""Engine-side pure logic: request checks, pause modes, dtype choice, checkpoint manifests,
vision-prompt plumbing, and the `kubedistill role` command's errors."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.engines.base import BadRequest, check_generate, check_score
from kubedistill.runtime.engines.vllm_engine import build_prompt, checkpoint_tensors, engine_env, resolve_dtype
from kubedistill.runtime.servers.rollout import pause_mode
from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling, ScoreRequest
from server_fixtures import job_config


def gen(prompt: Sequence[int], prefix: Sequence[int] = (), max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        prompt_token_ids=list(prompt),
        prefix_token_ids=list(prefix),
        sampling=Sampling(max_tokens=max_tokens),
    )


def test_generate_budget_counts_the_prefix_and_the_context_limit() -> None:
    assert check_generate(gen([1, 2], max_tokens=8), max_model_len=100, vocab_size=10) == 8
    assert check_generate(gen([1, 2], prefix=[3, 4, 5], max_tokens=8), 100, 10) == 5
    assert check_generate(gen([1] * 95, max_tokens=8), 100, 10) == 5
    with pytest.raises(BadRequest, match="limit \\(max_model_len\\) is 100"):
        check_generate(gen([1] * 98, prefix=[1, 1]), 100, 10)


def test_score_checks() -> None:
    check_score(ScoreRequest(token_ids=[1, 2, 3], prompt_len=2, top_k=2), 100, 10)
    with pytest.raises(BadRequest, match="top_k \\(11\\) exceeds the vocabulary size \\(10\\)"):
        check_score(ScoreRequest(token_ids=[1, 2, 3], prompt_len=2, top_k=11), 100, 10)
    with pytest.raises(BadRequest, match="token_ids has 3 tokens"):
        check_score(ScoreRequest(token_ids=[1, 2, 3], prompt_len=2), 2, 10)


def _spec(models: dict[str, Path], **kw: Any) -> DistillationJobSpec:
    """A one-rollout, one-teacher hf job (server_fixtures.job_config) with `kw` changed."""
    return job_config(
        models["student"],
        models["teacher"],
        engine="hf",
        rollout_urls=["http://x"],
        teacher_urls=["http://y"],
        weight_sync_port=1,
        **kw,
    ).spec


def test_pause_mode_follows_partial_rollout(tiny_models: dict[str, Path]) -> None:
    def spec(strategy: str | None) -> DistillationJobSpec:
        return _spec(tiny_models, partial_rollout=strategy)

    assert pause_mode(spec(None)) == "wait"
    assert pause_mode(spec("resume")) == "abort"
    assert pause_mode(spec("inflight")) == "keep"


def test_cpu_auto_dtype_is_float32() -> None:
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda") == "auto" and resolve_dtype("bfloat16", "cpu") == "bfloat16"


def test_kv_cache_env_only_on_cpu() -> None:
    assert engine_env("cpu", 3) == {"VLLM_CPU_KVCACHE_SPACE": "3"}
    assert engine_env("cuda", 3) == {} and engine_env("cpu", None) == {}


def test_checkpoint_tensors_drop_a_tied_lm_head(tiny_models: dict[str, Path]) -> None:
    names = checkpoint_tensors(str(tiny_models["student"]))
    assert "lm_head.weight" not in names
    assert names["model.embed_tokens.weight"] == [16, 128]
    assert names["model.layers.1.self_attn.q_proj.bias"] == [128]


def test_images_become_multi_modal_data() -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (255, 0, 0)).save(buf, format="PNG")
    prompt = build_prompt([1, 2, 3], [base64.b64encode(buf.getvalue()).decode()])
    assert prompt["prompt_token_ids"] == [1, 2, 3]
    (img,) = prompt["multi_modal_data"]["image"]
    assert img.size == (4, 3) and img.getpixel((0, 0)) == (255, 0, 0)
    assert "multi_modal_data" not in build_prompt([1])
    with pytest.raises(BadRequest, match="images\\[0\\] is not a base64-encoded image"):
        build_prompt([1], ["bm90IGFuIGltYWdl"])


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kubedistill.cli", *args], capture_output=True, text=True, timeout=120)


def test_role_command_errors_are_one_line(tmp_path: Path) -> None:
    r = run_cli("role", "rollout", "--config", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "no such file" in r.stderr
    (tmp_path / "bad.json").write_text('{"job": "x"}')
    r = run_cli("role", "teacher", "--config", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "spec" in r.stderr


def test_vllm_top_k_ids_and_gather_requests() -> None:
    from types import SimpleNamespace

    from kubedistill.runtime.engines.vllm_engine import gather_params, ranked_ids

    def lp(rank: int) -> SimpleNamespace:
        return SimpleNamespace(logprob=-float(rank), rank=rank)

    # The sampled token (id 9, rank 7) rides along in vLLM's dict; it is not among the 3 best.
    entry = {4: lp(2), 9: lp(7), 2: lp(1), 7: lp(3)}
    assert ranked_ids(entry, 3) == [2, 4, 7]
    assert ranked_ids(entry, 2) == [2, 4]
    rows = [[5, 6, 7], [8]]
    # V2 runner: exactly those ids, padded with -1, from the row predicting the first response token.
    assert gather_params(rows, prompt_len=4, top_k=2, v2_runner=True) == {
        "prompt_logprobs": 2,
        "prompt_logprob_token_ids": [[5, 6, 7], [8, -1, -1]],
        "prompt_logprob_start": 3,
    }
    # V1 runner (vLLM-CPU): the whole distribution, gathered by the server.
    assert gather_params(rows, prompt_len=4, top_k=2, v2_runner=False) == {"prompt_logprobs": -1}


def test_engines_return_as_many_log_probs_as_the_loss_needs(tiny_models: dict[str, Path]) -> None:
    from kubedistill.runtime.engines.factory import rollout_max_logprobs, teacher_max_logprobs

    forward, reverse, k3 = (_spec(tiny_models, loss_mode=m) for m in ("forwardKLTopK", "reverseKLTopK", "k3"))
    assert (rollout_max_logprobs(forward), teacher_max_logprobs(forward)) == (0, 4)  # topK 4
    assert (rollout_max_logprobs(reverse), teacher_max_logprobs(reverse)) == (4, -1)
    assert (rollout_max_logprobs(k3), teacher_max_logprobs(k3)) == (0, 0)  # the sampled token's only


def test_gather_ids_need_one_row_per_response_token() -> None:
    from pydantic import ValidationError

    ScoreRequest(token_ids=[1, 2, 3, 4], prompt_len=2, gather_ids=[[5], [6, 7]])
    with pytest.raises(ValidationError, match="gather_ids: 1 rows, expected one per response token \\(2\\)"):
        ScoreRequest(token_ids=[1, 2, 3, 4], prompt_len=2, gather_ids=[[5]])
    with pytest.raises(ValidationError, match="1 to 256 ids"):
        ScoreRequest(token_ids=[1, 2, 3], prompt_len=2, gather_ids=[[]])
    with pytest.raises(BadRequest, match="gather_ids"):
        check_score(ScoreRequest(token_ids=[1, 2, 3], prompt_len=2, top_k=2, gather_ids=[[12]]), 100, 10)
    with pytest.raises(BadRequest, match="top_k_ids \\(11\\) exceeds"):
        check_generate(GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=Sampling(top_k_ids=11)), 100, 10)
