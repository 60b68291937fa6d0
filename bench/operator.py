"""Operator benchmark: create N DistillationJobs in the KMock emulator and time, as the API server
sees it, each job's creation -> the creation of its last child, with the real kopf operator
running in-process.

    .venv/bin/python bench/operator.py                 # N = 1, 20 and 100
    .venv/bin/python bench/operator.py --jobs 20
    .venv/bin/python bench/operator.py --stock-kmock   # the emulator as shipped (slow, see below)

The emulator runs in a child process, so the operator process holds only the operator (its peak
RSS and CPU are reported) and the emulator's CPU does not compete inside it. Times are stamped by
the emulator when it has stored an object (CLOCK_MONOTONIC, shared by both processes), so the
latency is what a client of the API server would observe.

KMock as shipped matches every request against its reactions by re-filtering its whole request
log (kept for test assertions): the cost of one request grows with the number served so far,
~20-40 ms per request after a few hundred, so it, not the operator, is the bottleneck (py-spy:
~90 % of the emulator's CPU in that scan). By default the emulator here is the tests'
FastEmulator (tests/operator_fixtures.py): KMock's objects, watch streams and reactions, but each
reaction's filter sees only the request being served (a real API server keeps no request log);
--stock-kmock measures the shipped one. docs/operator.md has both.

Reports p50/p95/max latency per N, jobs reconciled, reconcile errors, non-2xx API responses other
than the 409s of idempotent creates, the operator's CPU and peak RSS. Last line: the N=1 p50 in ms.
Targets (docs/design.md#performance-targets): p50 <= 500 ms; all 100 jobs reconciled with no error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

WAIT_SECONDS = 120.0
Created = dict[tuple[str, str], float]


def _emulator_class(stock: bool) -> Any:
    """The emulator, recording when it stored each created object."""
    import kmock

    from operator_fixtures import FastEmulator

    class RecordingEmulator(kmock.KubernetesEmulator if stock else FastEmulator):  # type: ignore[misc]
        created: Created
        failures: int

        async def _handle(self, request: Any) -> Any:
            try:
                response = await super()._handle(request)
            except Exception as exc:
                # 409 on a create is the idempotent re-create, not a failure.
                if getattr(exc, "status", None) != 409:
                    self.failures += 1
                raise
            data = request.data
            if request.method.value == "POST" and isinstance(data, dict) and data.get("kind"):
                self.created.setdefault((data["kind"], data["metadata"]["name"]), time.monotonic())
            return response

    return RecordingEmulator


def _serve_emulator(stock: bool, port_queue: Any, commands: Any, replies: Any) -> None:
    """The emulator on a free port, in its own process; answers 'poll' with what was created
    since the last poll and the count of failed non-create requests."""
    import kmock

    from operator_fixtures import prepare_emulator

    async def main() -> None:
        emulator = _emulator_class(stock)()
        emulator.created, emulator.failures = {}, 0
        async with emulator, kmock.Server(emulator) as server:
            prepare_emulator(emulator)
            port_queue.put(str(server.url))
            loop = asyncio.get_running_loop()
            reported: set[tuple[str, str]] = set()
            while await loop.run_in_executor(None, commands.get) == "poll":
                new = {k: t for k, t in emulator.created.items() if k not in reported}
                reported |= new.keys()
                usage = resource.getrusage(resource.RUSAGE_SELF)
                served = len(emulator._requests)  # the log KMock keeps of every request
                replies.put((new, emulator.failures, served, usage.ru_utime + usage.ru_stime))

    asyncio.run(main())


class Emulator:
    """The emulator child process, seen from the operator's process."""

    def __init__(self, stock: bool):
        ctx = multiprocessing.get_context("spawn")
        port_queue, self._commands, self._replies = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self._process = ctx.Process(
            target=_serve_emulator, args=(stock, port_queue, self._commands, self._replies), daemon=True
        )
        self._process.start()
        self.url: str = port_queue.get(timeout=60)
        self.created: Created = {}
        self.failures = 0
        self.served = 0
        """Requests the emulator has served."""
        self.cpu = 0.0
        """The emulator process's CPU seconds (user+sys)."""

    def poll(self) -> None:
        self._commands.put("poll")
        new, self.failures, self.served, self.cpu = self._replies.get(timeout=30)
        self.created.update(new)

    def stop(self) -> None:
        self._commands.put("stop")
        self._process.join(5)
        if self._process.is_alive():
            self._process.terminate()


