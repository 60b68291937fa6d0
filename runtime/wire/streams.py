"""Many requests in one HTTP exchange, each answer streamed back as soon as it is ready.

The driver sends one /generate and one /score per sample; on a busy host, the HTTP work of those
requests (framing, routing, middleware, a task per request on both sides) costs more CPU than the
forwards of a small model. `POST /generate/batch` and `POST /score/batch` take the requests made
at the same moment in one body (GenerateBatch, ScoreBatch) and answer with one frame per request,
in the order they finish, so a short generation is not held back by a long one in the same batch:

    <index> <status> <length>\\n<length bytes of JSON>

`index` is the request's place in the batch, `status` what its single endpoint would have
answered (200 with the response model, else `{"error": ...}`), `length` the body's bytes
(length-prefixed, not newline-delimited: a score of a long sample is a long line). A batch whose
stream ends early leaves its unanswered requests to be sent again, as a dropped connection does.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, Field

from kubedistill.runtime.wire.protocol import GenerateRequest, ScoreRequest

FRAMES_MEDIA_TYPE = "application/x-kubedistill-frames"


class GenerateBatch(BaseModel):
    requests: list[GenerateRequest] = Field(min_length=1)


class ScoreBatch(BaseModel):
    requests: list[ScoreRequest] = Field(min_length=1)


def frame(index: int, status: int, body: bytes) -> bytes:
    """One answer of a batch, as the stream carries it."""
    return b"%d %d %d\n" % (index, status, len(body)) + body


class ByteReader(Protocol):
    """What read_frame needs of a reader (aiohttp's and asyncio's StreamReader)."""

    async def readline(self) -> bytes: ...
    async def readexactly(self, n: int) -> bytes: ...


async def read_frame(stream: ByteReader) -> tuple[int, int, bytes] | None:
    """The next (index, status, body) of a stream, None at its end."""
    head = await stream.readline()
    if not head:
        return None
    index, status, length = (int(x) for x in head.split())
    return index, status, await stream.readexactly(length)
