"""The engine interface the rollout and teacher servers use, and the request bookkeeping both
engines share (in-flight requests, per-token weight versions, request checks)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kubedistill.runtime.weight_sync.delta import check_delta
from kubedistill.runtime.weight_sync.group import GroupAddress, WeightSyncGroup
from kubedistill.runtime.weight_sync.lora import check_lora_manifest
from kubedistill.runtime.weight_sync.manifest import check_against
from kubedistill.runtime.wire.protocol import (
    DeltaBase,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    Manifest,
    ScoreRequest,
    ScoreResponse,
)
from kubedistill.runtime.wire.rows import Rows

PauseMode = Literal["wait", "keep", "abort"]
WeightGroupState = Literal["none", "joining", "ready", "failed"]


class BadRequest(ValueError):
    """The request cannot be served as sent (-> HTTP 400)."""

    status = 400


class NotFound(BadRequest):
    status = 404


class Conflict(BadRequest):
    status = 409


@dataclass
class InFlight:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    topk_ids: list[list[int]] | None = None
    """The most likely ids at each generated position, when the request asked for them."""
    aborted: bool = False
    done: asyncio.Future[None] = field(kw_only=True)
    """Resolved once the request has left the engine (abort waits on it)."""

    def response(self, finish_reason: FinishReason) -> GenerateResponse:
        return GenerateResponse(
            request_id=self.request_id,
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason="abort" if self.aborted else finish_reason,
            topk_ids=Rows.of(self.topk_ids, "int32") if self.topk_ids is not None else None,
        )


def check_generate(req: GenerateRequest, max_model_len: int, vocab_size: int) -> int:
    """Validate a /generate request; returns the number of new tokens to generate at most.
    sampling.max_tokens is the budget of the whole response, prefix included, so a resumed
    sample ends where an uninterrupted one would."""
    if not req.prompt_token_ids:
        raise BadRequest("prompt_token_ids is empty; send at least one token")
    context = len(req.prompt_token_ids) + len(req.prefix_token_ids)
    if context >= max_model_len:
        raise BadRequest(
            f"prompt_token_ids + prefix_token_ids is {context} tokens; the model's limit "
            f"(max_model_len) is {max_model_len}, leaving no room to generate"
        )
    _check_vocab(req.prompt_token_ids, vocab_size, "prompt_token_ids")
    _check_vocab(req.prefix_token_ids, vocab_size, "prefix_token_ids")
    _check_vocab(req.sampling.stop_token_ids, vocab_size, "sampling.stop_token_ids")
    remaining = req.sampling.max_tokens - len(req.prefix_token_ids)
    if remaining <= 0:
        raise BadRequest(
            f"prefix_token_ids already holds {len(req.prefix_token_ids)} tokens, "
            f"sampling.max_tokens is {req.sampling.max_tokens}: nothing left to generate"
        )
    if req.sampling.top_k_ids > vocab_size:
        raise BadRequest(f"sampling.top_k_ids ({req.sampling.top_k_ids}) exceeds the vocabulary size ({vocab_size})")
    return min(remaining, max_model_len - context)


def check_score(req: ScoreRequest, max_model_len: int, vocab_size: int) -> None:
    if not req.token_ids:
        raise BadRequest("token_ids is empty; send the prompt followed by the response")
    if req.prompt_len >= len(req.token_ids):
        raise BadRequest(
            f"prompt_len ({req.prompt_len}) must be smaller than len(token_ids) ({len(req.token_ids)}): "
            "there is no response token to score"
        )
    if len(req.token_ids) > max_model_len:
        raise BadRequest(
            f"token_ids has {len(req.token_ids)} tokens; the model's limit (max_model_len) is {max_model_len}"
        )
    if req.top_k > vocab_size:
        raise BadRequest(f"top_k ({req.top_k}) exceeds the vocabulary size ({vocab_size})")
    _check_vocab(req.token_ids, vocab_size, "token_ids")
    gathered = req.gather_ids.array() if req.gather_ids is not None else None
    if gathered is not None and gathered.size:  # padding is 0, a valid id
        _check_vocab([int(gathered.max())], vocab_size, "gather_ids")


def _check_vocab(ids: Sequence[int], vocab_size: int, field_name: str) -> None:
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        raise BadRequest(
            f"{field_name} holds token id {bad[0]}; the vocabulary has {vocab_size} ids (0..{vocab_size - 1})"
        )


class Engine(ABC):
    """One model served for generation (rollout) or scoring (teacher)."""

    name: str = "engine"
    group: WeightSyncGroup | None = None
    """The weight-sync group, for engines that hold it in this process (see abort_weight_group)."""

    def __init__(self) -> None:
        self.version = 0
        self.inflight: dict[str, InFlight] = {}
        self.weight_group_state: WeightGroupState = "none"
        self.delta_base: DeltaBase | None = None
        """The delta-chain version this engine holds bit for bit (runtime/weight_sync/delta.py):
        set by `loaded`, cleared by the server as any load starts."""

    # --- life cycle -------------------------------------------------------------------------
    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    # --- generation -------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        max_new = check_generate(req, self.max_model_len, self.vocab_size)
        if req.request_id in self.inflight:
            raise Conflict(f"request_id {req.request_id!r} is already in flight; request ids must be unique")
        state = InFlight(req.request_id, done=asyncio.get_running_loop().create_future())
        self.inflight[req.request_id] = state
        try:
            finish = await self._generate(req, max_new, state)
            out = state.response(finish)
            return out
        finally:
            self.inflight.pop(req.request_id, None)
            if not state.done.done():
                state.done.set_result(None)

    @abstractmethod
    async def _generate(self, req: GenerateRequest, max_new: int, state: InFlight) -> FinishReason:
        """Generate into `state` (appending tokens, log-probs and self.version per token);
        return the finish reason. Must end promptly once `state.aborted` is set."""

    async def abort(self, request_ids: Sequence[str] | None) -> dict[str, GenerateResponse]:
        """Abort requests in flight (all when None); returns each one's partial output."""
        if request_ids is None:
            request_ids = list(self.inflight)
        unknown = [r for r in request_ids if r not in self.inflight]
        if unknown:
            raise NotFound(f"no request in flight with id {unknown[0]!r} (finished, never sent, or already aborted)")
        states = [self.inflight[r] for r in request_ids]
        for s in states:
            s.aborted = True
        await self._abort([s.request_id for s in states])
        await asyncio.gather(*(asyncio.shield(s.done) for s in states))
        return {s.request_id: s.response("abort") for s in states}

    @abstractmethod
    async def _abort(self, request_ids: list[str]) -> None: ...

    # --- scoring ----------------------------------------------------------------------------
    async def score(self, req: ScoreRequest) -> ScoreResponse:
        check_score(req, self.max_model_len, self.vocab_size)
        return await self._score(req)

    @abstractmethod
    async def _score(self, req: ScoreRequest) -> ScoreResponse: ...

    # --- weights ----------------------------------------------------------------------------
    @abstractmethod
    def expected_tensors(self) -> Mapping[str, Sequence[int]]:
        """HF names and shapes a weight sync must carry (a tied lm_head excluded)."""

    def check_manifest(self, manifest: Manifest) -> None:
        """Raise ValueError (one line; the server answers 409 and still joins the broadcast,
        discarding it) unless this engine can load `manifest`: full weights must name exactly the
        engine's tensors, a LoRA adapter must fit the engine's linear layers."""
        if manifest.lora is None:
            check_against(manifest, self.expected_tensors())
            if manifest.delta is not None and manifest.delta.base is not None:
                check_delta(manifest, self.expected_tensors(), self.delta_base)
        else:
            check_lora_manifest(manifest, self.expected_tensors())

    def loaded(self, version: int, manifest: Manifest) -> None:
        """A sync has loaded: serve `version` from now on, holding the delta base the manifest
        keeps (if any). Both at once, before the sender hears of the end, so its next sync sees
        the base."""
        self.delta_base = manifest.delta.keep if manifest.delta is not None else None
        self.version = version

    @abstractmethod
    async def weight_checksums(self) -> dict[str, str]:
        """sha256 per weight as the engine computes with it, under HF names, `lm_head.weight`
        included even when tied: lets a test or an operator check a sync bit for bit."""

    @abstractmethod
    async def join_weight_group(self, addr: GroupAddress) -> None:
        """Join the weight-sync group; returns once joined (run it as a background task)."""

    def weight_dtype(self) -> str | None:
        """The dtype the engine's weights are stored in (None: not known yet, or mixed)."""
        return None

    def serves_at_load(self) -> bool:
        """Whether `loaded()` runs before this engine's end of the sync's closing all-reduce, so
        that once the trainer's sync returns the server already serves the new version."""
        return False

    def receives_in_place(self) -> bool:
        """Whether a bucket of one whole tensor lands straight in the engine's parameter (no
        loader call): then the sender sends large tensors alone, with no packing copy."""
        return False

    def abort_weight_group(self) -> None:
        """Break a weight receive blocked on the current group (its trainer is gone). Engines that
        hold the group in this process keep it in `self.group`; others override."""
        if self.group is not None:
            self.group.abort()

    async def leave_weight_group(self) -> None:
        """Release the current group's resources (before joining a new one). Default: the
        in-process `self.group`."""
        group = self.group
        if group is not None:
            self.group = None
            await asyncio.to_thread(group.close)
        self.weight_group_state = "none"

    @abstractmethod
    async def receive_weights(self, manifest: Manifest, version: int, pause: PauseMode, load: bool) -> dict[str, float]:
        """Pause generation (`pause` says what happens to requests in flight), receive the
        broadcast, load it (or discard it when load is False, to keep the group in step), report
        this worker's failure count in the closing all-reduce, set the version, resume.
        Returns timing/byte stats (`bytes`, `seconds`, `transport_wait_seconds`, `load_seconds`,
        `group_failures`, ...)."""
