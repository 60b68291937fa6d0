"""How `kubedistill run` starts, polls and stops role processes: the launcher behind its
supervisor (supervisor.py decides, a launcher carries it out).

Two backends with one interface. `ProcessLauncher` (here, the default on one machine) runs each
role as a plain child process: nothing to start first, so the roles begin importing at once.
`RayLauncher` (launch_ray.py) places them through Ray, on an existing cluster (`--address`) or a
local Ray when asked (`--launcher ray`). Given a zygote (zygote.py), `ProcessLauncher` forks the
roles from it, their common imports done once, and spawns what it cannot fork.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from io import FileIO
from pathlib import Path
from typing import Protocol

from kubedistill.api.roleconfig import Identity
from kubedistill.runtime.entrypoints.supervisor import Exit
from kubedistill.runtime.entrypoints.zygote import LAUNCHER_VARIABLE, Zygote

STOP_GRACE_SECONDS = 10.0
"""How long a stopped process has between SIGTERM and SIGKILL."""


@dataclass
class ProcessPlan:
    """One role process to start."""

    name: str
    identity: Identity
    port: int
    env: dict[str, str]
    cpus: float
    gpus: float
    """GPUs it takes: a fraction when roles share a GPU (see gpu_share.py)."""
    argv: list[str] = field(default_factory=list)


class PlacementError(RuntimeError):
    """A process could not be placed: no GPUs free for it (or, under Ray, no node with room)."""


class Launcher(Protocol):
    def gpus(self) -> int:
        """GPUs the processes may use."""
        ...

    def start(self, plans: Sequence[ProcessPlan], timeout: float | None = None) -> None:
        """Start these processes, their output appended to `<log_dir>/<name>.log`. Raises
        PlacementError when one cannot be placed within `timeout` (None: wait)."""
        ...

    def poll(self) -> dict[str, Exit]:
        """Every started (and not stopped) process: None while it runs, else how it ended."""
        ...

    def stop(self, names: Iterable[str]) -> None:
        """Stop these processes (SIGTERM to their process group, then SIGKILL) and forget them."""
        ...

    def close(self) -> None:
        """Stop every process."""
        ...


def place_gpus(want: float, used: Mapping[str, float], ids: Sequence[str]) -> list[str] | None:
    """The GPU ids for a process taking `want` GPUs, given what each GPU has handed out (`used`),
    as Ray places them: whole GPUs for `want` >= 1, else the first GPU with that fraction left, so
    roles sharing a GPU pack onto the same one. None: they do not fit now."""
    if want <= 0:
        return []
    if want >= 1:
        free = [i for i in ids if used.get(i, 0.0) <= 1e-9]
        return free[: int(want)] if len(free) >= want else None
    return next(([i] for i in ids if used.get(i, 0.0) + want <= 1.0 + 1e-9), None)


class Child(Protocol):
    """A started role process: a subprocess.Popen, or one forked by the zygote."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def spawn(argv: list[str], env: Mapping[str, str], log: FileIO) -> subprocess.Popen[bytes]:
    """A process in its own process group (stopped as a whole) that ends when the process that
    started it dies: the kernel sends it SIGTERM (PR_SET_PDEATHSIG, through pyprctl), whatever it
    runs (an environment server is the user's own command); a `kubedistill role` also watches its
    launcher (LAUNCHER_VARIABLE: zygote.end_with_launcher), which covers a launcher gone before
    the signal was armed."""
    return subprocess.Popen(
        argv,
        env={**os.environ, **env, LAUNCHER_VARIABLE: str(os.getpid())},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_end_with_parent,
    )


def _end_with_parent() -> None:
    import pyprctl

    pyprctl.set_pdeathsig(signal.SIGTERM)


def terminate(procs: Iterable[Child], grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM each process group, wait up to `grace` for all of them together, then SIGKILL."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: Child, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        try:  # a role just forked may not lead its own process group yet
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class _Running:
    proc: Child
    log: FileIO | None
    """The log file held open for a spawned process (a forked one opens its own)."""
    gpus: dict[str, float]


class ProcessLauncher:
    """Role processes as children of `kubedistill run` on this machine (forked by `zygote` where
    it can), each given its GPUs by CUDA_VISIBLE_DEVICES as Ray would."""

    def __init__(self, log_dir: Path, gpu_ids: Sequence[str], zygote: Zygote | None = None) -> None:
        self.log_dir = log_dir
        self.gpu_ids = list(gpu_ids)
        self.zygote = zygote
        self.running: dict[str, _Running] = {}

    def gpus(self) -> int:
        return len(self.gpu_ids)

    def _used(self) -> dict[str, float]:
        used: dict[str, float] = {}
        for r in self.running.values():
            for i, share in r.gpus.items():
                used[i] = used.get(i, 0.0) + share
        return used

    def start(self, plans: Sequence[ProcessPlan], timeout: float | None = None) -> None:
        for p in plans:
            ids = place_gpus(p.gpus, self._used(), self.gpu_ids)
            if ids is None:
                raise PlacementError(f"no GPU free for {p.name} (it takes {p.gpus}; {len(self.gpu_ids)} here)")
            env = dict(p.env)
            if "OMP_NUM_THREADS" not in os.environ:  # as Ray sets it for an actor: its CPUs, not the machine's
                env.setdefault("OMP_NUM_THREADS", str(max(1, int(p.cpus))))
            if ids:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
            share = {i: p.gpus if p.gpus < 1 else 1.0 for i in ids}
            path = self.log_dir / f"{p.name}.log"
            zygote, full_env = self.zygote, {**os.environ, **env}
            forked = zygote.fork(p.name, p.argv, full_env, os.getcwd(), str(path)) if zygote else None
            if forked is not None:
                self.running[p.name] = _Running(forked, None, share)
                continue
            log = open(path, "ab", buffering=0)
            self.running[p.name] = _Running(spawn(p.argv, env, log), log, share)

    def poll(self) -> dict[str, Exit]:
        return {name: r.proc.poll() for name, r in self.running.items()}

    def stop(self, names: Iterable[str]) -> None:
        stopped = [self.running.pop(n) for n in names if n in self.running]
        terminate(r.proc for r in stopped)
        for r in stopped:
            if r.log is not None:
                r.log.close()

    def close(self) -> None:
        self.stop(list(self.running))
        if self.zygote is not None:
            self.zygote.close()
