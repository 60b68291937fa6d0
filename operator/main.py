"""`kubedistill operator` and `kubedistill render FILE`.

Cheap to import: kopf, aiohttp and prometheus-client are imported inside the commands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubedistill.cli import Subcommands

DEFAULT_METRICS_PORT = 9090
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
GC_THRESHOLDS = (50_000, 20, 10)
"""The cyclic garbage collector's thresholds for the operator process (Python's: 700, 10, 10)."""


def add_commands(sub: Subcommands) -> None:
    p = sub.add_parser("operator", help="run the DistillationJob operator (kopf)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable; default: the current namespace or 'default')",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    p.add_argument(
        "--liveness",
        default=DEFAULT_LIVENESS,
        metavar="URL",
        help=f"liveness endpoint served by kopf (default {DEFAULT_LIVENESS}; '' disables)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"port of the operator's /metrics (default {DEFAULT_METRICS_PORT}; 0 disables)",
    )
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=5.0,
        help="longest sleep between two reconcile passes of a job (default 5)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=_operator)

    p = sub.add_parser("render", help="print the children the operator creates for a job, as YAML")
    p.add_argument("file", metavar="FILE", help="a DistillationJob manifest")
    p.add_argument("--namespace", default="default", help="namespace when the manifest has none")
    p.set_defaults(func=_render)


def _render(args: argparse.Namespace) -> int:
    from kubedistill.api.validate import load_job
    from kubedistill.operator.render import render_job_yaml

    try:
        job = load_job(Path(args.file))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    sys.stdout.write(render_job_yaml(job.to_api(), args.namespace))
    return 0


def _current_namespace() -> str:
    sa = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return sa.read_text().strip() if sa.exists() else "default"


def _operator(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf
    from prometheus_client import start_http_server

    from kubedistill.operator.handlers import OperatorOptions, Reconciler, build_registry, configure
    from kubedistill.operator.metrics import OperatorMetrics

    if args.resync_seconds <= 0:
        print("--resync-seconds: must be > 0", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    metrics = OperatorMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.registry)
    reconciler = Reconciler(OperatorOptions(resync_seconds=args.resync_seconds, metrics=metrics))
    registry = build_registry(reconciler)
    settings = kopf.OperatorSettings()
    configure(settings)
    scope = {"clusterwide": True} if args.all_namespaces else {"namespaces": args.namespace or [_current_namespace()]}
    _tune_gc()
    # One replica (Deployment strategy Recreate): standalone, no peering CRDs needed.
    asyncio.run(
        kopf.operator(
            registry=registry,
            settings=settings,
            standalone=True,
            liveness_endpoint=args.liveness or None,
            **scope,
        )
    )
    return 0


def _tune_gc() -> None:
    """Collect garbage cycles less often. The operator holds many objects while jobs start (each
    child pending creation, kopf's state and task of each watched object: ~350k objects with 100
    jobs), and every watch event allocates hundreds more; at Python's default thresholds a full
    collection of all of them (~0.2 s) ran every few hundred events: a third of the operator's
    CPU while 100 jobs created their pods (bench/operator_scale.py). The objects of the imports
    never die: frozen, no collection walks them again."""
    from kubedistill.gc_settings import settle_gc

    settle_gc(GC_THRESHOLDS)
