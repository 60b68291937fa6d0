"""The runtime's one HTTP client stack (runtime/wire/http.py): what counts as a transport error
(the request may be sent again) and what as a server's answer (ServerError), through the async
helpers the driver uses and the BlockingClient the weight sender and `kubedistill run` use.

The servers are raw asyncio sockets, so each failure is exactly the one named."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from kubedistill.runtime.wire.http import (
    TRANSPORT_ERRORS,
    BlockingClient,
    ServerError,
    call,
    fetch,
    new_session,
    until_healthy,
)
from kubedistill.runtime.wire.protocol import VersionResponse, WeightsGroupRequest

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(request line + headers, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length) if length else b""


def answer(status: int, body: bytes, content_type: str = "application/json") -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    return handle


async def cut_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Headers promise 100 bytes; 10 come, then the connection closes."""
    await read_request(reader)
    writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"version"')
    await writer.drain()
    writer.close()


async def close_without_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    writer.close()


async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    await reader.read()  # until the client gives up and closes


def refused_url() -> str:
    with socket.socket() as s:  # a port nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def failure(url: str, timeout: float = 5.0) -> Exception:
    async with new_session() as session:
        with pytest.raises(Exception) as e:
            await call(session, "GET", url + "/version", VersionResponse, timeout=timeout)
    return e.value


async def test_refused_connection_is_a_transport_error() -> None:
    assert isinstance(await failure(refused_url()), TRANSPORT_ERRORS)


@pytest.mark.parametrize("handler", [cut_mid_body, close_without_answer], ids=["mid-body", "before-answer"])
async def test_dropped_connection_is_a_transport_error(handler: Handler) -> None:
    async with serving(handler) as url:
        assert isinstance(await failure(url), TRANSPORT_ERRORS)


async def test_timeout_is_a_transport_error() -> None:
    async with serving(never_answer) as url:
        e = await failure(url, timeout=0.3)
    assert isinstance(e, TimeoutError) and isinstance(e, TRANSPORT_ERRORS)


@pytest.mark.parametrize(
    "status,body,message",
    [
        (409, b'{"error": "request_id \'r1\' is already in flight"}', "request_id 'r1' is already in flight"),
        (422, b'{"detail": "bad"}', '{"detail": "bad"}'),
        (503, b"engine still loading\n", "engine still loading"),
        (500, b"", ""),
    ],
)
async def test_error_status_is_a_server_error_naming_server_and_status(status: int, body: bytes, message: str) -> None:
    async with serving(answer(status, body)) as url:
        e = await failure(url)
    assert isinstance(e, ServerError) and not isinstance(e, TRANSPORT_ERRORS)
    assert (e.url, e.status, e.message) == (url + "/version", status, message)
    assert str(e) == f"{url}/version: {status} {message}"


async def test_expected_statuses_and_pydantic_bodies() -> None:
    seen: list[bytes] = []

    async def echo_version(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, body = await read_request(reader)
        seen.append(head.split(b"\r\n")[0])
        seen.append(body)
        out = b'{"version": 7}'
        writer.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(out), out))
        await writer.drain()
        writer.close()

    async with serving(echo_version) as url, new_session() as session:
        body = WeightsGroupRequest(epoch="e1")
        with pytest.raises(ServerError, match="202"):  # not an answer the caller takes
            await call(session, "POST", url + "/weights/group", VersionResponse, body)
        got = await call(session, "POST", url + "/weights/group", VersionResponse, body, ok=(200, 202))
        assert got == VersionResponse(version=7)
        assert await fetch(session, "POST", url + "/x", {"bytes": 3}, ok=(202,)) == b'{"version": 7}'
    assert seen[0] == b"POST /weights/group HTTP/1.1"
    assert json.loads(seen[1]) == {"epoch": "e1"}  # None fields are left out
    assert json.loads(seen[5]) == {"bytes": 3}


async def test_blocking_client_classifies_the_same() -> None:
    """The weight sender's and the launcher's client: the same stack on a private loop, called
    from a thread that blocks (here: a worker thread, while this loop serves)."""
    client = BlockingClient(timeout=5.0)
    try:
        with pytest.raises(TRANSPORT_ERRORS):
            await asyncio.to_thread(client.call, "GET", refused_url() + "/version", VersionResponse)
        async with serving(never_answer) as url:
            with pytest.raises(TimeoutError):
                await asyncio.to_thread(client.call, "GET", url + "/version", VersionResponse, timeout=0.3)
        async with serving(answer(503, b'{"error": "the weight-sync group is not formed"}')) as url:
            with pytest.raises(ServerError, match="503 the weight-sync group is not formed") as e:
                await asyncio.to_thread(client.call, "GET", url + "/version", VersionResponse)
            assert e.value.status == 503 and not isinstance(e.value, TRANSPORT_ERRORS)
        async with serving(answer(200, b'{"version": 3}')) as url:
            got = await asyncio.to_thread(client.call, "GET", url + "/version", VersionResponse)
            assert got.version == 3
    finally:
        await asyncio.to_thread(client.close)
    client.close()  # closing twice is harmless


