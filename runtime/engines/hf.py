"""transformers engine for small CPU runs and fast tests. Each request decodes token by token in
a worker thread (one forward step at a time under a lock, so concurrent requests interleave and
a pause or an abort takes effect between two tokens); weights load with `copy_`."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Mapping, Optional, Sequence

import torch

from kubedistill.runtime.engines.base import BadRequest, Engine, InFlight, PauseMode
from kubedistill.runtime.protocol import GenerateRequest, Manifest, ScoreRequest, ScoreResponse
from kubedistill.runtime.weight_sync.group import GroupAddress, WeightSyncGroup
from kubedistill.runtime.weight_sync.transfer import receive


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model_path: str, dtype: str = "auto", max_model_len: Optional[int] = None,
                 trust_remote_code: bool = False):
        super().__init__()
        self.model_path = model_path
        self.dtype = dtype
        self._max_model_len = max_model_len
        self.trust_remote_code = trust_remote_code
        self.model = None
        self.group: Optional[WeightSyncGroup] = None
        self._step = threading.Lock()  # one forward at a time
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._active = 0
        self._active_cv = threading.Condition()
        self._pause_mode: PauseMode = "wait"

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM

        dtype = "auto" if self.dtype == "auto" else getattr(torch, self.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=dtype, trust_remote_code=self.trust_remote_code
        ).eval()
        cfg = self.model.config
        limit = getattr(cfg, "max_position_embeddings", None) or 2048
        self._max_model_len = min(self._max_model_len or limit, limit)
        self._params = dict(self.model.named_parameters())

    async def shutdown(self) -> None:
        self.model = None

    @property
    def max_model_len(self) -> int:
        return int(self._max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    # --- generation -------------------------------------------------------------------------
    async def _generate(self, req: GenerateRequest, max_new: int, state: InFlight) -> str:
        return await asyncio.to_thread(self._decode, req, max_new, state)

    def _enter(self) -> None:
        self._running.wait()
        with self._active_cv:
            self._active += 1

    def _leave(self) -> None:
        with self._active_cv:
            self._active -= 1
            self._active_cv.notify_all()

    @torch.no_grad()
    def _decode(self, req: GenerateRequest, max_new: int, state: InFlight) -> str:
        s = req.sampling
        gen = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
        ids = torch.tensor([req.prompt_token_ids + req.prefix_token_ids])
        eos = set() if s.ignore_eos else self._eos_ids()
        self._enter()
        try:
            past = None
            for _ in range(max_new):
                if state.aborted:
                    return "abort"
                if not self._running.is_set() and self._pause_mode == "keep":
                    # Paused for a weight load ('keep'): let it proceed, continue afterwards.
                    self._leave()
                    self._enter()
                    if state.aborted:
                        return "abort"
                with self._step:
                    out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
                    version = self.version
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                token = _sample(logits, s.temperature, s.top_p, gen)
                logprob = torch.log_softmax(logits, -1)[token].item()
                state.token_ids.append(token)
                state.logprobs.append(logprob)
                state.versions.append(version)
                if token in eos:
                    return "stop"
                ids = torch.tensor([[token]])
            return "length"
        finally:
            self._leave()

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    async def _abort(self, request_ids: list[str]) -> None:
        return None  # the decode loops see state.aborted before their next token

    # --- scoring ----------------------------------------------------------------------------
    async def _score(self, req: ScoreRequest) -> ScoreResponse:
        if req.images:
            raise BadRequest("images: the hf engine serves text-only models; use inference.engine vllm for a vision teacher")
        return await asyncio.to_thread(self._score_sync, req)

    @torch.no_grad()
    def _score_sync(self, req: ScoreRequest) -> ScoreResponse:
        ids = torch.tensor([req.token_ids])
        with self._step:
            logits = self.model(input_ids=ids).logits[0].float()
        # Position t's token is predicted by the logits at t - 1.
        lp = torch.log_softmax(logits[req.prompt_len - 1:-1], -1)
        targets = ids[0, req.prompt_len:]
        chosen = lp.gather(1, targets[:, None])[:, 0]
        top = lp.topk(req.top_k, dim=-1)
        return ScoreResponse(logprobs=chosen.tolist(), topk_ids=top.indices.tolist(), topk_logprobs=top.values.tolist())

    # --- weights ----------------------------------------------------------------------------
    def expected_tensors(self) -> Mapping[str, Sequence[int]]:
        return {n: list(p.shape) for n, p in self.model.named_parameters()}

    async def weight_checksums(self) -> dict[str, str]:
        from kubedistill.runtime.weight_sync.manifest import tensor_checksum

        with self._step:
            out = {n: tensor_checksum(p) for n, p in self.model.named_parameters()}
            out["lm_head.weight"] = tensor_checksum(self.model.get_output_embeddings().weight)
        return out

    async def join_weight_group(self, addr: GroupAddress) -> None:
        self.weight_group_state = "joining"
        try:
            self.group = await asyncio.to_thread(WeightSyncGroup, addr)
        except Exception:
            self.weight_group_state = "failed"
            raise
        self.weight_group_state = "ready"

    async def probe_transport(self, nbytes: int) -> None:
        def run() -> None:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(buf).wait()
            self.group.all_reduce_sum(0)

        await asyncio.to_thread(run)

    async def receive_weights(self, manifest: Manifest, version: int, pause: PauseMode, load: bool) -> dict:
        if self.group is None:
            raise RuntimeError("not in the weight-sync group")
        return await asyncio.to_thread(self._receive_sync, manifest, version, pause, load)

    @torch.no_grad()
    def _receive_sync(self, manifest: Manifest, version: int, pause: PauseMode, load: bool) -> dict:
        t0 = time.perf_counter()
        self._pause_mode = pause
        self._running.clear()  # new requests wait from here on
        try:
            if pause == "abort":
                for s in list(self.inflight.values()):
                    s.aborted = True
            with self._active_cv:
                # No forward may mix old and new weights: 'wait' lets running requests finish,
                # 'abort' waits for them to notice, 'keep' for them to park before their next token.
                self._active_cv.wait_for(lambda: self._active == 0, timeout=self.group.addr.timeout_seconds)
            errors: list[str] = []

            def consume(named):
                if errors or not load:
                    return
                try:
                    with self._step:
                        for name, t in named:
                            self._params[name].data.copy_(t)
                except Exception as e:  # keep receiving so the collective stays in step
                    errors.append(f"{type(e).__name__}: {e}")

            def destination(name: str):
                # Generation is paused: the broadcast may land in the parameter itself.
                p = self._params.get(name)
                return p.data if (load and not errors and p is not None) else None

            stats = receive(self.group, manifest, consume, destination)
            if load and not errors:
                # Before the all-reduce that releases the trainer: once its sync returns, /version
                # must already report the new version.
                self.version = version
            failed = self.group.all_reduce_sum(1 if (errors or not load) else 0)
            if errors:
                raise RuntimeError(errors[0])
        finally:
            self._running.set()
        return {"bytes": stats.bytes, "seconds": time.perf_counter() - t0, "transport_wait_seconds": stats.wait_seconds,
                "load_seconds": stats.consume_seconds, "group_failures": failed}


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: Optional[torch.Generator]) -> int:
    if temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
