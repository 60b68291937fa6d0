"""Pieces both servers share: the FastAPI app with /health and /metrics, request metrics, and
errors turned into 4xx JSON `{"error": "..."}` that leave the server serving."""

from __future__ import annotations

import time
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from kubedistill.runtime.engines.base import BadRequest, Engine
from kubedistill.runtime.metrics import RoleMetrics
from kubedistill.runtime.protocol import HealthResponse


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts)


def make_app(role: str, engine: Engine, metrics: RoleMetrics, lifespan=None) -> FastAPI:
    app = FastAPI(title=f"kubedistill {role}", lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return JSONResponse({"error": _validation_message(exc)}, status_code=422)

    @app.middleware("http")
    async def count(request: Request, call_next: Callable[[Request], Awaitable[Response]]):
        metrics["requests_in_flight"].inc()
        code = 500
        try:
            response = await call_next(request)
            code = response.status_code
            return response
        finally:
            metrics["requests_in_flight"].dec()
            metrics["requests"].labels(endpoint=request.url.path, code=str(code)).inc()

    @app.get("/health", response_model=HealthResponse)
    async def health() -> HealthResponse:
        return HealthResponse(role=role, engine=engine.name, version=engine.version,
                              weight_sync=engine.weight_group_state)

    @app.get("/metrics")
    async def prom() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(app: FastAPI, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)


def now() -> float:
    return time.perf_counter()
