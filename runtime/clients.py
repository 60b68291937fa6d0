"""Async HTTP clients of the rollout and teacher servers (used by the driver)."""

from __future__ import annotations

from typing import Optional, Sequence

import httpx

from kubedistill.runtime.protocol import (
    AbortRequest, AbortResponse, GenerateRequest, GenerateResponse, HealthResponse, ScoreRequest,
    ScoreResponse, VersionResponse,
)


class ServerError(RuntimeError):
    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: {status} {message}")
        self.status = status
        self.message = message


class _Client:
    def __init__(self, base_url: str, timeout: float = 600.0, client: Optional[httpx.AsyncClient] = None):
        self.base_url = base_url.rstrip("/")
        self._own = client is None
        self.http = client or httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def _post(self, path: str, body) -> dict:
        r = await self.http.post(self.base_url + path, json=body.model_dump(mode="json", exclude_none=True))
        return self._check(path, r)

    async def _get(self, path: str) -> dict:
        return self._check(path, await self.http.get(self.base_url + path))

    def _check(self, path: str, r: httpx.Response) -> dict:
        if r.status_code != 200:
            try:
                msg = r.json().get("error", r.text)
            except ValueError:
                msg = r.text
            raise ServerError(self.base_url + path, r.status_code, msg)
        return r.json()

    async def health(self) -> HealthResponse:
        return HealthResponse.model_validate(await self._get("/health"))

    async def aclose(self) -> None:
        if self._own:
            await self.http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class RolloutClient(_Client):
    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        return GenerateResponse.model_validate(await self._post("/generate", req))

    async def abort(self, request_ids: Optional[Sequence[str]] = None) -> AbortResponse:
        body = AbortRequest(request_ids=list(request_ids) if request_ids is not None else None)
        return AbortResponse.model_validate(await self._post("/abort", body))

    async def version(self) -> int:
        return VersionResponse.model_validate(await self._get("/version")).version


class TeacherClient(_Client):
    async def score(self, req: ScoreRequest) -> ScoreResponse:
        return ScoreResponse.model_validate(await self._post("/score", req))
