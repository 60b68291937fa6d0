"""Engine-side pure logic: request checks, pause modes, dtype choice, checkpoint manifests,
vision-prompt plumbing, and the `kubedistill role` command's errors."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pytest

from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.engines.base import BadRequest, check_generate, check_score
from kubedistill.runtime.engines.vllm_engine import build_prompt, checkpoint_tensors, engine_env, resolve_dtype
from kubedistill.runtime.servers.rollout import pause_mode
from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling, ScoreRequest
from kubedistill.runtime.wire.rows import Rows
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
    rows = Rows.of([[5, 6, 7], [8]], "int32")
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

    def rows(ids: list[list[int]], dtype: Literal["int32", "float32"] = "int32") -> Rows:
        return Rows.of(ids, dtype)

    ScoreRequest(token_ids=[1, 2, 3, 4], prompt_len=2, gather_ids=rows([[5], [6, 7]]))
    with pytest.raises(ValidationError, match="gather_ids: 1 rows, expected one per response token \\(2\\)"):
        ScoreRequest(token_ids=[1, 2, 3, 4], prompt_len=2, gather_ids=rows([[5]]))
    with pytest.raises(ValidationError, match="1 to 256 ids"):
        ScoreRequest(token_ids=[1, 2, 3], prompt_len=2, gather_ids=rows([[]]))
    with pytest.raises(ValidationError, match="1 to 256 ids"):
        ScoreRequest(token_ids=[1, 2, 3, 4], prompt_len=2, gather_ids=rows([[5], []]))
    with pytest.raises(ValidationError, match="token ids are int32"):
        ScoreRequest(token_ids=[1, 2, 3], prompt_len=2, gather_ids=rows([[5]], "float32"))
    with pytest.raises(ValidationError, match="token ids are >= 0"):
        ScoreRequest(token_ids=[1, 2, 3], prompt_len=2, gather_ids=rows([[-5]]))
    with pytest.raises(BadRequest, match="gather_ids"):
        check_score(ScoreRequest(token_ids=[1, 2, 3], prompt_len=2, top_k=2, gather_ids=rows([[12]])), 100, 10)
    with pytest.raises(BadRequest, match="top_k_ids \\(11\\) exceeds"):
        check_generate(GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=Sampling(top_k_ids=11)), 100, 10)


def test_vllm_engine_arguments_on_cuda_and_cpu() -> None:
    """What a GPU server starts vLLM with, decided where CI can see it: CUDA graphs on unless
    asked off, one process per TP rank only with tensor parallelism; eager always on CPU."""
    from kubedistill.runtime.engines.vllm_engine import WORKER_EXTENSION, engine_kwargs

    def args(device: str, tp: int = 1, eager: bool = False) -> dict[str, Any]:
        return engine_kwargs(
            "/m",
            device=device,
            dtype="auto",
            max_model_len=None,
            tensor_parallel_size=tp,
            gpu_memory_utilization=0.85,
            enforce_eager=eager,
            max_logprobs=20,
            trust_remote_code=False,
            seed=0,
            tokenizer=None,
        )

    gpu = args("cuda")
    assert (gpu["enforce_eager"], gpu["distributed_executor_backend"]) == (False, "uni")
    assert gpu["tokenizer"] == "/m" and gpu["worker_extension_cls"] == WORKER_EXTENSION
    assert args("cuda", tp=2)["distributed_executor_backend"] == "mp"
    assert args("cuda", eager=True)["enforce_eager"] is True
    assert args("cpu")["enforce_eager"] is True


def test_vllm_score_response_from_the_v1_and_v2_runners() -> None:
    """/score from vLLM's RequestOutput as each model runner fills it (vllm/outputs.py): V1 puts
    the gathered ids in each position's prompt_logprobs dict (the whole distribution), V2 returns
    prompt_token_id_logprobs, one row per response position, padded columns -inf."""
    from types import SimpleNamespace

    from kubedistill.runtime.engines.vllm_engine import score_response

    def lp(value: float, rank: int) -> SimpleNamespace:
        return SimpleNamespace(logprob=value, rank=rank)

    ids = [1, 5, 6, 7]  # prompt [1, 5], response [6, 7]
    req = ScoreRequest(token_ids=ids, prompt_len=2, top_k=1, gather_ids=Rows.of([[6, 9], [3]], "int32"))
    v1 = SimpleNamespace(
        prompt_token_ids=ids,
        prompt_logprobs=[
            None,
            {5: lp(-0.5, 1)},
            {6: lp(-0.1, 1), 9: lp(-3.0, 4), 2: lp(-2.0, 2)},
            {7: lp(-0.7, 2), 3: lp(-0.2, 1)},
        ],
    )
    got = score_response(v1, req, ids, v2=False)
    assert got.logprobs == [-0.1, -0.7]
    assert got.topk_ids.tolist() == [[6], [3]] and got.topk_ids.array().dtype == "<i4"
    assert got.topk_logprobs.array().ravel().tolist() == pytest.approx([-0.1, -0.2])  # float32 on the wire
    assert got.gather_logprobs is not None and got.gather_logprobs.lengths == [2, 1]
    assert sum(got.gather_logprobs.tolist(), []) == pytest.approx([-0.1, -3.0, -0.2])
    v2 = SimpleNamespace(
        prompt_token_ids=ids,
        prompt_logprobs=v1.prompt_logprobs,
        prompt_token_id_logprobs=[[-0.1, -3.0], [-0.2, float("-inf")]],
    )
    gathered = score_response(v2, req, ids, v2=True).gather_logprobs
    assert gathered is not None and sum(gathered.tolist(), []) == pytest.approx([-0.1, -3.0, -0.2])
    # An expansion that does not end in the response is refused rather than misread.
    wrong = SimpleNamespace(prompt_token_ids=[1, 5, 6, 8], prompt_logprobs=v1.prompt_logprobs)
    with pytest.raises(RuntimeError, match="scored other ids than the request's response"):
        score_response(wrong, req, ids, v2=False)


def test_vllm_worker_place_in_the_weight_sync_group() -> None:
    """Under tensor parallelism each worker is its server's first rank plus its TP rank, on its own
    GPU with NCCL; gloo needs no device; an unknown TP rank is refused where TP > 1."""
    import torch

    from kubedistill.runtime.engines.vllm_worker import worker_member

    assert worker_member(3, 1, 2, "nccl", torch.device("cuda", 1)) == (4, "cuda:1")
    assert worker_member(3, 0, 2, "nccl", "cuda:0") == (3, "cuda:0")
    assert worker_member(1, None, 1, "gloo", torch.device("cpu")) == (1, None)
    with pytest.raises(RuntimeError, match="cannot tell this worker's tensor-parallel rank"):
        worker_member(1, None, 2, "nccl", "cuda:0")
