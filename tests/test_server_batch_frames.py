"""A batch's answers as the servers stream them (runtime/servers/http.py answer_each): the
answers that finish together go out as one chunk, each still framed alone, in the order they
finished; an error is the request's own frame."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from kubedistill.runtime.engines.base import BadRequest
from kubedistill.runtime.servers.http import answer_each
from kubedistill.runtime.wire.streams import read_frame


class Echo(BaseModel):
    value: int


async def _chunks(requests: list[int], gates: dict[int, asyncio.Event]) -> list[bytes]:
    async def handle(r: int) -> Echo:
        await gates[r].wait()
        if r < 0:
            raise BadRequest(f"{r} is negative")
        return Echo(value=r)

    body = answer_each(requests, handle).body_iterator
    chunks: list[bytes] = []

    async def read() -> None:
        async for chunk in body:
            chunks.append(chunk if isinstance(chunk, bytes) else chunk.encode())

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    for r in (1, 2, -3):  # finish together
        gates[r].set()
    for _ in range(5):
        await asyncio.sleep(0)
    gates[4].set()  # later, alone
    await reader
    return chunks


def test_answers_finished_together_share_one_chunk() -> None:
    requests = [1, 2, -3, 4]
    chunks = asyncio.run(_chunks(requests, {r: asyncio.Event() for r in requests}))
    assert len(chunks) == 2

    async def frames(chunk: bytes) -> list[tuple[int, int, bytes]]:
        reader = asyncio.StreamReader()
        reader.feed_data(chunk)
        reader.feed_eof()
        out = []
        while (f := await read_frame(reader)) is not None:
            out.append(f)
        return out

    first, second = (asyncio.run(frames(c)) for c in chunks)
    assert [(i, status) for i, status, _ in first] == [(0, 200), (1, 200), (2, 400)]
    assert [Echo.model_validate_json(body).value for _, _, body in first[:2]] == [1, 2]
    assert b"-3 is negative" in first[2][2]
    assert [(i, status, Echo.model_validate_json(body).value) for i, status, body in second] == [(3, 200, 4)]
