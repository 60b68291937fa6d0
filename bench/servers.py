"""Servers against their engines (CPU; not run in CI): what the rollout server's /generate and the
teacher server's /score deliver, as a share of what their engine delivers on its own, on the
same inputs and sampling, in one run.

On SmolLM2-135M-Instruct (tests/smollm.py), `--requests` chat-rendered arithmetic prompts:
  generate  /generate, all requests at once (temperature 1, ignore_eos, `--tokens` new tokens each,
            the sampled token's log-prob), against
              vllm: vLLM's own offline `LLM.generate` of the same prompts with the same
                    SamplingParams and engine arguments (the server's VLLMEngine kwargs);
              hf:   one batched HF `model.generate` of the same prompts (left-padded).
  score     /score of prompt + `--score-len` response tokens with top-k `--top-k`, all at once,
            against
              vllm: `LLM.generate` with `prompt_logprobs=top-k`, `max_tokens=1` on the same
                    sequences;
              hf:   one batched forward over the same (right-padded) sequences, log-softmax and
                    top-k.
The reference runs in its own process and each server is a real `kubedistill role rollout|teacher`
process started with a job config (one at a time). By default the engine side (the reference
process, or the server with its engine processes) is pinned to CPU 1 and this process, the HTTP
client that the driver is in a job, to CPU 0: both sides get the same one core for the model.
Tokens/s count new tokens (generate) or scored response tokens (score); the median of `--repeats`
timed rounds after a warm-up round.

Last line: min(/generate ÷ reference, /score ÷ reference), the headline ratio (target ≥ 0.9).

    .venv/bin/python bench/servers.py [--quick] [--engine vllm|hf] [--no-pin]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # server_fixtures.Server: a role server as a process

ENGINE_CPU = 1
CLIENT_CPU = 0


def job_config(model: Path, engine: str, max_model_len: int, top_k: int, port: int) -> Any:
    """A one-rollout, one-teacher job on `model` (the spec both servers and the reference read)."""
    from kubedistill.api.roleconfig import Endpoints, JobConfig
    from kubedistill.api.spec import DistillationJobSpec

    inference = {"engine": engine, "maxModelLen": max_model_len, **({"kvCacheGiB": 1} if engine == "vllm" else {})}
    spec = {
        "device": "cpu",
        "mode": "sync",
        "student": {"model": str(model)},
        "teachers": [{"name": "teacher", "model": str(model), "inference": inference, "overrides": {"cpuThreads": 1}}],
        "rollout": {"replicas": 1, "inference": inference, "overrides": {"cpuThreads": 1}},
        "data": {"train": ["/dev/null"]},
        "algorithm": {"distillation": {"topK": top_k, "lossMode": "forwardKLTopK"}},
    }
    url = f"http://127.0.0.1:{port}"
    return JobConfig(
        job="bench-servers",
        spec=DistillationJobSpec.model_validate(spec),
        endpoints=Endpoints(
            trainer="http://127.0.0.1:1",
            master_addr="127.0.0.1",
            weight_sync_port=1,
            rollout=[url],
            teachers={"teacher": [url]},
        ),
    )


def engine_env() -> dict[str, str]:
    """What the servers' processes see (bench/_common, tests/server_fixtures): one thread each."""
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )


def inputs(model: Path, requests: int, score_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (chat-rendered arithmetic problems) and the sequences to score: each prompt followed
    by `score_len` seeded random ids from the vocabulary's first 10,000 (ordinary tokens)."""
    from transformers import AutoTokenizer

    from kubedistill.demo import arith

    tok = AutoTokenizer.from_pretrained(str(model))
    problems = arith.split()[0][:requests]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True, tokenize=False)
        for p in problems
    ]
    prompts = [list(tok(t, add_special_tokens=False).input_ids) for t in texts]
    rng = random.Random(0)
    seqs = [p + [rng.randrange(100, 10_000) for _ in range(score_len)] for p in prompts]
    return prompts, seqs


# --- references, in their own process ---------------------------------------------------------


