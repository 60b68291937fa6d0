"""`kubedistill run` follows spec.rollout.replicas of the job file while the job runs, as the
operator follows `kubectl scale` of a DistillationJob: edit the file, save it, and rollout
servers are added or removed without restarting anything.

Scale up: the new servers' ports go into the config's endpoints.rollout (rewritten whole), then
their processes start; the trainer re-reads the config and takes each one in at a weight sync
once it is healthy. Scale down: the config drops the highest replicas first; their processes are
stopped only once the trainer's /status no longer lists them in rolloutServers (it has drained
them), or after weightSync.timeoutSeconds. Only replicas may change: other edits are reported and
wait for the next start of the job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubedistill.api.progress import TrainerProgress
from kubedistill.api.roleconfig import JobConfig
from kubedistill.api.spec import DistillationJobSpec

if TYPE_CHECKING:
    from kubedistill.runtime.entrypoints.launch import ProcessPlan


@dataclass
class Retiring:
    url: str
    deadline: float


@dataclass
class RolloutScaler:
    job_path: Path
    spec: DistillationJobSpec
    """The job file's spec as started (absolute paths): what an edit is compared with."""
    config: JobConfig
    config_path: Path
    template: ProcessPlan
    """Rollout replica 0's process: new replicas get its CPUs, GPUs and environment."""
    new_process: Callable[[JobConfig, int, set[int]], ProcessPlan]
    """(config, replica, ports taken) -> the process of a new rollout replica on a free port."""
    load: Callable[[Path], DistillationJobSpec]
    log: Callable[[str], object] = print
    clock: Callable[[], float] = time.time
    retiring: dict[str, Retiring] = field(default_factory=dict)
    """Processes of removed replicas, by name, until the trainer has drained them."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """What happened, for `kubedistill run --report`."""
    _seen: float | None = None
    _said: str | None = None

    def __post_init__(self) -> None:
        self._seen = self._mtime()

    def _mtime(self) -> float | None:
        try:
            return self.job_path.stat().st_mtime
        except OSError:
            return None

    def _say_once(self, message: str) -> None:
        if message != self._said:
            self._said = message
            self.log(message)

    def poll(self) -> list[ProcessPlan]:
        """Re-read the job file if it changed; the processes to start (scale up). A scale down
        rewrites the config and marks processes retiring (see `due`). Waits while earlier removed
        replicas are still draining."""
        if self.retiring:
            return []
        mtime = self._mtime()
        if mtime is None or mtime == self._seen:
            return []
        self._seen = mtime
        try:
            new = self.load(self.job_path)
        except ValueError as e:
            self._say_once(f"kubedistill run: {self.job_path} changed but does not validate; the job goes on\n{e}")
            return []
        want = new.rollout.replicas
        if with_rollout_replicas(new, self.spec.rollout.replicas) != self.spec:
            self._say_once(
                f"kubedistill run: {self.job_path} changed fields other than spec.rollout.replicas; "
                "a running job takes only that one (the others apply when the job is started again)"
            )
        have = self.config.spec.rollout.replicas
        if want == have:
            return []
        urls = list(self.config.endpoints.rollout)
        started: list[ProcessPlan] = []
        if want > have:
            taken = self._ports()
            for i in range(have, want):
                p = self.new_process(self.config, i, taken)
                p.env = {**self.template.env, **p.env}
                p.cpus, p.gpus = self.template.cpus, self.template.gpus
                started.append(p)
                urls.append(_url(self.config, p.port))
        else:
            deadline = self.clock() + float(self.config.spec.weight_sync.timeout_seconds)
            for i in range(want, have):
                self.retiring[f"rollout-{i}"] = Retiring(urls[i], deadline)
            urls = urls[:want]
        self._set(urls)  # before the new servers start: they check their replica against it
        self.log(f"kubedistill run: rollout replicas {have} -> {want}")
        self.events.append({"time": self.clock(), "replicas": [have, want]})
        return started

    def unplaced(self, plan: ProcessPlan) -> None:
        """Ray could not place a new replica's process (no free CPUs or GPUs): take it out of the
        config again, with the replicas after it (started in order, so none of them runs yet)."""
        url = _url(self.config, plan.port)
        urls = list(self.config.endpoints.rollout)
        keep = urls[: urls.index(url)] if url in urls else urls
        self.log(
            f"kubedistill run: Ray could not place {plan.name} (CPUs {plan.cpus}, GPUs {plan.gpus}); "
            f"rollout replicas stay {len(keep)}"
        )
        self._set(keep)

    def due(self, progress: TrainerProgress | None) -> list[str]:
        """Retiring processes to stop now: the trainer's fresh /status no longer holds them, or
        their deadline passed. `progress` None: the trainer did not answer this time."""
        now = self.clock()
        held = None if progress is None else progress.rollout_servers
        out = []
        for name, r in list(self.retiring.items()):
            drained = held is not None and r.url not in held
            if drained or now > r.deadline:
                out.append(name)
                del self.retiring[name]
                how = "drained by the trainer" if drained else "not drained before weightSync.timeoutSeconds"
                self.log(f"kubedistill run: stopping {name} ({how})")
                self.events.append({"time": now, "stopped": name, "drained": drained})
        return out

    def _set(self, urls: list[str]) -> None:
        """Rewrite the config (whole) with these rollout servers."""
        self.config = self.config.model_copy(
            update={
                "spec": with_rollout_replicas(self.config.spec, len(urls)),
                "endpoints": self.config.endpoints.model_copy(update={"rollout": urls}),
            }
        )
        self.spec = with_rollout_replicas(self.spec, len(urls))
        self.config.dump(self.config_path)

    def _ports(self) -> set[int]:
        e = self.config.endpoints
        urls = [e.trainer, *e.rollout, *(u for us in e.teachers.values() for u in us)]
        return {int(u.rsplit(":", 1)[1]) for u in urls} | {e.master_port, e.weight_sync_port}


def with_rollout_replicas(spec: DistillationJobSpec, replicas: int) -> DistillationJobSpec:
    return spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"replicas": replicas})})


def _url(config: JobConfig, port: int) -> str:
    host = config.endpoints.master_addr
    return f"http://{host}:{port}"