def frames_then_cut(*frames: bytes) -> Handler:
    """A batch endpoint that streams `frames` (chunked), then drops the connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await send_frames(writer, *frames)

    return handle


async def send_frames(writer: asyncio.StreamWriter, *frames: bytes) -> None:
    """Answer with `frames` (chunked), then close the connection."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-kubedistill-frames\r\n")
    writer.write(b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    for f in frames:
        writer.write(b"%x\r\n" % len(f) + f + b"\r\n")
    await writer.drain()
    writer.close()


async def test_a_batch_cut_short_fails_only_its_unanswered_requests() -> None:
    """Requests made together go as one batch (runtime/wire/streams.py): the caller whose answer
    came keeps it, the one whose request the server refused gets its ServerError, and those left
    unanswered when the connection broke get a transport error, so the driver sends them again."""
    from kubedistill.runtime.driver.clients import RolloutClient
    from kubedistill.runtime.wire.protocol import GenerateRequest
    from kubedistill.runtime.wire.streams import frame

    answered = b'{"request_id": "b", "token_ids": [4], "logprobs": [-0.5], "versions": [2], "finish_reason": "length"}'
    handler = frames_then_cut(
        frame(1, 200, answered), frame(2, 400, b'{"error": "token id 99 is outside the vocabulary"}'), b"0 200 50\n{"
    )
    async with serving(handler) as url, RolloutClient(url) as c:
        outs = await asyncio.gather(
            *(c.generate(GenerateRequest(request_id=r, prompt_token_ids=[1])) for r in "abcd"), return_exceptions=True
        )
    assert outs[1].request_id == "b" and outs[1].token_ids == [4] and outs[1].versions == [2]
    assert isinstance(outs[2], ServerError) and outs[2].status == 400 and "token id 99" in outs[2].message
    assert all(isinstance(o, TRANSPORT_ERRORS) for o in (outs[0], outs[3])), outs


async def test_a_batch_whose_connection_closes_before_any_answer_goes_out_once_more() -> None:
    """The server closing an idle connection as a batch goes out (nothing started): the batch is
    sent again, once, rather than failing each of its requests; a second close fails them all."""
    from kubedistill.runtime.driver.clients import RolloutClient
    from kubedistill.runtime.wire.protocol import GenerateRequest
    from kubedistill.runtime.wire.streams import frame

    def answer_of(rid: str) -> bytes:
        return json.dumps(
            {"request_id": rid, "token_ids": [4], "logprobs": [-0.5], "versions": [0], "finish_reason": "length"}
        ).encode()

    def closing_first(closes: int) -> tuple[Handler, list[int]]:
        seen: list[int] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            seen.append(1)
            if len(seen) > closes:
                await send_frames(writer, *(frame(i, 200, answer_of(r)) for i, r in enumerate("abc")))
                return
            writer.close()

        return handle, seen

    handler, seen = closing_first(1)
    async with serving(handler) as url, RolloutClient(url) as c:
        outs = await asyncio.gather(*(c.generate(GenerateRequest(request_id=r, prompt_token_ids=[1])) for r in "abc"))
    assert [o.request_id for o in outs] == ["a", "b", "c"] and len(seen) == 2
    handler, seen = closing_first(2)
    async with serving(handler) as url, RolloutClient(url) as c:
        failed = await asyncio.gather(
            *(c.generate(GenerateRequest(request_id=r, prompt_token_ids=[1])) for r in "abc"), return_exceptions=True
        )
    assert all(isinstance(o, TRANSPORT_ERRORS) for o in failed) and len(seen) == 2


async def test_until_healthy_probes_until_an_answer_a_give_up_or_the_deadline() -> None:
    tries: list[float] = []
    now = 0.0

    async def up_at_third() -> str:
        tries.append(now)
        if len(tries) < 3:
            raise ServerError("http://s/health", 503, "loading")
        return "ok"

    assert await until_healthy(up_at_third, every=0.01) == "ok" and len(tries) == 3
    tries.clear()
    assert await until_healthy(up_at_third, every=0.01, give_up=lambda: len(tries) == 1) is None
    assert len(tries) == 1

    async def down() -> str:
        nonlocal now
        now += 1.0
        raise ConnectionRefusedError("nothing listens")

    with pytest.raises(ConnectionRefusedError):
        await until_healthy(down, every=0.0, deadline=3.0, clock=lambda: now)
    assert now == 4.0  # probed at 1, 2 and 3, which are not past the deadline; 4 is


async def test_kubedistill_run_starts_a_wave_once_the_last_ones_servers_answer() -> None:
    """Supervisor.wait_healthy (GPU sharing's waves): True once every server of the wave answers
    /health, False as soon as one of its processes ended, True at the deadline all the same."""
    from types import SimpleNamespace

    from kubedistill.api.roleconfig import Role
    from kubedistill.runtime.entrypoints.local import Supervisor

    statuses = [503, 503, 200]

    async def loading_then_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer(statuses.pop(0) if len(statuses) > 1 else statuses[0], b"{}")(reader, writer)

    exits: dict[str, int | None] = {}
    job = SimpleNamespace(job=SimpleNamespace(spec=SimpleNamespace(weight_sync=SimpleNamespace(timeout_seconds=2))))
    with BlockingClient() as http:
        supervisor = Supervisor(job, SimpleNamespace(poll=lambda: exits), {}, print, False, http)  # type: ignore[arg-type]

        def wave(url: str) -> list[SimpleNamespace]:
            port = int(url.rsplit(":", 1)[1])
            return [SimpleNamespace(name="rollout-0", port=port, identity=SimpleNamespace(role=Role.rollout))]

        async with serving(loading_then_up) as url:
            assert await asyncio.to_thread(supervisor.wait_healthy, wave(url)) is True
            assert statuses == [200]  # it waited through both 503s
            exits["rollout-0"] = 1
            assert await asyncio.to_thread(supervisor.wait_healthy, wave(url)) is False
        exits.clear()
        t0 = time.monotonic()
        assert await asyncio.to_thread(supervisor.wait_healthy, wave(refused_url())) is True
        assert 2 <= time.monotonic() - t0 < 10
