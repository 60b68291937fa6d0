"""`kubedistill role trainer|rollout|teacher`: run one role of a job from its config file."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from kubedistill.api.roleconfig import Identity, JobConfig
    from kubedistill.cli import Subcommands

ROLES = ("trainer", "rollout", "teacher")


def _index(text: str) -> int:
    """argparse type of --replica: a replica index is a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative (replica indices start at 0)")
    return value


def add_commands(sub: Subcommands) -> None:
    p = sub.add_parser("role", help="run one role of a job (trainer, rollout or teacher server)")
    p.add_argument("role", choices=ROLES, help="which role this process plays")
    p.add_argument("--config", default=None, help="job config (default /etc/kubedistill/config.json)")
    p.add_argument("--replica", type=_index, default=None, help="replica index (default: KUBEDISTILL_REPLICA)")
    p.add_argument("--teacher", default=None, help="teacher name (teacher role; default: KUBEDISTILL_TEACHER)")
    p.add_argument("--host", default="0.0.0.0", help="HTTP listen address")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: Ports.HTTP)")
    p.add_argument(
        "--debug-endpoints",
        action="store_true",
        default=os.environ.get("KUBEDISTILL_DEBUG_ENDPOINTS") == "1",
        help="rollout: also serve GET /weights/checksums, to check a sync by hand "
        "(default: KUBEDISTILL_DEBUG_ENDPOINTS=1)",
    )
    p.set_defaults(func=run_role)


def run_role(args: argparse.Namespace) -> int:
    from kubedistill.runtime.entrypoints.zygote import end_with_launcher

    terminate_as_pid1()
    end_with_launcher()  # spawned by `kubedistill run`: end with it
    if args.role == "trainer":
        try:
            from kubedistill.runtime.entrypoints.trainer import run
        except ImportError as e:
            print(f"kubedistill role trainer: the trainer is not available in this build ({e})", file=sys.stderr)
            return 2
        finish_process(int(run(args) or 0))
    try:
        return _run_server(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kubedistill role {args.role}: {e}", file=sys.stderr)
        return 2


def terminate_as_pid1(pid: int | None = None) -> bool:
    """In a container the role's process is PID 1, and the kernel drops a signal whose action is
    the default at PID 1: the kubelet's SIGTERM (pod deleted, preempted, evicted) would do nothing
    for the grace period, then SIGKILL. Give SIGTERM its default meaning there: end the process,
    as a signal would (exit 128 + 15). Servers replace the handler with their graceful shutdown
    (uvicorn's). Returns whether it installed the handler."""
    if (os.getpid() if pid is None else pid) != 1 or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _terminated)
    return True


def _terminated(signum: int, frame: FrameType | None) -> None:
    logging.getLogger("kubedistill").warning("terminated by signal %d", signum)
    finish_process(128 + signum)


def finish_process(code: int) -> NoReturn:
    """End a trainer rank's process, its work written and its process groups destroyed: flush
    what is buffered, then exit without the interpreter's teardown. There, C++ threads of
    torch.distributed that outlive their owners have aborted a finished rank ("terminate called
    without an active exception", about once in 20 two-rank runs in CI), which its pod reports as
    failed: a gang restart and a second export for a job that had succeeded."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _load(args: argparse.Namespace) -> tuple[JobConfig, Identity, int]:
    from pathlib import Path

    from pydantic import ValidationError

    from kubedistill.api.roleconfig import CONFIG_PATH, Identity, JobConfig, Ports, Role

    path = Path(args.config or CONFIG_PATH)
    if not path.exists():
        raise FileNotFoundError(f"--config {path}: no such file")
    if not path.is_file():
        raise ValueError(f"--config {path}: not a file (the job's config.json, rendered by the operator)")
    try:
        config = JobConfig.load(path)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ValueError(f"--config {path}: {where + ': ' if where else ''}{first['msg']}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: cannot read it ({e})") from None
    try:
        identity = Identity.from_env(Role(args.role), replica=args.replica, teacher=args.teacher)
    except (ValidationError, ValueError):
        raise ValueError(
            "the replica index (--replica, else KUBEDISTILL_REPLICA or RANK) must be a whole number >= 0"
        ) from None
    return config, identity, args.port or Ports.HTTP


def _run_server(args: argparse.Namespace) -> int:
    config, identity, port = _load(args)
    spec = config.spec
    from kubedistill.runtime.engines.factory import make_engine, rollout_max_logprobs, teacher_max_logprobs
    from kubedistill.runtime.servers.http import serve

    threads = None
    if args.role == "rollout":
        from kubedistill.runtime.servers.rollout import build_rollout_app

        if identity.replica >= spec.rollout.replicas:
            raise ValueError(f"--replica {identity.replica}: the job has {spec.rollout.replicas} rollout replicas")
        threads = spec.rollout.overrides.cpu_threads
        engine = make_engine(spec, spec.student, spec.rollout.inference, max_logprobs=rollout_max_logprobs(spec))
        app = build_rollout_app(config, identity, engine, debug_endpoints=args.debug_endpoints)
    else:
        from kubedistill.runtime.servers.teacher import build_teacher_app, find_teacher

        teacher = find_teacher(config, identity.teacher)
        threads = teacher.overrides.cpu_threads
        engine = make_engine(spec, teacher, teacher.inference, max_logprobs=teacher_max_logprobs(spec))
        app = build_teacher_app(config, identity, teacher, engine)
    if threads:
        import torch

        torch.set_num_threads(threads)
    serve(app, args.host, port)
    return 0
