"""`kubedistill run`'s command line. Light on purpose: every `kubedistill` command builds its
parser from here, and `kubedistill run` starts the roles' zygote (zygote.py) before importing
the machinery that runs the job (local.py: about a second of imports), so the two overlap."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kubedistill.runtime.entrypoints.gpu_ids import visible_gpus
from kubedistill.runtime.entrypoints.zygote import Zygote, forks_roles

if TYPE_CHECKING:
    from kubedistill.cli import Subcommands

LAUNCHERS = ("processes", "ray")


def launcher_kind(launcher: str | None, address: str | None) -> str:
    """The launcher a run uses: the one asked for; else Ray with an address, else processes."""
    return launcher or ("ray" if address else "processes")


def _run_command(args: argparse.Namespace) -> int:
    kind = launcher_kind(args.launcher, args.address)
    zygote = Zygote() if forks_roles(kind, visible_gpus(os.environ)) else None
    from kubedistill.runtime.entrypoints.local import run

    return run(
        Path(args.job),
        address=args.address,
        launcher=args.launcher,
        workdir=Path(args.workdir) if args.workdir else None,
        report=Path(args.report) if args.report else None,
        progress=args.progress,
        zygote=zygote,
    )


def add_commands(sub: Subcommands) -> None:
    p = sub.add_parser("run", help="run every role of a job as local processes")
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default=None,
        help="start the roles as plain child processes, or through Ray (default: ray with --address, else processes)",
    )
    p.add_argument(
        "--address", default=os.environ.get("RAY_ADDRESS"), help="existing Ray cluster (implies --launcher ray)"
    )
    p.add_argument("--workdir", help="run directory (config, logs); default .kubedistill/runs/<job>")
    p.add_argument("--report", metavar="FILE", help="write a JSON summary here")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress line (default: when stdout is a terminal)",
    )
    p.set_defaults(func=_run_command)
