"""Operator benchmark: create N DistillationJobs in the KMock emulator and time create -> every
child present, with the real kopf operator running in-process.

    .venv/bin/python bench/operator.py            # N = 1 and N = 100
    .venv/bin/python bench/operator.py --jobs 20

Reports p50/p95 latency per N, reconcile errors, and the operator process's peak RSS. The
emulator runs in a child process so the RSS is the operator's own. Last line: the N=1 p50 in ms.
Targets (DESIGN.md section 9): p50 <= 500 ms; all 100 jobs reconciled with no error.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _serve_emulator(port_queue: Any) -> None:
    """The KMock API emulator on a free port, in its own process."""
    import kmock

    from operator_fixtures import prepare_emulator

    async def main() -> None:
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            prepare_emulator(emulator)
            port_queue.put(str(server.url))
            await asyncio.Event().wait()

    asyncio.run(main())


async def _bench(url: str, counts: list[int]) -> dict[int, dict[str, float]]:
    import aiohttp

    from kubedistill.api.job import GROUP, PLURAL, VERSION
    from kubedistill.operator.metrics import OperatorMetrics
    from operator_fixtures import NS, expected_children, job_manifest, running_operator

    metrics = OperatorMetrics()
    results: dict[int, dict[str, float]] = {}
    seen: dict[tuple[str, str], float] = {}
    async with running_operator(url, resync_seconds=5.0, metrics=metrics, post_events=False), aiohttp.ClientSession() as http:
        watchers = [asyncio.create_task(_watch(http, url, kind, path, seen)) for kind, path in WATCHED]
        # Warm-up: the first job pays kopf's and the emulator's cold start.
        batch = (GROUP, VERSION, PLURAL, NS, job_manifest, expected_children, seen)
        await _run_batch(http, url, ["warmup"], *batch)
        for n in counts:
            names = [f"b{n}-{i}" for i in range(n)]
            latencies = await _run_batch(http, url, names, *batch)
            lat = sorted(latencies)
            results[n] = {
                "p50": statistics.median(lat) * 1000,
                "p95": lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))] * 1000,
                "max": lat[-1] * 1000,
                "reconciled": len(lat),
            }
        errors = metrics.registry.get_sample_value("kubedistill_operator_reconcile_errors_total") or 0.0
        for r in results.values():
            r["errors"] = errors
        for w in watchers:
            w.cancel()
    return results


async def _run_batch(http: Any, url: str, names: list[str], group: str, version: str, plural: str, ns: str,
                     job_manifest: Any, expected_children: Any, seen: dict[tuple[str, str], float]) -> list[float]:
    base = f"{url}/apis/{group}/{version}/namespaces/{ns}/{plural}"
    wanted = {n: expected_children(n) for n in names}
    started: dict[str, float] = {}

    async def create(name: str) -> None:
        started[name] = time.perf_counter()
        async with http.post(base, json=job_manifest(name)) as resp:
            resp.raise_for_status()

    await asyncio.gather(*(create(n) for n in names))
    deadline = time.perf_counter() + 120
    while time.perf_counter() < deadline and not all(w <= seen.keys() for w in wanted.values()):
        await asyncio.sleep(0.01)
    missing = [n for n in names if not wanted[n] <= seen.keys()]
    if missing:
        raise SystemExit(f"{len(missing)} job(s) never got all their children, e.g. {missing[0]}")
    return [max(seen[c] for c in wanted[n]) - started[n] for n in names]


async def _watch(http: Any, url: str, kind: str, path: str, seen: dict[tuple[str, str], float]) -> None:
    """Record when each child first appears (ADDED on a watch stream)."""
    import json

    async with http.get(url + path, params={"watch": "true"}, timeout=None) as resp:
        async for line in resp.content:
            if not line.strip():
                continue
            event = json.loads(line)
            name = (event.get("object") or {}).get("metadata", {}).get("name")
            if event.get("type") == "ADDED" and name:
                seen.setdefault((kind, name), time.perf_counter())


WATCHED = (
    ("Pod", "/api/v1/pods"),
    ("Service", "/api/v1/services"),
    ("ConfigMap", "/api/v1/configmaps"),
    ("NetworkPolicy", "/apis/networking.k8s.io/v1/networkpolicies"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, action="append", help="batch sizes (default: 1 and 100)")
    args = parser.parse_args()
    counts = args.jobs or [1, 100]
    import logging

    # KMock refuses kopf's generateName'd Events (409, logged with a traceback): keep them out.
    logging.basicConfig(level=logging.ERROR)

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    emulator = ctx.Process(target=_serve_emulator, args=(queue,), daemon=True)
    emulator.start()
    try:
        url = queue.get(timeout=60)
        wall = time.perf_counter()
        results = asyncio.run(_bench(url, counts))
        print(f"wall time: {time.perf_counter() - wall:.1f} s")
    finally:
        emulator.terminate()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rss_mib = usage.ru_maxrss / 1024
    print(f"operator CPU: {usage.ru_utime + usage.ru_stime:.1f} s (user+sys) over the whole run")
    for n, r in results.items():
        print(
            f"N={n:<4} create -> all children: p50 {r['p50']:.0f} ms, p95 {r['p95']:.0f} ms, "
            f"max {r['max']:.0f} ms; reconciled {int(r['reconciled'])}/{n}; reconcile errors {int(r['errors'])}"
        )
    print(f"operator peak RSS: {rss_mib:.0f} MiB")
    first = results[counts[0]]
    print(f"{first['p50']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
