"""The rollout server (`kubedistill role rollout`): the student's engine behind /generate,
/abort, /version, /weights/begin, /health, /metrics. Joins the weight-sync group at start-up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kubedistill.api.roleconfig import Identity, JobConfig, weight_sync_rank, weight_sync_world_size
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.engines.base import Engine, PauseMode
from kubedistill.runtime.metrics import RoleMetrics
from kubedistill.runtime.protocol import (
    AbortRequest, AbortResponse, GenerateRequest, GenerateResponse, VersionResponse,
    WeightsBeginRequest, WeightsBeginResponse,
)
from kubedistill.runtime.servers.http import make_app
from kubedistill.runtime.weight_sync.group import GroupAddress, resolve_backend
from kubedistill.runtime.weight_sync.manifest import check_against, check_layout

log = logging.getLogger("kubedistill.rollout")


def pause_mode(spec: DistillationJobSpec) -> PauseMode:
    """What a weight load does to requests in flight: finish them under the old weights (no
    partial rollouts), abort them so the driver resumes them (resume), or freeze them with their
    KV cache and continue (inflight)."""
    a = spec.async_
    if a is None or not a.partial_rollout:
        return "wait"
    return "abort" if a.partial_rollout_strategy.value == "resume" else "keep"


def group_address(config: JobConfig, replica: int) -> GroupAddress:
    spec = config.spec
    return GroupAddress(
        host=config.endpoints.master_addr, port=config.endpoints.weight_sync_port,
        rank=weight_sync_rank(spec, replica), world_size=weight_sync_world_size(spec),
        backend=resolve_backend(spec.weight_sync.backend.value, spec.device.value),
        timeout_seconds=float(spec.weight_sync.timeout_seconds),
    )


def build_rollout_app(config: JobConfig, identity: Identity, engine: Engine,
                      metrics: Optional[RoleMetrics] = None, join_weight_group: bool = True) -> FastAPI:
    metrics = metrics or RoleMetrics(config.job, "rollout", identity.replica)
    spec = config.spec
    state: dict = {"sync": None, "join": None, "last_sync": None}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        metrics["weight_version"].set(engine.version)
        if join_weight_group:
            state["join"] = asyncio.create_task(_join())
        yield
        for key in ("join", "sync"):
            if state[key] is not None and not state[key].done():
                state[key].cancel()
        await engine.shutdown()

    async def _join() -> None:
        try:
            await engine.join_weight_group(group_address(config, identity.replica))
        except Exception as e:  # reported by /health and refused by /weights/begin
            log.error("joining the weight-sync group failed: %s", e)

    app = make_app("rollout", engine, metrics, lifespan=lifespan)

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(req: GenerateRequest) -> GenerateResponse:
        out = await engine.generate(req)
        metrics["rollout_tokens"].inc(len(out.token_ids))
        return out

    @app.post("/abort", response_model=AbortResponse)
    async def abort(req: AbortRequest) -> AbortResponse:
        outputs = await engine.abort(req.request_ids)
        return AbortResponse(aborted=list(outputs), outputs=outputs)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=engine.version)

    @app.get("/weights/last")
    async def last_sync() -> dict:
        """Stats of the last completed weight load (seconds, bytes, repack time) or its error."""
        return state["last_sync"] or {}

    @app.get("/weights/checksums")
    async def checksums() -> dict[str, str]:
        """sha256 of every weight as the engine uses it (HF names): compare with the trainer's."""
        return await engine.weight_checksums()

    @app.post("/weights/probe")
    async def weights_probe(body: dict):
        """Receive one raw broadcast of `bytes` bytes and discard it (transport benchmark)."""
        nbytes = body.get("bytes")
        if not isinstance(nbytes, int) or nbytes < 1:
            return JSONResponse({"error": "bytes: a positive integer is required"}, status_code=422)
        if engine.weight_group_state != "ready":
            return JSONResponse({"error": f"the weight-sync group is not formed (state {engine.weight_group_state})"},
                                status_code=503)
        if not await _previous_sync_done():
            return JSONResponse({"error": "a weight sync is already in progress"}, status_code=503)
        state["sync"] = asyncio.create_task(engine.probe_transport(nbytes))
        return {"accepted": True, "bytes": nbytes}

    @app.post("/weights/begin", response_model=WeightsBeginResponse)
    async def weights_begin(req: WeightsBeginRequest):
        if engine.weight_group_state != "ready":
            return JSONResponse({"error": f"the weight-sync group is not formed (state {engine.weight_group_state})"},
                                status_code=503)
        if not await _previous_sync_done():
            return JSONResponse({"error": "a weight sync is already in progress"}, status_code=503)
        try:
            check_layout(req.manifest)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=422)
        load = True
        refusal = None
        try:
            check_against(req.manifest, engine.expected_tensors())
        except ValueError as e:
            # Still take part in the broadcast (discarding it) so the group stays in step.
            load, refusal = False, str(e)
        state["sync"] = asyncio.create_task(_receive(req, load))
        if refusal is not None:
            return JSONResponse({"error": refusal}, status_code=409)
        return WeightsBeginResponse(version=req.version)

    async def _previous_sync_done() -> bool:
        """The trainer's side of a sync returns at the closing all-reduce, a moment before this
        server's task finishes: give a finishing task a little time rather than refusing."""
        task = state["sync"]
        if task is None or task.done():
            return True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=30)
        except asyncio.TimeoutError:
            return False
        except Exception:
            pass
        return True

    async def _receive(req: WeightsBeginRequest, load: bool) -> None:
        try:
            stats = await engine.receive_weights(req.manifest, req.version, pause_mode(spec), load)
        except Exception as e:
            log.error("weight sync to version %s failed: %s", req.version, e)
            state["last_sync"] = {"version": req.version, "error": str(e)}
            return
        state["last_sync"] = {"version": req.version, "loaded": load, **stats}
        if load:
            metrics["weight_version"].set(engine.version)
            metrics["weight_sync_seconds"].observe(stats["seconds"])
            metrics["weight_sync_bytes"].inc(stats["bytes"])

    return app
