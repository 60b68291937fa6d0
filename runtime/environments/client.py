"""The driver's client of environment servers, spoken through OpenEnv's protocol.

OpenEnv (PyPI `openenv-core` 0.3 / `openenv` 0.10; ../shared/notes/openenv-facts.md) serves each
environment over HTTP and a WebSocket. Its HTTP `/reset` and `/step` are stateless: each request
builds a fresh environment and closes it, so a `/step` never sees the episode a `/reset` began.
A stateful episode is one WebSocket session on `/ws`: the server gives each connection its own
environment instance (up to its `max_concurrent_envs`, default 1) and frees it when the
connection closes. The messages are JSON text frames:

    -> {"type": "reset", "data": {<reset kwargs: seed, episode_id, ...>}}
    -> {"type": "step", "data": {<action fields>}}
    -> {"type": "close"}
    <- {"type": "observation", "data": {"observation": {...}, "reward": float|null, "done": bool}}
    <- {"type": "error", "data": {"message": "...", "code": "EXECUTION_ERROR" | ...}}

So `EnvironmentClient` holds one WebSocket per episode, through aiohttp (the runtime's one HTTP
client, runtime/wire/http.py). Every failure comes out as `EpisodeFailed` with a `reason` from
a small fixed set (it labels kubedistill_env_errors_total), so the driver ends the trace with that
reason and goes on.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from kubedistill.runtime.wire.http import SessionHolder

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Largest frame accepted from a server: an observation a student reads is far smaller, and a
runaway one fails the episode ("malformed") instead of filling the driver's memory."""
CAPACITY_WAIT_SECONDS = 0.05
"""The first wait before asking a full environment again (doubling, up to 1 s)."""
CLOSE_SECONDS = 2.0
"""How long a close waits for the server: the episode is over either way."""

REASONS = ("timeout", "malformed", "gone", "capacity", "rejected", "error")
"""EpisodeFailed.reason, besides `http_<status>`:
* timeout: no answer within the call's timeout (the episode is abandoned: its session closed).
* malformed: the answer is not OpenEnv's JSON (not JSON, wrong shape, wrong field types, too big).
* gone: the server could not be reached, or the connection closed or broke mid-episode.
* capacity: the server holds its `max_concurrent_envs` sessions already (CAPACITY_REACHED).
* rejected: the server refused our message (VALIDATION_ERROR: the action has no `actionKey`
  field the environment knows; INVALID_JSON; UNKNOWN_TYPE): a configuration fault.
* error: the environment itself raised (EXECUTION_ERROR, FACTORY_ERROR, SESSION_ERROR).
* http_<status>: the WebSocket handshake was answered with an HTTP status (403: no /ws route
  there, as Starlette refuses an unknown WebSocket path).
"""
_ERROR_CODES = {
    "CAPACITY_REACHED": "capacity",
    "VALIDATION_ERROR": "rejected",
    "INVALID_JSON": "rejected",
    "UNKNOWN_TYPE": "rejected",
}


class EpisodeFailed(Exception):
    """An episode could not go on; `reason` is one of REASONS or `http_<status>`."""

    def __init__(self, reason: str, url: str, message: str = ""):
        super().__init__(f"{url}: {reason}" + (f": {message}" if message else ""))
        self.reason = reason
        self.url = url
        self.message = message


