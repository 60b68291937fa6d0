"""Async HTTP clients of the rollout and teacher servers (used by the driver).

They are thin: every request goes through the runtime's one HTTP stack (runtime/wire/http.py:
aiohttp, pydantic's JSON code, TRANSPORT_ERRORS for a request that may be sent again and
ServerError for an answer that is an error), which the weight sender and `kubedistill run` use too.

/generate and /score calls made in the same turn of the event loop (the driver starts a step's
worth of samples at once, and scores them as they finish) go to their server as one batch
(`_Batcher`, runtime/wire/streams.py); each caller still gets its own answer as soon as the server
has it, or its own error, as if it had sent its request alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, Self, TypeVar

import aiohttp
from pydantic import BaseModel

from kubedistill.runtime.wire.http import TRANSPORT_ERRORS as TRANSPORT_ERRORS
from kubedistill.runtime.wire.http import ServerError as ServerError
from kubedistill.runtime.wire.http import SessionHolder, call, error_message, fetch, stream_frames
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
from kubedistill.runtime.wire.streams import GenerateBatch, ScoreBatch

M = TypeVar("M", bound=BaseModel)
Q = TypeVar("Q", bound=BaseModel)


class _Client(SessionHolder):
    def __init__(self, base_url: str, timeout: float = 600.0, session: aiohttp.ClientSession | None = None):
        super().__init__(session, timeout)
        self.base_url = base_url.rstrip("/")

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
        await self.close_session()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Batcher(Generic[Q, M]):
    """Sends the requests made in one turn of the event loop as one batch to `path` and hands
    each caller its own answer as it streams back. A caller that goes away leaves the batch; the
    batch's connection closes (cancelling the server's work) once all of its callers are gone."""

    def __init__(self, client: _Client, path: str, batch: Callable[[list[Q]], BaseModel], answer: type[M]):
        self.client, self.path, self.batch, self.answer = client, path, batch, answer
        self._pending: list[tuple[Q, asyncio.Future[M]]] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def __call__(self, req: Q) -> M:
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self._flush)
        fut: asyncio.Future[M] = loop.create_future()
        self._pending.append((req, fut))
        return await fut

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        futures = [f for _, f in batch]
        task = asyncio.ensure_future(self._send([q for q, _ in batch], futures))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

        def left(f: asyncio.Future[M]) -> None:
            if f.cancelled() and all(g.done() for g in futures):
                task.cancel()

        for f in futures:
            f.add_done_callback(left)

    async def _send(self, requests: list[Q], futures: list[asyncio.Future[M]]) -> None:
        url = self.client.base_url + self.path
        error: BaseException = aiohttp.ClientPayloadError(f"{url}: the batch's stream ended before every answer")
        body = self.batch(requests)
        try:
            for attempt in (1, 2):
                answered = False
                try:
                    async for index, status, raw in stream_frames(self.client.session, url, body):
                        answered = True
                        self._answer(futures[index], url, status, raw)
                    break
                except aiohttp.ServerDisconnectedError as e:
                    # Closed before any answer: the server was closing that idle connection as the
                    # batch went out (its requests were not started), so it goes out again, once.
                    # One retry here rather than a failure per request of the batch.
                    if answered or attempt == 2:
                        raise
                    error = e
        except asyncio.CancelledError:
            for f in futures:
                f.cancel()
            raise
        except Exception as e:
            error = e
        for f in futures:
            if not f.done():
                f.set_exception(error)

    def _answer(self, fut: asyncio.Future[M], url: str, status: int, raw: bytes) -> None:
        if fut.done():
            return
        if status == 200:
            fut.set_result(self.answer.model_validate_json(raw))
        else:
            fut.set_exception(ServerError(url, status, error_message(raw)))

    def cancel(self) -> None:
        for task in self._sending:
            task.cancel()


class RolloutClient(_Client):
    def __init__(self, base_url: str, timeout: float = 600.0, session: aiohttp.ClientSession | None = None):
        super().__init__(base_url, timeout, session)
        self._generate: _Batcher[GenerateRequest, GenerateResponse] = _Batcher(
            self, "/generate/batch", lambda rs: GenerateBatch(requests=rs), GenerateResponse
        )

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        return await self._generate(req)

    async def abort(self, request_ids: Sequence[str] | None = None) -> AbortResponse:
        body = AbortRequest(request_ids=list(request_ids) if request_ids is not None else None)
        return await self._post("/abort", body, AbortResponse)

    async def version(self) -> int:
        return (await self._get("/version", VersionResponse)).version


class TeacherClient(_Client):
    def __init__(self, base_url: str, timeout: float = 600.0, session: aiohttp.ClientSession | None = None):
        super().__init__(base_url, timeout, session)
        self._score: _Batcher[ScoreRequest, ScoreResponse] = _Batcher(
            self, "/score/batch", lambda rs: ScoreBatch(requests=rs), ScoreResponse
        )

    async def score(self, req: ScoreRequest) -> ScoreResponse:
        return await self._score(req)


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
