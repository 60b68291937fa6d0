"""The teacher server (`kubedistill role teacher`): /score plus /health and /metrics."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from kubedistill.api.roleconfig import Identity, JobConfig
from kubedistill.api.spec import TeacherSpec
from kubedistill.runtime.engines.base import Engine
from kubedistill.runtime.metrics import RoleMetrics
from kubedistill.runtime.servers.http import answer_each, make_app
from kubedistill.runtime.wire.protocol import ScoreRequest, ScoreResponse
from kubedistill.runtime.wire.streams import ScoreBatch


def find_teacher(config: JobConfig, name: str | None) -> TeacherSpec:
    teachers = config.spec.teachers
    if name is None:
        if len(teachers) == 1:
            return teachers[0]
        raise ValueError(
            "--teacher (or KUBEDISTILL_TEACHER) is required: the job has teachers "
            f"{', '.join(t.name for t in teachers)}"
        )
    for t in teachers:
        if t.name == name:
            return t
    raise ValueError(f"--teacher {name!r}: the job's teachers are {', '.join(t.name for t in teachers)}")


def build_teacher_app(
    config: JobConfig, identity: Identity, teacher: TeacherSpec, engine: Engine, metrics: RoleMetrics | None = None
) -> FastAPI:
    metrics = metrics or RoleMetrics(config.job, "teacher", identity.replica)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.shutdown()

    app = make_app("teacher", engine, metrics, lifespan=lifespan)

    @app.post("/score", response_model=ScoreResponse)
    async def score(req: ScoreRequest) -> ScoreResponse:
        out = await engine.score(req)
        metrics["teacher_tokens"].labels(teacher=teacher.name).inc(len(out.logprobs))
        return out

    @app.post("/score/batch", response_model=None)
    async def score_batch(batch: ScoreBatch) -> StreamingResponse:
        """Many /score at once, each answer streamed as it is ready (runtime/wire/streams.py)."""
        return answer_each(batch.requests, score)

    return app