class EnvironmentConfig(BaseModel):
    """One environment of a job, as the driver knows it (spec.environments[] and config.json's
    endpoints.environments)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    urls: list[str] = Field(min_length=1, description="One per replica: http://host:port (ws:// also taken)")
    protocol: Literal["openenv"] = "openenv"
    action_key: str = Field("message", description="The action field that carries the student's turn")
    observation_key: str | None = Field(
        None, description="The observation field rendered to the student; None: its JSON less done/reward/metadata"
    )
    timeout_seconds: float = Field(30.0, gt=0, description="Per reset or step call, connecting included")


@dataclass(frozen=True)
class StepResult:
    observation_text: str
    reward: float | None
    done: bool


def ws_url(url: str) -> str:
    """OpenEnv's session route under a server's base URL (http -> ws, https -> wss)."""
    base = url.rstrip("/")
    for scheme, ws_scheme in (("http://", "ws://"), ("https://", "wss://")):
        if base.startswith(scheme):
            base = ws_scheme + base[len(scheme) :]
    if not base.startswith(("ws://", "wss://")):
        base = "ws://" + base
    return base if base.endswith("/ws") else base + "/ws"


def http_url(url: str) -> str:
    """A server's base URL over HTTP (its /health, /schema), whichever form `url` was given in."""
    base = url.rstrip("/")
    base = base[: -len("/ws")] if base.endswith("/ws") else base
    for ws_scheme, scheme in (("ws://", "http://"), ("wss://", "https://")):
        if base.startswith(ws_scheme):
            base = scheme + base[len(ws_scheme) :]
    return base if base.startswith(("http://", "https://")) else "http://" + base


def render_observation(observation: Mapping[str, Any], key: str | None) -> str:
    """The text the student reads: the `key` field (a string as is, anything else as JSON), or
    the observation's JSON without done/reward/metadata (openenv 0.10 keeps metadata inside the
    observation, 0.3 drops it; neither belongs in the student's context)."""
    if key is not None:
        if key not in observation:
            raise ValueError(f"the observation has no field {key!r} (it has {sorted(observation)})")
        value = observation[key]
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    rest = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
    return json.dumps(rest, ensure_ascii=False)


def parse_observation(raw: str | bytes, key: str | None) -> StepResult:
    """One answer of the server as a StepResult; raises ValueError (-> "malformed") or
    _ServerError (the server's own error message)."""
    doc = json.loads(raw)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise ValueError("not an object with a `data` object")
    data = doc["data"]
    if doc.get("type") == "error":
        raise _ServerError(str(data.get("code", "")), str(data.get("message", "")))
    if doc.get("type") != "observation":
        raise ValueError(f"unknown message type {doc.get('type')!r}")
    observation, reward, done = data.get("observation"), data.get("reward"), data.get("done", False)
    if not isinstance(observation, dict):
        raise ValueError("`observation` is not an object")
    if not isinstance(done, bool):
        raise ValueError(f"`done` is {done!r}, not a boolean")
    if reward is not None and (not isinstance(reward, int | float) or not math.isfinite(reward)):
        raise ValueError(f"`reward` is {reward!r}, not a finite number")
    return StepResult(render_observation(observation, key), None if reward is None else float(reward), done)