async def _bench(emulator: Emulator, counts: list[int]) -> dict[int, dict[str, float]]:
    import aiohttp

    from kubedistill.api.job import GROUP, KIND, PLURAL, VERSION
    from kubedistill.operator.metrics import OperatorMetrics
    from operator_fixtures import NS, expected_children, job_manifest, reconcile_passes, running_operator

    url = emulator.url
    metrics = OperatorMetrics()
    results: dict[int, dict[str, float]] = {}
    base = f"{url}/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"

    async def run_batch(names: list[str]) -> list[float]:
        async def create(name: str) -> None:
            async with http.post(base, json=job_manifest(name)) as resp:
                resp.raise_for_status()

        await asyncio.gather(*(create(n) for n in names))
        wanted = {n: expected_children(n) | {(KIND, n)} for n in names}
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            await asyncio.to_thread(emulator.poll)
            if all(w <= emulator.created.keys() for w in wanted.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        done = [n for n in names if wanted[n] <= emulator.created.keys()]
        if len(done) < len(names):
            print(
                f"{len(names) - len(done)} of {len(names)} job(s) did not get all their children within "
                f"{WAIT_SECONDS:.0f} s",
                file=sys.stderr,
            )
        created = emulator.created
        return [max(created[c] for c in wanted[n]) - created[(KIND, n)] for n in done]

    async with (
        running_operator(url, resync_seconds=5.0, metrics=metrics, post_events=False),
        aiohttp.ClientSession() as http,
    ):
        await run_batch(["warmup"])  # the first job pays kopf's and the emulator's cold start
        for n in counts:
            await asyncio.to_thread(emulator.poll)
            before = (_cpu(), emulator.cpu, emulator.served, time.monotonic(), reconcile_passes(metrics))
            lat = sorted(await run_batch([f"b{n}-{i}" for i in range(n)]))
            after = (_cpu(), emulator.cpu, emulator.served, time.monotonic(), reconcile_passes(metrics))
            requests = after[2] - before[2]
            results[n] = {
                "operator_cpu_ms_per_job": (after[0] - before[0]) / n * 1000,
                "emulator_cpu_ms_per_request": (after[1] - before[1]) / max(requests, 1) * 1000,
                "requests_per_job": requests / n,
                "passes_per_job": (after[4] - before[4]) / n,
                "seconds": after[3] - before[3],
                "p50": statistics.median(lat) * 1000 if lat else float("nan"),
                "p95": lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))] * 1000 if lat else float("nan"),
                "max": lat[-1] * 1000 if lat else float("nan"),
                "reconciled": len(lat),
                "errors": metrics.registry.get_sample_value("kubedistill_operator_reconcile_errors_total") or 0.0,
                "api_failures": emulator.failures,
            }
    return results


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, action="append", help="batch sizes (default: 1, 20 and 100)")
    parser.add_argument(
        "--stock-kmock", action="store_true", help="the emulator as shipped (scans its request log on every request)"
    )
    args = parser.parse_args()
    counts = args.jobs or [1, 20, 100]
    logging.basicConfig(level=logging.ERROR)

    emulator = Emulator(stock=args.stock_kmock)
    try:
        # After the operator_fixtures import (which sets kopf's logger to WARNING): the daemons
        # cancelled at shutdown would print one line each.
        import operator_fixtures  # noqa: F401

        logging.getLogger("kopf").setLevel(logging.ERROR)
        wall = time.perf_counter()
        results = asyncio.run(_bench(emulator, counts))
        print(f"emulator: {'KMock as shipped' if args.stock_kmock else 'KMock without the request-log scan'}")
        print(f"wall time: {time.perf_counter() - wall:.1f} s")
    finally:
        emulator.stop()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"operator CPU: {usage.ru_utime + usage.ru_stime:.1f} s (user+sys) over the whole run")
    for n, r in results.items():
        print(
            f"N={n:<4} job created -> last child created: p50 {r['p50']:.0f} ms, p95 {r['p95']:.0f} ms, "
            f"max {r['max']:.0f} ms; reconciled {int(r['reconciled'])}/{n}; reconcile errors {int(r['errors'])}; "
            f"failed API calls {int(r['api_failures'])}"
        )
        print(
            f"       {r['requests_per_job']:.1f} API requests and {r['passes_per_job']:.1f} reconcile passes per job "
            f"(until its last child; requests incl. the job's own POST); operator CPU "
            f"{r['operator_cpu_ms_per_job']:.0f} ms per job; emulator CPU {r['emulator_cpu_ms_per_request']:.1f} ms "
            f"per request; batch done in {r['seconds']:.1f} s"
        )
    print(f"operator peak RSS: {usage.ru_maxrss / 1024:.0f} MiB")
    print(f"{results[counts[0]]['p50']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
