"""The runtime's one HTTP client stack: aiohttp, with bodies encoded and decoded by pydantic.

Every request a role makes to another goes through `call` (or `fetch`): the driver's /generate
and /score (runtime/driver/clients.py), the weight sender's /weights/* and /version
(runtime/weight_sync/sender.py), and `kubedistill run`'s poll of the trainer's /status
(runtime/entrypoints/local.py). Two kinds of failure come out of it, and callers tell them apart:

* TRANSPORT_ERRORS: the request did not reach the server, or the connection broke or timed out
  before the answer was read. The server may be gone or restarting; the request may be sent again.
* ServerError: the server answered with a status the caller did not expect; it names the URL,
  the status and the server's `{"error": ...}` message.

aiohttp rather than httpx (docs/servers.md, "The runtime's HTTP client"; bench/http_client.py):
it takes far less of the client's CPU per request, CPU the driver takes from the train step
running beside it. Code that blocks
(the weight sender on the trainer thread, the launcher's poll loop) uses the same stack through
`BlockingClient`, which runs the requests on a private event loop.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Mapping
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel

from kubedistill.runtime.wire.streams import read_frame

KEEPALIVE_SECONDS = 2.0
"""Idle connections are dropped well before the servers' keep-alive (SERVER_KEEPALIVE_SECONDS)
closes them, so a request rarely goes out on a connection the server is closing (callers retry it
if it does)."""
SERVER_KEEPALIVE_SECONDS = 60.0
"""How long our servers keep an idle connection (uvicorn's default: 5 s). Far above the clients'
2 s, since a client's event loop stalled for seconds on a starved host would otherwise reuse
connections the server is closing, and a burst of those failures can fail the only server."""

TRANSPORT_ERRORS: tuple[type[Exception], ...] = (
    aiohttp.ClientConnectionError,  # refused, reset, disconnected mid-answer, socket timeouts
    aiohttp.ClientPayloadError,  # the body was cut short
    TimeoutError,  # the request's total timeout (aiohttp raises the bare builtin for it)
)
"""Failures of the connection rather than answers of the server: the request may be sent again."""

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
Body = BaseModel | Mapping[str, Any] | None
_JSON = {"Content-Type": "application/json"}


class ServerError(RuntimeError):
    """The server answered, with a status the caller did not expect."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: {status} {message}")
        self.url = url
        self.status = status
        self.message = message


REQUEST_ERRORS: tuple[type[Exception], ...] = (*TRANSPORT_ERRORS, ServerError)
"""Every way a request fails, for a caller to whom a broken connection and an error answer mean
the same (a probe, a status poll)."""


def new_session(timeout: float = 600.0) -> aiohttp.ClientSession:
    """One session for any number of servers and concurrent requests (no connection cap: every
    request reaches its server at once, so the engine can batch them). Call inside a running loop."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout),
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS),
    )


class SessionHolder:
    """An aiohttp session the caller gave, or one made on first use (aiohttp wants a running loop)
    and closed by `aclose`: a client either shares the run's session or owns one."""

    def __init__(self, session: aiohttp.ClientSession | None = None, timeout: float = 600.0):
        self._session = session
        self._own = session is None
        self._session_timeout = timeout

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = new_session(self._session_timeout)
        return self._session

    async def close_session(self) -> None:
        """Close the session if this holder made it (a shared one is its owner's to close)."""
        if self._own and self._session is not None:
            await self._session.close()
            self._session = None


def error_message(raw: bytes) -> str:
    """The server's `{"error": ...}` message, or the body as text when it is not one."""
    text = raw.decode(errors="replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        return text
    return str(doc.get("error", text)) if isinstance(doc, dict) else text


async def fetch(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Body = None,
    *,
    ok: Collection[int] = (200,),
    timeout: float | None = None,
) -> bytes:
    """The answer's body; raises ServerError unless its status is in `ok`. A pydantic body is
    encoded by pydantic's own JSON code (no intermediate dicts), None fields left out."""
    data: str | None = None
    if isinstance(body, BaseModel):
        data = body.model_dump_json(exclude_none=True)
    elif body is not None:
        data = json.dumps(body)
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
    async with session.request(method, url, data=data, headers=_JSON if data is not None else None, **kwargs) as r:
        raw = await r.read()
        if r.status not in ok:
            raise ServerError(url, r.status, error_message(raw))
        return raw


async def call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    model: type[M],
    body: Body = None,
    *,
    ok: Collection[int] = (200,),
    timeout: float | None = None,
) -> M:
    """`fetch`, the answer decoded into `model` by pydantic's JSON code."""
    return model.model_validate_json(await fetch(session, method, url, body, ok=ok, timeout=timeout))


async def stream_frames(
    session: aiohttp.ClientSession, url: str, body: BaseModel
) -> AsyncIterator[tuple[int, int, bytes]]:
    """POST a batch (runtime/wire/streams.py) and yield each answer's (index, status, body) as it
    arrives. The batch itself refused raises ServerError; a broken connection TRANSPORT_ERRORS."""
    data = body.model_dump_json(exclude_none=True)
    async with session.post(url, data=data, headers=_JSON) as r:
        if r.status != 200:
            raise ServerError(url, r.status, error_message(await r.read()))
        while True:
            try:
                answer = await read_frame(r.content)
            except asyncio.IncompleteReadError as e:
                raise aiohttp.ClientPayloadError(f"{url}: the stream ended inside an answer") from e
            if answer is None:
                return
            yield answer


async def until_healthy(
    probe: Callable[[], Awaitable[T]],
    *,
    every: float,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    give_up: Callable[[], bool] | None = None,
) -> T | None:
    """Wait for a server to answer its /health: `probe` raises while it is not up (refused, no
    answer, or 503 while its engine loads) and is tried again every `every` seconds. Returns the
    answer; None once `give_up()` says the wait is no longer wanted; past `deadline` (of `clock`)
    the last probe's error is raised. The driver, its fleet and `kubedistill run` all wait so."""
    while give_up is None or not give_up():
        try:
            return await probe()
        except Exception:
            if deadline is not None and clock() > deadline:
                raise
            await asyncio.sleep(every)
    return None


class BlockingClient:
    """The same stack for code that blocks rather than awaits: an aiohttp session on a private
    event loop in a daemon thread. `run` takes any coroutine, so a caller fans requests out with
    asyncio.gather rather than a thread per request; safe to call from several threads. Closed by
    `close`, or else when collected or at interpreter exit (no "Unclosed client session")."""

    def __init__(self, timeout: float = 600.0, name: str = "http-client"):
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        thread.start()
        self.session = self.run(self._open(timeout))
        self._close = weakref.finalize(self, _shut, self._loop, thread, self.session)

    @staticmethod
    async def _open(timeout: float) -> aiohttp.ClientSession:
        return new_session(timeout)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the client's loop and wait for its result (or exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def fetch(
        self, method: str, url: str, body: Body = None, *, ok: Collection[int] = (200,), timeout: float | None = None
    ) -> bytes:
        return self.run(fetch(self.session, method, url, body, ok=ok, timeout=timeout))

    def call(
        self,
        method: str,
        url: str,
        model: type[M],
        body: Body = None,
        *,
        ok: Collection[int] = (200,),
        timeout: float | None = None,
    ) -> M:
        return self.run(call(self.session, method, url, model, body, ok=ok, timeout=timeout))

    def close(self) -> None:
        self._close()  # runs once; later calls do nothing

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shut(loop: asyncio.AbstractEventLoop, thread: threading.Thread, session: aiohttp.ClientSession) -> None:
    asyncio.run_coroutine_threadsafe(session.close(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