class _ServerError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class EnvironmentClient(SessionHolder):
    """Episodes against one OpenEnv server, one at a time: `open` starts one (a WebSocket session
    of its own, then reset), `step` sends a student turn, `close` ends it; `open` again starts the
    next. Every call is bounded by `timeout`; every failure is EpisodeFailed, after which the
    session is closed and the client may open a new episode. `session` is shared (the driver's
    aiohttp session); without one the client makes its own and closes it on `aclose`."""

    def __init__(
        self,
        url: str,
        *,
        action_key: str = "message",
        observation_key: str | None = None,
        timeout: float = 30.0,
        session: aiohttp.ClientSession | None = None,
    ):
        self.url = url
        self.action_key = action_key
        self.observation_key = observation_key
        self.timeout = timeout
        super().__init__(session)
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        # A WebSocket carries one request at a time: answers are matched to requests by order.
        self._lock = asyncio.Lock()
        self.on_close: Callable[[], None] | None = None
        """Called once when an opened episode ends (closed, or failed): the pool's bookkeeping."""

    @property
    def is_open(self) -> bool:
        return self._ws is not None

    @property
    def base_url(self) -> str:
        """The server's base URL over HTTP (how the driver names a server it waits for)."""
        return http_url(self.url)

    async def health(self) -> None:
        """GET /health (every OpenEnv server has it); raises EpisodeFailed unless it answers 200."""
        url = http_url(self.url) + "/health"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                if r.status != 200:
                    raise EpisodeFailed(f"http_{r.status}", self.url, "/health")
        except TimeoutError as e:
            raise EpisodeFailed("timeout", self.url, "/health") from e
        except aiohttp.ClientError as e:
            raise EpisodeFailed("gone", self.url, f"/health: {e}") from e

    async def open(self, **reset_kwargs: Any) -> StepResult:
        """Start an episode: connect a session and reset it with `reset_kwargs` (JSON values:
        seed, episode_id, and whatever the environment's reset takes). Returns the first
        observation."""
        if self._ws is not None:
            raise RuntimeError(f"{self.url}: an episode is open already; close it first")
        async with self._lock:
            try:
                async with asyncio.timeout(self.timeout):
                    self._ws = await self.session.ws_connect(
                        ws_url(self.url),
                        max_msg_size=MAX_MESSAGE_BYTES,
                        timeout=aiohttp.ClientWSTimeout(ws_close=CLOSE_SECONDS),
                        autoclose=True,
                    )
            except TimeoutError as e:
                raise self._failed("timeout", "connecting") from e
            except aiohttp.WSServerHandshakeError as e:
                raise self._failed(f"http_{e.status}", f"WebSocket handshake: {e.message}") from e
            except (aiohttp.ClientError, OSError) as e:
                raise self._failed("gone", f"connecting: {e}") from e
            return await self._request({"type": "reset", "data": dict(reset_kwargs)})

    async def step(self, text: str) -> StepResult:
        """Send one student turn as the action `{action_key: text}`."""
        if self._ws is None:
            raise RuntimeError(f"{self.url}: no episode is open")
        async with self._lock:
            return await self._request({"type": "step", "data": {self.action_key: text}})

    async def close(self) -> None:
        """End the episode (the server frees its environment instance). Never raises: the
        episode is over either way."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:
            async with asyncio.timeout(CLOSE_SECONDS):
                if not ws.closed:
                    await ws.send_str(json.dumps({"type": "close"}))
                    # The server closes the connection once it has freed the session: wait for its
                    # close frame (autoclose answers it). Closing first makes openenv-core 0.3's
                    # server log a traceback per episode (its own close then raises).
                    await ws.receive()
                await ws.close()
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass
        finally:
            self._ended()

    async def aclose(self) -> None:
        """`close`, and the client's own aiohttp session if it made one."""
        await self.close()
        await self.close_session()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, message: dict[str, Any]) -> StepResult:
        ws = self._ws
        assert ws is not None
        what = message["type"]
        try:
            async with asyncio.timeout(self.timeout):
                await ws.send_str(json.dumps(message))
                msg = await ws.receive()
        except TimeoutError as e:
            raise await self._fail("timeout", f"{what}: no answer in {self.timeout:g} s") from e
        except (aiohttp.ClientError, OSError) as e:
            raise await self._fail("gone", f"{what}: {e}") from e
        except asyncio.CancelledError:
            # The driver gave the trace up mid-call: the answer may still come, so the session
            # cannot carry another request; end it (and free the pool's count) before going on.
            await asyncio.shield(self.close())
            raise
        if msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            try:
                return parse_observation(msg.data, self.observation_key)
            except _ServerError as e:
                raise await self._fail(_ERROR_CODES.get(e.code, "error"), f"{what}: {e.code}: {e}") from e
            except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise await self._fail("malformed", f"{what}: {e}") from e
        if msg.type == aiohttp.WSMsgType.ERROR and isinstance(msg.data, aiohttp.WebSocketError):
            # A protocol violation or a frame over MAX_MESSAGE_BYTES: the server spoke, wrongly.
            raise await self._fail("malformed", f"{what}: {msg.data}")
        # CLOSE / CLOSING / CLOSED, or a broken connection: the server (or its session) is gone.
        raise await self._fail("gone", f"{what}: the connection closed ({msg.type.name}: {msg.extra or msg.data})")

    def _failed(self, reason: str, message: str) -> EpisodeFailed:
        self._ended()
        return EpisodeFailed(reason, self.url, message)

    async def _fail(self, reason: str, message: str) -> EpisodeFailed:
        """A failed call ends the episode: the session's state is unknown (an answer may still be
        on its way), so it is closed rather than reused."""
        await self.close()
        return EpisodeFailed(reason, self.url, message)

    def _ended(self) -> None:
        callback, self.on_close = self.on_close, None
        if callback is not None:
            callback()


