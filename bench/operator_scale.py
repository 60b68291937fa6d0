"""The operator at scale, on a real API server (docs/design.md#at-scale): 100 DistillationJobs of 16-32
pods each applied at once, against the pod-create rate a plain client gets from the same API
server and etcd in the same run.

A control plane of etcd and kube-apiserver from KUBEBUILDER_ASSETS (default
/work/shared/k8s/bin; tests/control_plane.py), with an audit log of every request, so each
number is what the API server saw: who asked for what, and when the answer was ready. No kubelet,
no scheduler: the bench sets the pods' phases itself through pods/status, as tests/node_agent.py
does (Running and Ready, no pod IP, so the operator has no trainer /status to poll).

1. The limit, before and after the operator's run: a plain client (aiohttp, `--parallel`
   requests at once, the same rendered children as the operator makes, bodies encoded before the
   clock starts) creates the children of `--jobs` jobs in a namespace of its own.
2. `kubedistill operator` as a process (the admin's kubeconfig; `--resync-seconds 5`) watching
   its namespace; `--jobs` jobs POSTed at once. Per job, apply -> its last child created (the
   audit log's completion times): p50, p99; children created per second over the whole batch, as
   a share of the plain client's rate.
3. Every pod set Running and Ready at once: the operator's CPU per pod event and per reconcile
   pass until every job reports Running.
4. One job's spec.rollout.replicas raised by 4 among the 100: seconds to its new pods.
5. The operator's API requests per job, by verb and resource, and the ones repeated (the same
   verb on the same object more than once); its peak RSS; reconcile errors.
6. The bound: the operator's own requests (each job's POST, finalizer patch, children, one status
   patch) sent by a plain client as soon as each may go, what an operator of no CPU would get.
   A job's writes cost the API server several pods' worth each (the CRD's schema and rules).

The API server's and etcd's CPU per child is reported beside each rate. While the operator
creates, the bench polls the operator's metrics, not the API server (a list of every pod would
load it in that phase alone).

    .venv/bin/python bench/operator_scale.py             # 100 jobs
    .venv/bin/python bench/operator_scale.py --jobs 20

Last line: children created per second by the operator over the plain client's (target >= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tests"))  # control_plane.py; after everything else: bench/operator.py

OP_NS, PLAIN_NS, BOUND_NS = "scale", "plain", "bound"
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Request
  verbs: [patch]
  resources: [{group: kubedistill.io, resources: [distillationjobs/status]}]
- level: Metadata
"""
"""Every request's metadata; the job status patches with their bodies (to find identical ones)."""


def job_spec(i: int) -> dict[str, Any]:
    """Job i: 4 trainer pods, 4 teacher pods, 8..24 rollout pods (16..32 pods)."""
    return {
        "device": "cpu",
        "student": {"model": "/models/student"},
        "teachers": [{"name": "math", "model": "/models/teacher", "replicas": 4}],
        "rollout": {"replicas": 8 + (i * 7) % 17},
        "trainer": {"replicas": 4, "miniBatchSize": 16},
        "data": {"train": ["/data/train.jsonl"]},
        # No node carries this label: nothing binds the pods (there is no scheduler either).
        "nodeSelector": {"kubedistill.io/bench": "no-such-node"},
    }


def job_doc(name: str, i: int, namespace: str = OP_NS) -> dict[str, Any]:
    from kubedistill.api.job import API_VERSION, KIND

    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": job_spec(i),
    }


def children(name: str, namespace: str, i: int) -> list[dict[str, Any]]:
    from kubedistill.api.spec import DistillationJobSpec
    from kubedistill.operator.render import render_children

    return render_children(name, namespace, DistillationJobSpec.model_validate(job_spec(i)))


