"""Async HTTP clients of the rollout and teacher servers (used by the driver).

They are thin: every request goes through the runtime's one HTTP stack (runtime/wire/http.py:
aiohttp, pydantic's JSON code, TRANSPORT_ERRORS for a request that may be sent again and
ServerError for an answer that is an error), which the weight sender and `kubedistill run` use too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, Self, TypeVar

import aiohttp
from pydantic import BaseModel

from kubedistill.runtime.wire.http import TRANSPORT_ERRORS as TRANSPORT_ERRORS
from kubedistill.runtime.wire.http import ServerError as ServerError
from kubedistill.runtime.wire.http import call, fetch, new_session
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

M = TypeVar("M", bound=BaseModel)


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
        return await call(self.session, "POST", self.base_url + path, model, body)

    async def _get(self, path: str, model: type[M]) -> M:
        return await call(self.session, "GET", self.base_url + path, model)

    async def health(self) -> HealthResponse:
        return await self._get("/health", HealthResponse)

    async def metrics_text(self) -> str:
        """The server's Prometheus exposition."""
        return (await fetch(self.session, "GET", self.base_url + "/metrics")).decode()

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
