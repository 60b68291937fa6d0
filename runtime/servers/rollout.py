"""The rollout server (`kubedistill role rollout`): the student's engine behind /generate,
/abort, /version, /weights/group, /weights/begin, /health, /metrics. Joins the weight-sync group
when the trainer says so (POST /weights/group, on every trainer start: see weight_group.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from kubedistill.api.roleconfig import Identity, JobConfig, weight_sync_rank, weight_sync_world_size
from kubedistill.api.spec import DistillationJobSpec, PartialRolloutStrategy
from kubedistill.runtime.engines.base import Engine, PauseMode
from kubedistill.runtime.metrics import RoleMetrics
from kubedistill.runtime.servers.http import answer_each, make_app
from kubedistill.runtime.servers.weight_group import WeightGroupMembership
from kubedistill.runtime.weight_sync.group import GroupAddress, resolve_backend
from kubedistill.runtime.weight_sync.manifest import check_layout
from kubedistill.runtime.wire.protocol import (
    AbortRequest,
    AbortResponse,
    GenerateRequest,
    GenerateResponse,
    VersionResponse,
    WeightsBeginRequest,
    WeightsBeginResponse,
    WeightsGroupRequest,
    WeightsGroupResponse,
)
from kubedistill.runtime.wire.streams import GenerateBatch

log = logging.getLogger("kubedistill.rollout")

VERSION_WAIT_SECONDS = 30.0
"""The longest GET /version?at_least=N waits for a weight load in progress."""


def pause_mode(spec: DistillationJobSpec) -> PauseMode:
    """What a weight load does to requests in flight: finish them under the old weights (no
    partial rollouts), abort them so the driver resumes them (resume), or freeze them with their
    KV cache and continue (inflight)."""
    a = spec.async_settings
    if not a.partial_rollout:
        return "wait"
    return "abort" if a.partial_rollout_strategy is PartialRolloutStrategy.resume else "keep"


def group_address(
    config: JobConfig, replica: int, epoch: str = "0", placement: WeightsGroupRequest | None = None
) -> GroupAddress:
    """This server's place in group `epoch`: the trainer's numbering when it gave one (it holds
    a different set of servers while the job scales), else the spec's."""
    spec = config.spec
    rank = placement.rank if placement is not None and placement.rank is not None else None
    world = placement.world_size if placement is not None and placement.world_size is not None else None
    return GroupAddress(
        host=config.endpoints.master_addr,
        port=config.endpoints.weight_sync_port,
        rank=rank if rank is not None else weight_sync_rank(spec, replica),
        world_size=world if world is not None else weight_sync_world_size(spec),
        backend=resolve_backend(spec.weight_sync.backend, spec.device),
        timeout_seconds=float(spec.weight_sync.timeout_seconds),
        epoch=epoch,
    )


@dataclass
class _Syncs:
    """One rollout server's weight loads: the one in progress, the outcome of the last, and the
    checks a sync's requests pass."""

    engine: Engine
    spec: DistillationJobSpec
    metrics: RoleMetrics
    membership: WeightGroupMembership = field(init=False)
    task: asyncio.Task[None] | None = None
    last: dict[str, Any] | None = None
    """GET /weights/last: the load's stats, or its error."""

    async def group_refusal(self, epoch: str | None) -> JSONResponse | None:
        """503 unless this server is in the sender's group (and it is formed)."""
        membership, engine = self.membership, self.engine
        if epoch is not None and epoch == membership.epoch:
            with contextlib.suppress(asyncio.TimeoutError):
                await membership.wait_switched(timeout=30)
        if epoch is not None and epoch != membership.epoch:
            return JSONResponse(
                {
                    "error": f"this server is in weight-sync group epoch {membership.epoch}, "
                    f"not the sender's {epoch}; POST /weights/group first"
                },
                status_code=503,
            )
        if engine.weight_group_state != "ready":
            return JSONResponse(
                {"error": f"the weight-sync group is not formed (state {engine.weight_group_state})"}, status_code=503
            )
        return None

    async def previous_done(self) -> bool:
        """The trainer's side of a sync returns at the closing all-reduce, a moment before this
        server's task finishes: give a finishing task a little time rather than refusing."""
        task = self.task
        if task is None or task.done():
            return True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=30)
        except TimeoutError:
            return False
        except Exception:
            pass
        return True

    async def settle(self, at_least: int | None) -> None:
        """With `at_least` above the served version while a load is in progress, wait for that
        load to end (generation resumed): the trainer's end of a sync, answered as it happens
        rather than at its next poll."""
        task = self.task
        if at_least is not None and self.engine.version < at_least and task is not None and not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), VERSION_WAIT_SECONDS)

    async def begin(self, req: WeightsBeginRequest) -> WeightsBeginResponse | JSONResponse:
        refusal = await self.group_refusal(req.group_epoch)
        if refusal is not None:
            return refusal
        if not await self.previous_done():
            return JSONResponse({"error": "a weight sync is already in progress"}, status_code=503)
        try:
            check_layout(req.manifest)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=422)
        load = True
        mismatch = None
        try:
            self.engine.check_manifest(req.manifest)
        except ValueError as e:
            # Still take part in the broadcast (discarding it) so the group stays in step.
            load, mismatch = False, str(e)
        self.task = asyncio.create_task(self._receive(req, load))
        if mismatch is not None:
            return JSONResponse({"error": mismatch}, status_code=409)
        return WeightsBeginResponse(version=req.version)

    async def _receive(self, req: WeightsBeginRequest, load: bool) -> None:
        engine, metrics = self.engine, self.metrics
        if load:
            # A load that does not complete leaves weights no sender holds a copy of: the next
            # sync must be a full one (the sender reads this base before each sync).
            engine.delta_base = None
        try:
            stats = await engine.receive_weights(req.manifest, req.version, pause_mode(self.spec), load)
        except Exception as e:
            log.error("weight sync to version %s failed: %s", req.version, e)
            self.last = {"version": req.version, "error": str(e)}
            return
        self.last = {"version": req.version, "loaded": load, **stats}
        if load:
            metrics["weight_version"].set(engine.version)
            metrics["weight_sync_seconds"].observe(stats["seconds"])
            metrics["weight_sync_bytes"].inc(stats["bytes"])


