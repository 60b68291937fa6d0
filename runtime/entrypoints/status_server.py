"""Trainer rank 0's HTTP server: GET /status (TrainerProgress JSON, polled by the operator and
`kubedistill run`), GET /health, GET /metrics (the role's Prometheus registry). It runs as a task
in the driver's event loop; the trainer step runs in a worker thread, so it stays responsive."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from kubedistill.api.progress import TrainerProgress
from kubedistill.runtime.metrics import RoleMetrics


def build_status_app(status: TrainerProgress, metrics: RoleMetrics) -> FastAPI:
    app = FastAPI(title="kubedistill trainer")

    @app.get("/status")
    async def get_status() -> JSONResponse:
        return JSONResponse(status.to_json())

    @app.get("/health")
    async def health() -> JSONResponse:
        code = 500 if status.phase == "failed" else 200
        return JSONResponse(
            {"status": "ok" if code == 200 else "failed", "role": "trainer", "phase": status.phase}, status_code=code
        )

    @app.get("/metrics")
    async def prom() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The trainer process handles its own signals (default: terminate).
        yield


class StatusServer:
    """uvicorn inside the current event loop: `await start()`, then `await stop()`."""

    def __init__(self, status: TrainerProgress, metrics: RoleMetrics, host: str, port: int):
        config = uvicorn.Config(
            build_status_app(status, metrics), host=host, port=port, log_level="warning", lifespan="off"
        )
        self.server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises the bind error
                raise RuntimeError("the status server stopped while starting")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