@contextlib.contextmanager
def control_plane(audit: Path) -> Iterator[Any]:
    """etcd and kube-apiserver only, the API server writing its audit log to `audit`."""
    import control_plane as cp

    assets = Path(os.environ.setdefault(cp.ASSETS_ENV, "/work/shared/k8s/bin"))
    cache = ROOT / ".kubedistill" / "bench" / "k8s-bin"
    bins = {n: b for n in cp.CORE if (b := cp.binary(assets, n, cache)) is not None}
    policy = audit.parent / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)

    class Audited(cp.ControlPlane):
        def _spawn(self, name: str, *args: str) -> None:
            if name == "kube-apiserver":
                args = (*args, f"--audit-policy-file={policy}", f"--audit-log-path={audit}",
                        "--audit-log-mode=batch", "--audit-log-batch-max-wait=1s", "--audit-log-maxsize=0")  # fmt: skip
            super()._spawn(name, *args)

    plane = Audited(home=Path(tempfile.mkdtemp(prefix="kd-opscale-k8s-")), bins=bins)
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()
        shutil.rmtree(plane.home, ignore_errors=True)


class Api:
    """Plain HTTP to the API server as the admin (its static token: user admin-token)."""

    def __init__(self, plane: Any, parallel: int):
        import aiohttp

        ctx = ssl.create_default_context(cafile=str(plane.ca_file))
        self.base = plane.server
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx, limit=parallel),
            headers={"Authorization": f"Bearer {plane.admin_token}"},
        )

    async def call(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> tuple[int, Any]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        async with self.session.request(method, self.base + path, data=data, headers={"Content-Type": ctype}) as r:
            raw = await r.read()
            return r.status, (json.loads(raw) if raw else None)

    async def ok(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        status, doc = await self.call(method, path, body, ctype)
        if status >= 300:
            raise RuntimeError(f"{method} {path}: {status} {doc}")
        return doc

    async def close(self) -> None:
        await self.session.close()


def plurals() -> dict[str, str]:
    """kind -> plural of every child kind the operator writes."""
    from kubedistill.operator.kube import RESOURCES, UNWATCHED

    return {**{k: r.plural for k, r in RESOURCES.items()}, **UNWATCHED}


def collection(obj: dict[str, Any]) -> str:
    gv, ns = obj["apiVersion"], obj["metadata"]["namespace"]
    prefix = "/api/v1" if gv == "v1" else f"/apis/{gv}"
    return f"{prefix}/namespaces/{ns}/{plurals()[obj['kind']]}"


async def setup(api: Api) -> None:
    import yaml

    for ns in (OP_NS, PLAIN_NS, BOUND_NS):
        await api.ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}}
        await api.ok("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", sa)  # no controller-manager makes it
    crd = yaml.safe_load((ROOT / "crds" / "kubedistill.io_distillationjobs.yaml").read_text())
    await api.ok("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    name = crd["metadata"]["name"]
    for _ in range(300):
        doc = await api.ok("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        conditions = (doc.get("status") or {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the CRD was not established in 30 s")


def plane_cpu(plane: Any) -> float:
    """CPU seconds of the API server and etcd so far."""
    return sum(proc_cpu(p.pid) for p in plane.processes.values())


async def plain_rate(api: Api, plane: Any, jobs: int, parallel: int, tag: str) -> dict[str, float]:
    """Children of `jobs` jobs created by a plain client, `parallel` at once: children/s, and the
    API server's and etcd's CPU per child."""
    bodies = [(collection(o), json.dumps(o).encode()) for i in range(jobs) for o in children(f"{tag}-{i}", PLAIN_NS, i)]
    queue = collections.deque(bodies)
    failed = 0

    async def worker() -> None:
        nonlocal failed
        while queue:
            path, body = queue.popleft()
            status, _ = await api.call("POST", path, body)
            failed += status >= 300

    t0, cpu0 = time.monotonic(), plane_cpu(plane)
    await asyncio.gather(*(worker() for _ in range(parallel)))
    seconds, plane_s = time.monotonic() - t0, plane_cpu(plane) - cpu0
    pods = sum(1 for p, _ in bodies if p.endswith("/pods"))
    return {"children": len(bodies), "pods": pods, "seconds": seconds, "per_s": len(bodies) / seconds,
            "pods_per_s": pods / seconds, "failed": failed, "parallel": parallel,
            "plane_ms": 1000 * plane_s / len(bodies)}  # fmt: skip


async def bound_rate(api: Api, jobs: int, parallel: int) -> dict[str, float]:
    """The operator's own requests for `jobs` jobs, sent by a plain client (`parallel` at once) as
    soon as each may go: the job's POST, its finalizer patch, its children (with the job as their
    owner), one status patch. An operator that cost no CPU would get this; the jobs' writes cost the
    API server several pods' worth each (the CRD's schema and rules). Children/s from the first job
    applied to the last child made, as the operator's."""
    from kubedistill.api.job import GROUP, PLURAL, VERSION

    path = f"/apis/{GROUP}/{VERSION}/namespaces/{BOUND_NS}/{PLURAL}"
    slots = asyncio.Semaphore(parallel)

    async def send(method: str, url: str, body: Any, ctype: str = "application/json") -> Any:
        async with slots:
            return await api.ok(method, url, body, ctype)

    async def job(i: int) -> tuple[float, float, int]:
        doc = await send("POST", path, job_doc(f"job-{i:03d}", i, BOUND_NS))
        applied, meta = time.monotonic(), doc["metadata"]
        merge = "application/merge-patch+json"
        await send("PATCH", f"{path}/{meta['name']}", {"metadata": {"finalizers": ["kubedistill.io/finalizer"]}}, merge)
        owner = {"apiVersion": doc["apiVersion"], "kind": doc["kind"], "name": meta["name"], "uid": meta["uid"],
                 "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        made = children(meta["name"], BOUND_NS, i)
        for obj in made:
            obj["metadata"]["ownerReferences"] = [owner]
        await asyncio.gather(*(send("POST", collection(o), json.dumps(o).encode()) for o in made))
        done = time.monotonic()
        await send("PATCH", f"{path}/{meta['name']}/status", {"status": {"phase": "Pending"}}, merge)
        return applied, done, len(made)

    times = await asyncio.gather(*(job(i) for i in range(jobs)))
    seconds = max(t for _, t, _ in times) - min(t for t, _, _ in times)
    made = sum(n for _, _, n in times)
    return {"children": made, "seconds": seconds, "per_s": made / seconds, "parallel": parallel}


def audit_events(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def stamp(ev: dict[str, Any]) -> float:
    return datetime.fromisoformat(ev["stageTimestamp"].replace("Z", "+00:00")).timestamp()


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def metric(api_port: int, name: str) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{api_port}/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_until(what: str, check: Any, timeout: float, every: float = 0.25) -> float:
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(every)
    return time.monotonic() - t0


async def count(api: Api, path: str) -> int:
    doc = await api.ok("GET", path + ("&" if "?" in path else "?") + "limit=0")
    return len(doc["items"]) if doc else 0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def bench(plane: Any, audit: Path, args: argparse.Namespace) -> dict[str, Any]:
    from kubedistill.api.job import GROUP, PLURAL, VERSION
    from kubedistill.operator.render import LABEL_JOB

    api = Api(plane, max(args.parallel))
    res: dict[str, Any] = {}
    try:
        await setup(api)
        res["plain_before"] = [await plain_rate(api, plane, args.jobs, p, f"pre{p}") for p in args.parallel]
        jobs = [f"job-{i:03d}" for i in range(args.jobs)]
        wanted = {n: {(o["kind"], o["metadata"]["name"]) for o in children(n, OP_NS, i)} for i, n in enumerate(jobs)}
        total_children = sum(len(w) for w in wanted.values())
        total_pods = sum(1 for w in wanted.values() for k, _ in w if k == "Pod")

        metrics_port = args.metrics_port
        log = open(plane.home / "operator.log", "wb")  # noqa: SIM115
        env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig), "PYTHONUNBUFFERED": "1"}
        op = subprocess.Popen(
            [sys.executable, "-m", "kubedistill.cli", "operator", "-n", OP_NS, "--liveness", "",
             "--metrics-port", str(metrics_port), "--resync-seconds", "5"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
        try:
            await wait_until("the operator's /metrics", lambda: _serving(metrics_port), 120)
            await asyncio.sleep(args.settle)  # kopf's watches established
            cpu0, plane0 = proc_cpu(op.pid), plane_cpu(plane)
            jobs_path = f"/apis/{GROUP}/{VERSION}/namespaces/{OP_NS}/{PLURAL}"
            t_apply = time.time()
            await asyncio.gather(*(api.ok("POST", jobs_path, job_doc(n, i)) for i, n in enumerate(jobs)))
            pods_path = f"/api/v1/namespaces/{OP_NS}/pods?labelSelector={LABEL_JOB}"

            polls = 0

            async def all_pods() -> bool:
                # The operator's own count, then one list to confirm. Listing every pod at each poll
                # (~0.1 s of the API server's CPU per thousand pods) loaded it in this phase and not
                # in the plain client's: 2-3 s of its CPU per 100 jobs. A child the operator found
                # existing (409) is not counted there: the list decides every 100th poll too.
                nonlocal polls
                polls += 1
                made = await metric(metrics_port, "kubedistill_operator_children_created_total")
                return (made >= total_children or polls % 100 == 0) and await count(api, pods_path) >= total_pods

            await wait_until("every job's pods", all_pods, args.timeout, every=0.1)
            cpu_created, plane_created = proc_cpu(op.pid), plane_cpu(plane)
            await asyncio.sleep(2.0)  # the audit log's batch flushed
            res["create"] = create_times(audit_events(audit), jobs, wanted, t_apply)
            res["create"]["children"], res["create"]["pods"] = total_children, total_pods
            res["create"]["operator_cpu_s"] = cpu_created - cpu0
            res["create"]["plane_cpu_s"] = plane_created - plane0

            # 3. Every pod Running and Ready at once.
            passes0, cpu1 = await metric(metrics_port, "kubedistill_operator_reconcile_seconds_count"), proc_cpu(op.pid)
            pods = (await api.ok("GET", pods_path))["items"]
            t0 = time.monotonic()
            await asyncio.gather(*(_run_pod(api, p) for p in pods))
            patched = time.monotonic() - t0

            async def all_running() -> bool:
                doc = await api.ok("GET", jobs_path)
                return all((j.get("status") or {}).get("phase") == "Running" for j in doc["items"])

            running = await wait_until("every job Running", all_running, args.timeout)
            await asyncio.sleep(1.0)
            passes1, cpu2 = await metric(metrics_port, "kubedistill_operator_reconcile_seconds_count"), proc_cpu(op.pid)
            res["events"] = {"pods": len(pods), "patch_s": patched, "to_running_s": running + patched,
                             "cpu_s": cpu2 - cpu1, "passes": passes1 - passes0}  # fmt: skip

            # 4. One job's rollout scaled up by 4 among them all.
            target = jobs[len(jobs) // 2]
            i = len(jobs) // 2
            before = job_spec(i)["rollout"]["replicas"]
            sel = f"/api/v1/namespaces/{OP_NS}/pods?labelSelector={LABEL_JOB}={target},kubedistill.io/role=rollout"
            t0 = time.monotonic()
            await api.ok("PATCH", f"{jobs_path}/{target}", {"spec": {"rollout": {"replicas": before + 4}}},
                         "application/merge-patch+json")  # fmt: skip

            async def scaled() -> bool:
                return await count(api, sel) >= before + 4

            res["scale"] = {"job": target, "from": before, "to": before + 4,
                            "seconds": await wait_until("the scaled job's new pods", scaled, 120, 0.05)}  # fmt: skip
            del t0
            await asyncio.sleep(2.0)
            res["operator"] = {
                "rss_mb": proc_hwm_mb(op.pid),
                "cpu_s": proc_cpu(op.pid) - cpu0,
                "errors": await metric(metrics_port, "kubedistill_operator_reconcile_errors_total"),
                "created": await metric(metrics_port, "kubedistill_operator_children_created_total"),
            }
        finally:
            op.terminate()
            try:
                op.wait(timeout=20)
            except subprocess.TimeoutExpired:
                op.kill()
            log.close()
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(plane.home / "operator.log", args.keep)
                shutil.copy(audit, args.keep)
        res["requests"] = requests_by_operator(audit_events(audit), len(jobs))
        res["plain_after"] = [await plain_rate(api, plane, args.jobs, p, f"post{p}") for p in args.parallel]
        res["bound"] = await bound_rate(api, args.jobs, max(args.parallel))
    finally:
        await api.close()
    return res


async def _serving(port: int) -> bool:
    import aiohttp

    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def _run_pod(api: Api, pod: dict[str, Any]) -> None:
    """As a kubelet reports a started container: Running, Ready, its container running."""
    now = datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ")
    c = pod["spec"]["containers"][0]
    cond = lambda t: {"type": t, "status": "True", "lastTransitionTime": now}  # noqa: E731
    status = {
        "phase": "Running",
        "startTime": now,
        "conditions": [cond("PodScheduled"), cond("Initialized"), cond("ContainersReady"), cond("Ready")],
        "containerStatuses": [{"name": c["name"], "image": c["image"], "imageID": "", "ready": True,
                               "restartCount": 0, "started": True, "state": {"running": {"startedAt": now}}}],
    }  # fmt: skip
    meta = pod["metadata"]
    await api.ok("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                 {"status": status}, "application/merge-patch+json")  # fmt: skip


def create_times(events: list[dict[str, Any]], jobs: list[str], wanted: dict[str, set[tuple[str, str]]],
                 t_apply: float) -> dict[str, Any]:  # fmt: skip
    """Per job, its POST's completion -> its last child's, from the audit log."""
    kinds = {plural: kind for kind, plural in plurals().items() if kind != "DistillationJob"}
    made: dict[tuple[str, str], float] = {}
    applied: dict[str, float] = {}
    for ev in events:
        ref = ev.get("objectRef") or {}
        if ev.get("verb") != "create" or ref.get("namespace") != OP_NS or ev.get("stage") != "ResponseComplete":
            continue
        code = (ev.get("responseStatus") or {}).get("code", 0)
        if code >= 300:
            continue
        name = ref.get("name") or ""
        if ref.get("resource") == "distillationjobs":
            applied[name] = stamp(ev)
        elif ref.get("resource") in kinds:
            made.setdefault((kinds[ref["resource"]], name), stamp(ev))
    latency = []
    for j in jobs:
        times = [made[c] for c in wanted[j] if c in made]
        if j in applied and len(times) == len(wanted[j]):
            latency.append(max(times) - applied[j])
    first = min(applied.values()) if applied else t_apply
    last = max(made.values()) if made else first
    return {
        "jobs_done": len(latency),
        "p50_s": statistics.median(latency) if latency else float("nan"),
        "p99_s": pct(latency, 0.99) if latency else float("nan"),
        "max_s": max(latency) if latency else float("nan"),
        "batch_s": last - first,
        "per_s": len(made) / (last - first) if last > first else float("nan"),
    }


def requests_by_operator(events: list[dict[str, Any]], jobs: int) -> dict[str, Any]:
    """The operator's requests (its kubeconfig's user, `admin`) by verb and resource, and those
    repeated: the same verb on the same object more than once (watches and lists excluded)."""
    mine = [
        e for e in events if (e.get("user") or {}).get("username") == "admin" and e.get("stage") == "ResponseComplete"
    ]

    def what(e: dict[str, Any]) -> str:
        ref = e.get("objectRef") or {}
        return f"{e['verb']} {ref.get('resource', '')}" + (f"/{ref['subresource']}" if ref.get("subresource") else "")

    by = collections.Counter(what(e) for e in mine)
    same = collections.Counter(
        (e["verb"], (e.get("objectRef") or {}).get("resource"), (e.get("objectRef") or {}).get("subresource"),
         (e.get("objectRef") or {}).get("name"))
        for e in mine if e["verb"] not in ("watch", "list") and (e.get("objectRef") or {}).get("name")
    )  # fmt: skip
    repeated = collections.Counter()
    for (verb, resource, sub, _), n in same.items():
        if n > 1:
            repeated[f"{verb} {resource}{'/' + sub if sub else ''}"] += n - 1
    codes = collections.Counter((e.get("responseStatus") or {}).get("code", 0) for e in mine)
    # A status patch that sends what the previous one of the same job sent changed nothing.
    last: dict[str, Any] = {}
    identical = 0
    for e in sorted((e for e in mine if what(e) == "patch distillationjobs/status"), key=stamp):
        name, body = e["objectRef"].get("name"), e.get("requestObject")
        identical += body is not None and last.get(name) == body
        last[name] = body
    refused = collections.Counter(
        f"{(e.get('responseStatus') or {}).get('code')} {what(e)}"
        for e in mine
        if (e.get("responseStatus") or {}).get("code", 0) >= 400
    )
    return {"total": len(mine), "per_job": len(mine) / jobs, "by": dict(by.most_common()),
            "repeated": dict(repeated.most_common()), "codes": {str(k): v for k, v in codes.items()},
            "identical_status_patches": identical, "refused": dict(refused)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--parallel", default="16,64", help="the plain client's requests at once (the best is the limit)")
    ap.add_argument("--metrics-port", type=int, default=19190)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds for the operator's watches to start")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep", metavar="DIR", help="copy the audit log and the operator's log here")
    args = ap.parse_args()
    args.parallel = [int(x) for x in args.parallel.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kd-opscale-"))
    audit = work / "audit.log"
    print(f"# {args.jobs} jobs; load {os.getloadavg()[0]:.1f} at start", flush=True)
    try:
        with control_plane(audit) as plane:
            res = asyncio.run(bench(plane, audit, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load1"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    limit = max(r["per_s"] for r in res["plain_before"] + res["plain_after"])
    for when in ("plain_before", "plain_after"):
        for r in res[when]:
            print(f"plain client ({when.split('_')[1]} the operator, {r['parallel']} at once): {r['children']} "
                  f"children ({r['pods']} pods) in {r['seconds']:.1f} s: {r['per_s']:.0f} children/s, "
                  f"{r['pods_per_s']:.0f} pods/s, {r['failed']} failed; API server and etcd CPU "
                  f"{r['plane_ms']:.1f} ms per child")  # fmt: skip
    c = res["create"]
    print(f"operator: {c['children']} children ({c['pods']} pods) of {args.jobs} jobs in {c['batch_s']:.1f} s: "
          f"{c['per_s']:.0f} children/s; apply -> last child p50 {c['p50_s']:.1f} s, p99 {c['p99_s']:.1f} s, "
          f"max {c['max_s']:.1f} s ({c['jobs_done']}/{args.jobs} jobs complete)")  # fmt: skip
    print(f"operator CPU while creating: {c['operator_cpu_s']:.1f} s, "
          f"{1000 * c['operator_cpu_s'] / c['children']:.1f} ms per child (API server and etcd: "
          f"{1000 * c['plane_cpu_s'] / c['children']:.1f} ms per child)")  # fmt: skip
    e = res["events"]
    print(f"{e['pods']} pods set Running at once (patched in {e['patch_s']:.1f} s): every job Running "
          f"{e['to_running_s']:.1f} s after the first patch; operator CPU {e['cpu_s']:.1f} s = "
          f"{1000 * e['cpu_s'] / e['pods']:.1f} ms per pod event, {e['passes']:.0f} reconcile passes "
          f"({1000 * e['cpu_s'] / max(e['passes'], 1):.1f} ms each)")  # fmt: skip
    s = res["scale"]
    print(
        f"rollout of {s['job']} scaled {s['from']} -> {s['to']} among {args.jobs} jobs: "
        f"new pods in {s['seconds']:.2f} s"
    )
    o = res["operator"]
    print(f"operator: peak RSS {o['rss_mb']:.0f} MB, CPU {o['cpu_s']:.1f} s over the run, "
          f"reconcile errors {o['errors']:.0f}, children created {o['created']:.0f}")  # fmt: skip
    r = res["requests"]
    print(f"operator API requests: {r['total']} ({r['per_job']:.1f} per job); by kind: {r['by']}")
    print(f"  repeated (same verb, same object): {r['repeated'] or 'none'}; of the status patches, "
          f"{r['identical_status_patches']} identical to the job's previous one; status codes {r['codes']}"
          + (f"; refused: {r['refused']}" if r["refused"] else ""))  # fmt: skip
    print(f"machine load {res['load1']:.1f} at the end")
    b = res["bound"]
    print(f"the operator's requests from a plain client ({b['parallel']} at once; an operator of no CPU): "
          f"{b['per_s']:.0f} children/s over the batch ({b['seconds']:.1f} s), {b['per_s'] / limit:.2f} of the "
          f"plain client's; the operator's over it: {c['per_s'] / b['per_s']:.2f}")  # fmt: skip
    print(f"operator children/s over the plain client's ({limit:.0f}/s): {c['per_s'] / limit:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
