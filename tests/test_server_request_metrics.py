"""The servers' request metrics (runtime/servers/http.py RequestMetrics, plain ASGI middleware):
every request counted by path and final status code, in flight while it runs."""

from __future__ import annotations

from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from kubedistill.runtime.metrics import RoleMetrics
from kubedistill.runtime.servers.http import RequestMetrics


def _value(metrics: RoleMetrics, name: str, **labels: str) -> float:
    full = {"job": "j", "role": "rollout", "replica": "0", **labels}
    value = metrics.registry.get_sample_value(name, full)
    return 0.0 if value is None else value


def test_requests_are_counted_by_path_and_final_status() -> None:
    metrics = RoleMetrics("j", "rollout", 0)
    app = FastAPI()
    app.add_middleware(RequestMetrics, metrics=metrics)
    seen_in_flight: list[float] = []

    @app.get("/ok")
    async def ok() -> dict:
        seen_in_flight.append(_value(metrics, "kubedistill_requests_in_flight"))
        return {}

    @app.get("/missing")
    async def missing() -> dict:
        raise HTTPException(status_code=404, detail="no")

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("boom")

    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/ok").status_code == 200
        assert client.get("/ok").status_code == 200
        assert client.get("/missing").status_code == 404
        assert client.get("/boom").status_code == 500

    assert seen_in_flight == [1.0, 1.0]
    assert _value(metrics, "kubedistill_requests_in_flight") == 0.0
    assert _value(metrics, "kubedistill_requests_total", endpoint="/ok", code="200") == 2.0
    assert _value(metrics, "kubedistill_requests_total", endpoint="/missing", code="404") == 1.0
    assert _value(metrics, "kubedistill_requests_total", endpoint="/boom", code="500") == 1.0
