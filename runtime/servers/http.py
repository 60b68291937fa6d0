"""Pieces both servers share: the FastAPI app with /health and /metrics, request metrics, and
errors turned into 4xx JSON `{"error": "..."}` that leave the server serving."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Lifespan, Message, Receive, Scope, Send

from kubedistill.runtime.engines.base import BadRequest, Engine
from kubedistill.runtime.metrics import RoleMetrics
from kubedistill.runtime.wire.http import SERVER_KEEPALIVE_SECONDS
from kubedistill.runtime.wire.protocol import HealthResponse
from kubedistill.runtime.wire.streams import FRAMES_MEDIA_TYPE, frame

log = logging.getLogger("kubedistill.servers")

R = TypeVar("R", bound=BaseModel)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts)


class RequestMetrics:
    """Counts requests in flight and served (by path and status code) as plain ASGI middleware:
    starlette's BaseHTTPMiddleware (`@app.middleware("http")`) runs every request through an extra
    task and memory streams, a visible share of a busy rollout server's CPU."""

    def __init__(self, app: ASGIApp, metrics: RoleMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        code = 500  # unless a response starts: an unhandled error becomes a 500 further out

        async def send_status(message: Message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = message["status"]
            await send(message)

        self.metrics["requests_in_flight"].inc()
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics["requests_in_flight"].dec()
            self.metrics["requests"].labels(endpoint=scope["path"], code=str(code)).inc()


def make_app(role: str, engine: Engine, metrics: RoleMetrics, lifespan: Lifespan[FastAPI] | None = None) -> FastAPI:
    app = FastAPI(title=f"kubedistill {role}", lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": _validation_message(exc)}, status_code=422)

    app.add_middleware(RequestMetrics, metrics=metrics)

    @app.get("/health", response_model=HealthResponse)
    async def health() -> HealthResponse:
        return HealthResponse(
            role=role, engine=engine.name, version=engine.version, weight_sync=engine.weight_group_state
        )

    @app.get("/metrics")
    async def prom() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def answer_each(requests: Sequence[R], handle: Callable[[R], Awaitable[BaseModel]]) -> StreamingResponse:
    """A batch's answers (runtime/wire/streams.py): every request handled at once, as its single
    endpoint handles it, and framed as soon as it is done. A client that goes away cancels the
    unfinished ones, as it would cancel single requests by closing their connections.

    The answers that finish together (an engine iteration ends many requests at once) go out as
    one write: one chunk of the stream and one read on the client, not one per request."""

    async def frames() -> AsyncIterator[bytes]:
        finished: list[asyncio.Task[BaseModel]] = []
        wake = asyncio.Event()

        def done(task: asyncio.Task[BaseModel]) -> None:
            finished.append(task)
            wake.set()

        tasks: dict[asyncio.Task[BaseModel], int] = {}
        for i, r in enumerate(requests):
            task = asyncio.ensure_future(handle(r))
            tasks[task] = i
            task.add_done_callback(done)
        left = len(tasks)
        try:
            while left:
                await wake.wait()
                wake.clear()
                ready = finished[:]
                del finished[:]
                left -= len(ready)
                yield b"".join(frame(tasks[t], *_outcome(t)) for t in ready)
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()

    return StreamingResponse(frames(), media_type=FRAMES_MEDIA_TYPE)


def _outcome(task: asyncio.Future[BaseModel]) -> tuple[int, bytes]:
    """(status, body) as the single endpoint would answer: a BadRequest its 4xx, another error 500."""
    exc = task.exception()
    if exc is None:
        return 200, task.result().model_dump_json().encode()
    if isinstance(exc, BadRequest):
        return exc.status, json.dumps({"error": str(exc)}).encode()
    log.error("a batched request failed: %r", exc, exc_info=exc)
    return 500, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()


def serve(app: FastAPI, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=int(SERVER_KEEPALIVE_SECONDS),
    )


def now() -> float:
    return time.perf_counter()
