"""Async HTTP clients of the rollout and teacher servers (used by the driver).

aiohttp, not httpx: with a step's ~100 concurrent /generate and /score requests in flight,
httpx/httpcore's connection-pool bookkeeping takes most of the driver's CPU, and that CPU is
taken from the train step beside it (docs/servers.md, "The driver's HTTP client"). Bodies are
encoded and decoded by pydantic's own JSON code (no intermediate dicts), which matters for top-k
teacher scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, Self, TypeVar

import aiohttp
from pydantic import BaseModel

from kubedistill.runtime.wire.protocol import (
    AbortRequest,
    AbortResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    ScoreRequest,
    ScoreResponse,
    VersionResponse,
)

KEEPALIVE_SECONDS = 2.0
"""Idle connections are dropped before the servers' keep-alive (uvicorn: 5 s) closes them, so a
request rarely goes out on a connection the server is closing (the driver retries it if it does)."""

TRANSPORT_ERRORS: tuple[type[Exception], ...] = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
"""Failures of the connection rather than answers of the server: the request may be sent again."""

M = TypeVar("M", bound=BaseModel)
_JSON = {"Content-Type": "application/json"}


class ServerError(RuntimeError):
    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: {status} {message}")
        self.status = status
        self.message = message


def new_session(timeout: float = 600.0) -> aiohttp.ClientSession:
    """One session for any number of servers and concurrent requests (no connection cap: every
    request reaches its server at once, so the engine can batch them). Call inside a running loop."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout),
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS),
    )


class _Client:
    def __init__(self, base_url: str, timeout: float = 600.0, session: aiohttp.ClientSession | None = None):
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout
        self._own = session is None
        self._session = session

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # created lazily: aiohttp wants a running loop
            self._session = new_session(self._timeout)
        return self._session

    async def _post(self, path: str, body: BaseModel, model: type[M]) -> M:
        data = body.model_dump_json(exclude_none=True)
        async with self.session.post(self.base_url + path, data=data, headers=_JSON) as r:
            return model.model_validate_json(await self._read_ok(path, r))

    async def _get(self, path: str, model: type[M]) -> M:
        async with self.session.get(self.base_url + path) as r:
            return model.model_validate_json(await self._read_ok(path, r))

    async def _read_ok(self, path: str, r: aiohttp.ClientResponse) -> bytes:
        raw = await r.read()
        if r.status != 200:
            text = raw.decode(errors="replace")
            try:
                body = await r.json(content_type=None)
            except ValueError:
                body = None
            msg = str(body.get("error", text)) if isinstance(body, dict) else text
            raise ServerError(self.base_url + path, r.status, msg)
        return raw

    async def health(self) -> HealthResponse:
        return await self._get("/health", HealthResponse)

    async def metrics_text(self) -> str:
        """The server's Prometheus exposition."""
        async with self.session.get(self.base_url + "/metrics") as r:
            return (await self._read_ok("/metrics", r)).decode()

    async def aclose(self) -> None:
        if self._own and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class RolloutClient(_Client):
    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        return await self._post("/generate", req, GenerateResponse)

    async def abort(self, request_ids: Sequence[str] | None = None) -> AbortResponse:
        body = AbortRequest(request_ids=list(request_ids) if request_ids is not None else None)
        return await self._post("/abort", body, AbortResponse)

    async def version(self) -> int:
        return (await self._get("/version", VersionResponse)).version


class TeacherClient(_Client):
    async def score(self, req: ScoreRequest) -> ScoreResponse:
        return await self._post("/score", req, ScoreResponse)


class RolloutClientLike(Protocol):
    """What the driver calls on a rollout server (RolloutClient, or a test's fake server)."""

    base_url: str

    async def health(self) -> HealthResponse: ...
    async def generate(self, req: GenerateRequest) -> GenerateResponse: ...
    async def abort(self, request_ids: Sequence[str] | None = None) -> AbortResponse: ...
    async def version(self) -> int: ...


class TeacherClientLike(Protocol):
    """What the driver calls on a teacher server (TeacherClient, or a test's fake server)."""

    base_url: str

    async def health(self) -> HealthResponse: ...
    async def score(self, req: ScoreRequest) -> ScoreResponse: ...


class ServerClients(Protocol):
    """Makes the driver's client of each rollout and teacher server it talks to."""

    def rollout(self, url: str) -> RolloutClientLike: ...
    def teacher(self, url: str) -> TeacherClientLike: ...


class HttpClients:
    """The real clients: HTTP over one aiohttp session (the driver's, for the whole run)."""

    def __init__(self, session: aiohttp.ClientSession):
        self.session = session

    def rollout(self, url: str) -> RolloutClient:
        return RolloutClient(url, session=self.session)

    def teacher(self, url: str) -> TeacherClient:
        return TeacherClient(url, session=self.session)