class EnvironmentPool(SessionHolder):
    """Episodes spread over an environment's replicas: `open` starts one on the replica with the
    fewest open episodes (ties to the first listed), trying the next replica when one is gone,
    full or refuses the handshake. `max_sessions_per_replica` (what each server's
    `max_concurrent_envs` allows) makes `open` wait for a free session rather than fail with
    "capacity": with the fewest-open choice, a free slot in the total is a free slot on the
    replica chosen."""

    def __init__(
        self,
        config: EnvironmentConfig,
        *,
        session: aiohttp.ClientSession | None = None,
        max_sessions_per_replica: int | None = None,
    ):
        super().__init__(session)
        self.config = config
        self.outstanding: dict[str, int] = dict.fromkeys(config.urls, 0)
        """Open episodes per replica URL."""
        self._slots = (
            asyncio.Semaphore(max_sessions_per_replica * len(config.urls)) if max_sessions_per_replica else None
        )

    def client(self, url: str) -> EnvironmentClient:
        return EnvironmentClient(
            url,
            action_key=self.config.action_key,
            observation_key=self.config.observation_key,
            timeout=self.config.timeout_seconds,
            session=self.session,
        )

    async def open(self, **reset_kwargs: Any) -> tuple[EnvironmentClient, StepResult]:
        """An opened episode and its first observation; `client.close()` ends it. Raises the last
        replica's EpisodeFailed when none could open it. A timeout or an error of the environment
        is not tried elsewhere: that replica answered, or may still."""
        if self._slots is not None:
            await self._slots.acquire()
        last: EpisodeFailed | None = None
        try:
            # No await between the sort and the count's increment: concurrent opens spread.
            for url in sorted(self.outstanding, key=self.outstanding.__getitem__):
                self.outstanding[url] += 1
                client = self.client(url)
                client.on_close = functools.partial(self._release, url, False)
                try:
                    first = await client.open(**reset_kwargs)
                except EpisodeFailed as e:  # the client released `url` already
                    last = e
                    if e.reason in ("gone", "capacity") or e.reason.startswith("http_"):
                        continue
                    break
                client.on_close = functools.partial(self._release, url, True)
                return client, first
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        if self._slots is not None:
            self._slots.release()
        assert last is not None
        raise last

    def _release(self, url: str, slot: bool) -> None:
        self.outstanding[url] -= 1
        if slot and self._slots is not None:
            self._slots.release()

    async def aclose(self) -> None:
        await self.close_session()


class Environments:
    """A job's environments (spec.environments), one EnvironmentPool each: the driver opens its
    traces' episodes here, and waits for every replica's /health before the first one."""

    def __init__(self, configs: Sequence[EnvironmentConfig]):
        self.pools = {c.name: EnvironmentPool(c) for c in configs}

    async def open(self, name: str, seed: int | None) -> EnvironmentClient:
        """An episode on environment `name`. The reset's own observation is not used: a row's
        prompt is its task. While every replica holds all the sessions it allows ("capacity": more
        traces in flight than the servers' max_concurrent_envs), it waits for one to free, up to
        the environment's timeoutSeconds, rather than end the trace."""
        pool = self.pools[name]
        deadline = time.monotonic() + pool.config.timeout_seconds
        wait = CAPACITY_WAIT_SECONDS
        while True:
            try:
                client, _first = await pool.open(seed=seed)
                return client
            except EpisodeFailed as e:
                if e.reason != "capacity" or time.monotonic() + wait > deadline:
                    raise
            await asyncio.sleep(wait)
            wait = min(wait * 2, 1.0)

    def replicas(self) -> list[EnvironmentClient]:
        """A client of every replica, for its /health."""
        return [pool.client(url) for pool in self.pools.values() for url in pool.config.urls]

    async def aclose(self) -> None:
        for pool in self.pools.values():
            await pool.aclose()