def reference_vllm(
    cfg: Any, prompts: list[list[int]], seqs: list[list[int]], a: argparse.Namespace
) -> dict[str, list[float]]:
    """vLLM's offline LLM built with the servers' engine arguments (VLLMEngine.kwargs, environment
    as VLLMEngine.start sets it): `generate` of the prompts, then prompt-logprobs of the sequences."""
    import torch

    from kubedistill.runtime.engines.factory import make_engine, rollout_max_logprobs, teacher_max_logprobs
    from kubedistill.runtime.engines.vllm_engine import VLLMEngine, engine_env, resolve_dtype

    spec = cfg.spec
    engines = {
        "generate": make_engine(spec, spec.student, spec.rollout.inference, max_logprobs=rollout_max_logprobs(spec)),
        "score": make_engine(
            spec, spec.teachers[0], spec.teachers[0].inference, max_logprobs=teacher_max_logprobs(spec)
        ),
    }
    kwargs = {}
    for label, engine in engines.items():
        assert isinstance(engine, VLLMEngine)
        os.environ.update(engine_env("cpu", engine.kv_cache_gib))
        kw = dict(engine.kwargs, dtype=resolve_dtype(engine.kwargs["dtype"], "cpu"))
        kwargs[label] = {k: v for k, v in kw.items() if v is not None}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams, TokensPrompt

    out: dict[str, list[float]] = {"generate": [], "score": []}
    llm = None
    for label in ("generate", "score"):
        if llm is None or kwargs[label] != kwargs["generate"]:
            llm = None
            llm = LLM(**kwargs[label])
        if label == "generate":
            params = SamplingParams(
                n=1, max_tokens=a.tokens, temperature=1.0, top_p=1.0, logprobs=0, detokenize=False, ignore_eos=True
            )
            batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        else:
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=a.top_k)
            batch = [TokensPrompt(prompt_token_ids=s) for s in seqs]
        llm.generate(batch[:2], params, use_tqdm=False)  # warm-up
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            res = llm.generate(batch, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            if label == "generate":
                n = sum(len(r.outputs[0].token_ids) for r in res)
            else:
                n = sum(len(s) - len(p) for s, p in zip(seqs, prompts))
                assert all(r.prompt_logprobs is not None for r in res)
            out[label].append(n / dt)
    return out


def reference_hf(
    cfg: Any, prompts: list[list[int]], seqs: list[list[int]], a: argparse.Namespace
) -> dict[str, list[float]]:
    """A plain batched HF forward: `model.generate` of all prompts at once (left-padded), and one
    forward over all sequences (right-padded) with log-softmax and top-k."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = cfg.spec.student.model
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def padded(rows: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            sl = slice(width - len(r), width) if left else slice(0, len(r))
            ids[i, sl], mask[i, sl] = torch.tensor(r), 1
        return ids, mask

    def gen(rows: list[list[int]]) -> int:
        ids, mask = padded(rows, left=True)
        new = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=a.tokens,
            min_new_tokens=a.tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad,
            output_scores=True,
            return_dict_in_generate=True,
        )
        # The sampled token's log-prob, as /generate returns it.
        torch.stack(new.scores, 1).log_softmax(-1).gather(-1, new.sequences[:, ids.shape[1] :, None])
        return int(new.sequences[:, ids.shape[1] :].numel())

    def score(rows: list[list[int]]) -> int:
        ids, mask = padded(rows, left=False)
        lp = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
        lp[:, :-1].gather(-1, ids[:, 1:, None])
        lp.topk(a.top_k, dim=-1)
        return sum(len(s) - len(p) for s, p in zip(seqs, prompts))

    out: dict[str, list[float]] = {"generate": [], "score": []}
    with torch.no_grad():
        for label, fn, rows in (("generate", gen, prompts), ("score", score, seqs)):
            fn(rows[:2])
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                n = fn(rows)
                out[label].append(n / (time.perf_counter() - t0))
    return out


# --- the servers, over HTTP -------------------------------------------------------------------


async def serve_rates(
    role: str, cfg_path: Path, port: int, prompts: list[list[int]], seqs: list[list[int]], a: argparse.Namespace
) -> list[float]:
    from kubedistill.runtime.driver.clients import RolloutClient, TeacherClient
    from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling, ScoreRequest
    from server_fixtures import Server

    log = cfg_path.with_suffix(f".{role}.log")
    server = Server(role, cfg_path, port, log_path=log, cpus={ENGINE_CPU} if a.pin else None)
    try:
        await asyncio.to_thread(server.wait_healthy, 900.0)
        rates = []
        if role == "rollout":
            sampling = Sampling(max_tokens=a.tokens, temperature=1.0, ignore_eos=True)
            async with RolloutClient(server.url) as c:

                async def gen_round(rows: list[list[int]], tag: str) -> int:
                    outs = await asyncio.gather(
                        *(
                            c.generate(GenerateRequest(request_id=f"{tag}-{i}", prompt_token_ids=p, sampling=sampling))
                            for i, p in enumerate(rows)
                        )
                    )
                    return sum(len(o.token_ids) for o in outs)

                await gen_round(prompts[:2], "warm")
                for r in range(a.repeats):
                    t0 = time.perf_counter()
                    n = await gen_round(prompts, f"r{r}")
                    rates.append(n / (time.perf_counter() - t0))
        else:
            async with TeacherClient(server.url) as t:

                async def score_round(rows: list[tuple[list[int], list[int]]]) -> int:
                    outs = await asyncio.gather(
                        *(t.score(ScoreRequest(token_ids=s, prompt_len=len(p), top_k=a.top_k)) for s, p in rows)
                    )
                    return sum(len(o.logprobs) for o in outs)

                pairs = list(zip(seqs, prompts))
                await score_round(pairs[:2])
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    n = await score_round(pairs)
                    rates.append(n / (time.perf_counter() - t0))
        return rates
    finally:
        server.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests, one timed round")
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--requests", type=int, help="concurrent requests per round (default 64, quick 32)")
    ap.add_argument("--tokens", type=int, help="new tokens per /generate (default 128, quick 64)")
    ap.add_argument("--score-len", type=int, help="response tokens per /score (default 256, quick 128)")
    ap.add_argument("--top-k", type=int, default=16, help="teacher top-k per scored token")
    ap.add_argument("--repeats", type=int, help="timed rounds (default 3, quick 1); the median is used")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True, help="engine side CPU 1, client 0")
    ap.add_argument("--workdir", default=str(REPO / ".kubedistill/bench/servers"))
    ap.add_argument("--reference", metavar="CONFIG", help=argparse.SUPPRESS)  # internal: run the reference here
    a = ap.parse_args(argv)
    a.requests = a.requests or (32 if a.quick else 64)
    a.tokens = a.tokens or (64 if a.quick else 128)
    a.score_len = a.score_len or (128 if a.quick else 256)
    a.repeats = a.repeats or (1 if a.quick else 3)
    from kubedistill.api.roleconfig import JobConfig
    from smollm import smollm2_hf_dir

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = smollm2_hf_dir(work / "models")
    prompts, seqs = inputs(model, a.requests, a.score_len)
    max_len = max(len(s) for s in seqs) + a.tokens + 8

    if a.reference:
        cfg = JobConfig.load(Path(a.reference))
        run = reference_vllm if a.engine == "vllm" else reference_hf
        print("REFERENCE " + json.dumps(run(cfg, prompts, seqs, a)), flush=True)
        return 0

    if a.pin:
        os.sched_setaffinity(0, {CLIENT_CPU})
    port = free_port()
    cfg_path = work / f"job-{a.engine}.json"
    job_config(model, a.engine, max_len, a.top_k, port).dump(cfg_path)
    print(
        f"# SmolLM2-135M on {a.engine}: {a.requests} concurrent requests; /generate {a.tokens} new tokens "
        f"(temperature 1, ignore_eos), /score {a.score_len} response tokens with top-k {a.top_k}; prompts "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens; median of {a.repeats} round(s); "
        + ("engine side pinned to CPU 1, client to CPU 0" if a.pin else "unpinned"),
        flush=True,
    )

    t0 = time.time()
    argv_ref = [sys.executable, __file__, "--reference", str(cfg_path), "--engine", a.engine]
    argv_ref += ["--requests", str(a.requests), "--tokens", str(a.tokens), "--score-len", str(a.score_len)]
    argv_ref += ["--top-k", str(a.top_k), "--repeats", str(a.repeats), "--workdir", str(work)]
    ref_log = work / f"reference-{a.engine}.log"
    with open(ref_log, "wb") as log:
        subprocess.run(
            argv_ref,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=engine_env(),
            check=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, {ENGINE_CPU})) if a.pin else None,
        )
    line = next(x for x in ref_log.read_text().splitlines() if x.startswith("REFERENCE "))
    ref = json.loads(line.removeprefix("REFERENCE "))
    print(f"reference ({time.time() - t0:.0f} s): {json.dumps({k: [round(x) for x in v] for k, v in ref.items()})}")
    srv: dict[str, list[float]] = {}
    for label, role in (("generate", "rollout"), ("score", "teacher")):
        t0 = time.time()
        srv[label] = asyncio.run(serve_rates(role, cfg_path, port, prompts, seqs, a))
        print(f"/{label} server ({time.time() - t0:.0f} s): {[round(x) for x in srv[label]]}", flush=True)

    ref_name = {
        "vllm": ("vLLM offline LLM.generate", "vLLM LLM.generate prompt_logprobs"),
        "hf": ("HF batched generate", "HF batched forward"),
    }[a.engine]
    ratios = {}
    print()
    print(f"{'':10s} {'server tokens/s':>16s} {'reference tokens/s':>19s} {'ratio':>6s}  reference")
    for label, name in zip(("generate", "score"), ref_name):
        s, r = statistics.median(srv[label]), statistics.median(ref[label])
        ratios[label] = s / r
        print(f"/{label:9s} {s:16.1f} {r:19.1f} {s / r:6.2f}  {name}")
    print(f"/generate ÷ reference: {ratios['generate']:.2f} (target ≥ 0.9)")
    print(f"/score ÷ reference: {ratios['score']:.2f} (target ≥ 0.9)")
    print(f"server ÷ engine tokens/s, min of /generate and /score ({a.engine}): {min(ratios.values()):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
