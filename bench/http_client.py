"""HTTP client benchmark (docs/servers.md, "The runtime's HTTP client"): aiohttp vs httpx.

A FastAPI/uvicorn server in a subprocess (as the rollout server runs) answers POST /generate
after --delay seconds with a GenerateResponse of --tokens tokens, and GET /version at once. This
process is the client, as the driver is:
  async   --requests /generate requests, --concurrency in flight, through the runtime's stack
          (runtime/wire/http.py: one aiohttp session, pydantic JSON) and through httpx.AsyncClient
          (no connection cap, the same pydantic encoding). The client's CPU per request is what
          the driver takes from the train step beside it.
  blocking  sequential GET /version, as the weight sender polls: the runtime's BlockingClient
          (aiohttp on a private loop) vs httpx.Client.
Rounds alternate the clients; the median of each is printed.

    .venv/bin/python bench/http_client.py --requests 2000 --concurrency 100 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

# At module level: FastAPI resolves the handlers' (string) annotations in this module's globals.
from kubedistill.runtime.wire.protocol import GenerateRequest, GenerateResponse, Sampling, VersionResponse


def serve(port: int, delay: float, tokens: int) -> None:
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(req: GenerateRequest) -> GenerateResponse:
        await asyncio.sleep(delay)
        return GenerateResponse(
            request_id=req.request_id,
            token_ids=list(range(tokens)),
            logprobs=[-0.5] * tokens,
            versions=[3] * tokens,
            finish_reason="length",
        )

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=3)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def request(i: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{i}", prompt_token_ids=list(range(64)), sampling=Sampling(max_tokens=256))


async def drive(send: Callable[[int], Awaitable[object]], n: int, concurrency: int) -> dict[str, float]:
    """n requests, `concurrency` in flight; the client's CPU and latencies."""
    latencies: list[float] = []
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i, next_i = next_i, next_i + 1
            t0 = time.perf_counter()
            await send(i)
            latencies.append(time.perf_counter() - t0)

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    latencies.sort()
    return {
        "cpu_ms_per_request": cpu / n * 1000,
        "requests_per_s": n / wall,
        "p50_ms": latencies[n // 2] * 1000,
        "p99_ms": latencies[int(n * 0.99)] * 1000,
    }


async def async_aiohttp(url: str, n: int, concurrency: int) -> dict[str, float]:
    from kubedistill.runtime.wire.http import call, new_session

    async with new_session() as session:
        await call(session, "POST", url + "/generate", GenerateResponse, request(-1))  # warm

        async def send(i: int) -> object:
            return await call(session, "POST", url + "/generate", GenerateResponse, request(i))

        return await drive(send, n, concurrency)


async def async_httpx(url: str, n: int, concurrency: int) -> dict[str, float]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def send(i: int) -> object:
            r = await client.post(
                url + "/generate",
                content=request(i).model_dump_json(exclude_none=True),
                headers={"Content-Type": "application/json"},
            )
            r.raise_for_status()
            return GenerateResponse.model_validate_json(r.content)

        await send(-1)
        return await drive(send, n, concurrency)


def blocking(name: str, url: str, n: int) -> dict[str, float]:
    get: Callable[[], object]
    if name == "aiohttp":
        from kubedistill.runtime.wire.http import BlockingClient

        client = BlockingClient()
        get, close = (lambda: client.call("GET", url + "/version", VersionResponse)), client.close
    else:
        import httpx

        hclient = httpx.Client(timeout=600)
        get, close = (lambda: VersionResponse.model_validate_json(hclient.get(url + "/version").content)), hclient.close
    try:
        get()
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            get()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        close()
    return {"cpu_ms_per_request": cpu / n * 1000, "ms_per_request": wall / n * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.05, help="seconds the server takes per /generate")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--blocking-requests", type=int, default=500)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.delay, args.tokens)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--delay", str(args.delay), "--tokens", str(args.tokens)]
    )
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        print(
            f"# {args.requests} POST /generate, {args.concurrency} in flight, {args.tokens}-token answers after "
            f"{args.delay * 1000:.0f} ms; {args.blocking_requests} sequential GET /version; {args.rounds} rounds",
            flush=True,
        )
        results: dict[str, list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for name, fn in (("aiohttp", async_aiohttp), ("httpx", async_httpx)):
                out = asyncio.run(fn(url, args.requests, args.concurrency))
                results.setdefault(f"async {name}", []).append(out)
                print(f"round {r} async {name}: {out}", flush=True)
            for name in ("aiohttp", "httpx"):
                out = blocking(name, url, args.blocking_requests)
                results.setdefault(f"blocking {name}", []).append(out)
                print(f"round {r} blocking {name}: {out}", flush=True)
        print("# medians")
        for name, rounds in results.items():
            med = {k: round(statistics.median(x[k] for x in rounds), 2) for k in rounds[0]}
            print(f"{name:18s} {med}")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
