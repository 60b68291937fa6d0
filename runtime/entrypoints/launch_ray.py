"""The Ray backend of `kubedistill run`'s launcher (launch.py): each role process runs as a child
of a small Ray actor, so Ray places it (an existing cluster with `--address`, or a local Ray),
accounts for its CPUs and GPUs, and kills it with the actor. An actor that dies (its worker or
node went away) reads as ActorLost: a disruption, not the process's own failure."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Sequence
from io import FileIO
from pathlib import Path
from typing import Any

from kubedistill.runtime.entrypoints.launch import PlacementError, ProcessPlan, spawn, terminate
from kubedistill.runtime.entrypoints.supervisor import ActorLost, Exit

LOCAL_SCALE_CPUS = 64
"""Logical CPUs a local Ray gets beyond the job's, for rollout replicas added while it runs."""


def actor_lost(err: BaseException) -> ActorLost:
    """An ActorLost from the RayActorError a call on a dead actor raised."""
    # Ray's message: a fixed first line, tab-indented fields (ids, pid, ip), then why it died.
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith("\t")]
    detail = lines[-1] if lines else type(err).__name__
    return ActorLost("NodePreempted" if getattr(err, "preempted", False) else "RayActorDied", detail[:500])


def _process_actor_class() -> Any:
    """The Ray actor class (a ray.remote class: typed Any, like the rest of ray)."""
    import ray

    @ray.remote
    class RoleProcess:
        """Runs one `kubedistill role` process; it ends with this actor (launch.spawn)."""

        log: FileIO
        proc: subprocess.Popen[bytes]

        def start(self, argv: list[str], env: dict[str, str], log_path: str) -> int:
            self.log = open(log_path, "ab", buffering=0)
            self.proc = spawn(argv, env, self.log)
            return self.proc.pid

        def poll(self) -> int | None:
            return self.proc.poll()

        def stop(self) -> int | None:
            terminate([self.proc])
            return self.proc.returncode

    return RoleProcess


class RayLauncher:
    """Role processes placed by Ray: `address` an existing cluster, None a local Ray sized so
    every role is placed (the roles share the machine on purpose, as separate GPU pools share a
    node) with room for rollout replicas added while the job runs (Ray only accounts these CPUs)."""

    def __init__(self, log_dir: Path, address: str | None, cpus: float) -> None:
        import ray

        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(
                num_cpus=max(int(cpus + 0.999), os.cpu_count() or 1) + LOCAL_SCALE_CPUS,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        self.log_dir = log_dir
        self.actors: dict[str, Any] = {}
        self._actor_class = _process_actor_class()

    def gpus(self) -> int:
        import ray

        return int(ray.cluster_resources().get("GPU", 0))

    def start(self, plans: Sequence[ProcessPlan], timeout: float | None = None) -> None:
        """Each process on an actor of its own, started together (each actor takes Ray a worker
        process)."""
        import ray

        new = {p.name: self._actor_class.options(num_cpus=p.cpus, num_gpus=p.gpus).remote() for p in plans}
        refs = [a.start.remote(p.argv, p.env, str(self.log_dir / f"{p.name}.log")) for p, a in zip(plans, new.values())]
        try:
            ray.get(refs, timeout=timeout)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
            for a in new.values():  # not placed: it must not hold its CPUs/GPUs, nor the shutdown up
                ray.kill(a)
            names = ", ".join(new)
            raise PlacementError(f"Ray could not place {names} within {timeout or 0:.0f} s: {e!r}") from e
        self.actors.update(new)

    def poll(self) -> dict[str, Exit]:
        import ray

        refs = {name: a.poll.remote() for name, a in self.actors.items()}
        exits: dict[str, Exit] = {}
        for name, ref in refs.items():
            try:
                exits[name] = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                exits[name] = None  # unreachable for now, not dead (a network blip): the next poll tells
            except ray.exceptions.RayActorError as e:
                exits[name] = actor_lost(e)
        return exits

    def stop(self, names: Iterable[str]) -> None:
        """Stop the processes, then their actors: a restarted rank gets a new actor, which Ray
        places where there is room (its node may be gone)."""
        import ray

        actors = [self.actors.pop(n) for n in list(names) if n in self.actors]
        for a, ref in [(a, a.stop.remote()) for a in actors]:
            try:
                ray.get(ref, timeout=30)
            except Exception:
                pass  # the actor is gone already, and its process with it
            ray.kill(a)

    def close(self) -> None:
        import ray

        try:
            self.stop(list(self.actors))
        finally:
            ray.shutdown()