def build_rollout_app(
    config: JobConfig,
    identity: Identity,
    engine: Engine,
    metrics: RoleMetrics | None = None,
    debug_endpoints: bool = False,
) -> FastAPI:
    """`debug_endpoints`: also serve the weight-checksum endpoint (_add_debug_routes)."""
    metrics = metrics or RoleMetrics(config.job, "rollout", identity.replica)
    syncs = _Syncs(engine, config.spec, metrics)
    placements: dict[str, WeightsGroupRequest] = {}  # per group epoch: the rank and world size the trainer gave
    membership = WeightGroupMembership(
        engine,
        lambda epoch: group_address(config, identity.replica, epoch, placements.get(epoch)),
        lambda: syncs.task,
    )
    syncs.membership = membership

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        metrics["weight_version"].set(engine.version)
        yield
        if syncs.task is not None and not syncs.task.done():
            syncs.task.cancel()
        # Bounded: on vLLM a receive still blocked in a worker would hold the leave RPC.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(membership.close(), timeout=5)
        await engine.shutdown()

    app = make_app("rollout", engine, metrics, lifespan=lifespan)
    app.state.weight_group = membership

    @app.post("/weights/group", response_model=WeightsGroupResponse, status_code=202)
    async def weights_group(req: WeightsGroupRequest) -> WeightsGroupResponse:
        """Leave the current weight-sync group and join the trainer's group `epoch` (in the
        background: the trainer's rendezvous completes the join)."""
        placements.clear()  # only the newest group matters; a re-sent epoch keeps its place
        placements[req.epoch] = req
        membership.switch(req.epoch)
        return membership.status()

    @app.get("/weights/group", response_model=WeightsGroupResponse)
    async def weights_group_status() -> WeightsGroupResponse:
        return membership.status()

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(req: GenerateRequest) -> GenerateResponse:
        out = await engine.generate(req)
        metrics["rollout_tokens"].inc(len(out.token_ids))
        return out

    @app.post("/generate/batch", response_model=None)
    async def generate_batch(batch: GenerateBatch) -> StreamingResponse:
        """Many /generate at once, each answer streamed as it finishes (runtime/wire/streams.py)."""
        return answer_each(batch.requests, generate)

    @app.post("/abort", response_model=AbortResponse)
    async def abort(req: AbortRequest) -> AbortResponse:
        outputs = await engine.abort(req.request_ids)
        return AbortResponse(aborted=list(outputs), outputs=outputs)

    @app.get("/version", response_model=VersionResponse)
    async def version(at_least: int | None = None) -> VersionResponse:
        """The weight version served, once a load toward `at_least` has ended (_Syncs.settle)."""
        await syncs.settle(at_least)
        return VersionResponse(version=engine.version)

    @app.get("/weights/last")
    async def last_sync() -> dict[str, Any]:
        """Stats of the last completed weight load (seconds, bytes, repack time) or its error."""
        return syncs.last or {}

    @app.post("/weights/begin", response_model=WeightsBeginResponse)
    async def weights_begin(req: WeightsBeginRequest) -> WeightsBeginResponse | JSONResponse:
        return await syncs.begin(req)

    if debug_endpoints:
        _add_debug_routes(app, syncs)
    return app


def _add_debug_routes(app: FastAPI, syncs: _Syncs) -> None:
    """Endpoints for checking a sync by hand (docs/troubleshooting.md; the tests and GPU checks
    use them too), off in a job's pods unless asked for: `kubedistill role rollout --debug-endpoints`."""

    @app.get("/weights/checksums")
    async def checksums() -> dict[str, str]:
        """sha256 of every weight as the engine uses it (HF names): compare with the trainer's."""
        return await syncs.engine.weight_checksums()
