"""`kubedistill run JOB.yaml`: every role of a job as local processes, under a supervisor.

The processes are the very `kubedistill role ...` entrypoints and config file the pods use; only
the addresses differ (loopback and free ports instead of pod DNS names). An environment server
(spec.environments[]) is its own `command`, on a free port that PORT and $(PORT) name. A launcher (launch.py)
starts them: plain child processes on this machine by default, or Ray actors (`--address`, an
existing cluster; `--launcher ray`, a local Ray). The supervisor loop here observes their exits
and trainer rank 0's `/status` once a second and does what supervisor.decide says: show
progress, restart the trainer gang under the operator's own failure policy (a process's own exit
counts against spec.backoffLimit; losing the Ray actor that hosts it is a disruption and does
not), fail the job past activeDeadlineSeconds, or stop every process when the trainer ends, a
server fails, or on Ctrl-C. Across a gang restart the servers keep running; the new gang resumes
from the last checkpoint and re-forms the weight-sync group with them.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from kubedistill.api.failures import GangDecision, GangOutcome
from kubedistill.api.job import DistillationJob
from kubedistill.api.progress import HISTORY_ENV, TrainerProgress
from kubedistill.api.roleconfig import Endpoints, Identity, JobConfig, Role, role_env, trainer_world_size, user_env
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.driver.history import read_history
from kubedistill.runtime.entrypoints.gpu_ids import visible_gpus
from kubedistill.runtime.entrypoints.gpu_share import GpuDemand, Started, share_gpus, start_waves
from kubedistill.runtime.entrypoints.launch import Launcher, PlacementError, ProcessLauncher, ProcessPlan
from kubedistill.runtime.entrypoints.local_scaling import RolloutScaler
from kubedistill.runtime.entrypoints.run_cli import launcher_kind
from kubedistill.runtime.entrypoints.supervisor import (
    Exit,
    Finish,
    Observed,
    Supervised,
    SupervisorStatus,
    decide,
    gang_record,
)
from kubedistill.runtime.entrypoints.zygote import Zygote, forks_roles
from kubedistill.runtime.wire.http import REQUEST_ERRORS, BlockingClient, fetch, until_healthy

HOST = "127.0.0.1"


PLACE_SECONDS = 120.0
"""How long a process started while the job runs (a rollout replica added, a restarted trainer
rank) may wait to be placed."""

RAY_WORKER_PORTS = range(10002, 20000)
"""Ray's default worker port range (`ray start --min/max-worker-port`): its workers bind there."""


@functools.lru_cache(maxsize=1)
def ephemeral_ports() -> range:
    """The kernel's ephemeral range (outgoing connections and bind-to-0 draw from it)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(lo, hi + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def free_port(taken: set[int], rng: random.Random | None = None) -> int:
    """A port that binds now and that nothing else on the machine is likely to take before the
    role process binds it: between Ray's worker ports and the ephemeral range. (A port from
    bind-to-0 lies in the ephemeral range, where every outgoing connection of the driver and
    every Ray process may grab it first: a server then fails with 'address already in use'.)"""
    rng = rng or random.SystemRandom()
    lo, hi = RAY_WORKER_PORTS.stop, ephemeral_ports().start
    for _ in range(200 if hi > lo else 0):
        port = rng.randrange(lo, hi)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        taken.add(port)
        return port
    with socket.socket() as s:  # no room between the ranges on this machine
        s.bind((HOST, 0))
        bound: int = s.getsockname()[1]
        taken.add(bound)
        return bound


def absolute_paths(spec: DistillationJobSpec, base: Path) -> DistillationJobSpec:
    """The spec with its model, data and checkpoint paths made absolute against `base`, so the
    processes find them whatever directory Ray starts them in."""

    def fix(p: str | None) -> str | None:
        return None if p is None else str((base / p).resolve()) if not os.path.isabs(p) else p

    data = spec.model_dump(by_alias=True)
    for model in [data["student"], *data["teachers"]]:
        model["model"] = fix(model["model"])
        model["tokenizer"] = fix(model.get("tokenizer"))
    data["data"]["train"] = [fix(p) for p in data["data"]["train"]]
    data["data"]["val"] = [fix(p) for p in data["data"]["val"]]
    data["checkpoint"]["path"] = fix(data["checkpoint"]["path"])
    return DistillationJobSpec.model_validate(data)


def local_processes(job: DistillationJob, config_path: Path) -> tuple[JobConfig, list[ProcessPlan]]:
    """The job config (loopback endpoints) and the processes to start. Pure apart from picking
    free ports."""
    spec = job.spec
    name, ns = job.metadata.name, job.metadata.namespace or "default"
    taken: set[int] = set()
    ports = {
        "trainer": [free_port(taken) for _ in range(trainer_world_size(spec))],
        "rollout": [free_port(taken) for _ in range(spec.rollout.replicas)],
        **{f"teacher/{t.name}": [free_port(taken) for _ in range(t.replicas)] for t in spec.teachers},
        **{f"environment/{e.name}": [free_port(taken) for _ in range(e.replicas)] for e in spec.environments},
    }
    master_port = free_port(taken)
    endpoints = Endpoints(
        trainer=f"http://{HOST}:{ports['trainer'][0]}",
        master_addr=HOST,
        master_port=master_port,
        weight_sync_port=free_port(taken),
        rollout=[f"http://{HOST}:{p}" for p in ports["rollout"]],
        teachers={t.name: [f"http://{HOST}:{p}" for p in ports[f"teacher/{t.name}"]] for t in spec.teachers},
        environments={
            e.name: [f"http://{HOST}:{p}" for p in ports[f"environment/{e.name}"]] for e in spec.environments
        },
    )
    config = JobConfig(job=name, namespace=ns, spec=spec, endpoints=endpoints)

    processes: list[ProcessPlan] = []
    for i, e in enumerate(spec.environments):
        for replica, port in enumerate(ports[f"environment/{e.name}"]):
            processes.append(environment_process(config, i, replica, port))
    for t in spec.teachers:
        for i, port in enumerate(ports[f"teacher/{t.name}"]):
            processes.append(
                role_process(
                    config,
                    config_path,
                    Identity(role=Role.teacher, replica=i, teacher=t.name),
                    port,
                    t.overrides.cpu_threads,
                    spec.gpus_of(t.gpus),
                )
            )
    for i, port in enumerate(ports["rollout"]):
        processes.append(rollout_process(config, config_path, i, port))
    gpus_per_rank = 1 if spec.gpus_of(spec.trainer.gpus_per_replica) else 0
    for rank, port in enumerate(ports["trainer"]):
        processes.append(
            role_process(
                config,
                config_path,
                Identity(role=Role.trainer, replica=rank),
                port,
                spec.trainer.overrides.cpu_threads,
                gpus_per_rank,
            )
        )
    return config, processes


def role_process(
    config: JobConfig, config_path: Path, identity: Identity, port: int, threads: int | None, gpus: int
) -> ProcessPlan:
    """The `kubedistill role ...` process of one replica, on `port`."""
    spec, name, ns = config.spec, config.job, config.namespace
    label = identity.role.value if identity.teacher is None else f"teacher-{identity.teacher}"
    argv = [
        sys.executable,
        "-m",
        "kubedistill.cli",
        "role",
        identity.role.value,
        "--config",
        str(config_path),
        "--replica",
        str(identity.replica),
        "--host",
        HOST,
        "--port",
        str(port),
    ]
    if identity.teacher is not None:
        argv += ["--teacher", identity.teacher]
    env = role_env(spec, name, ns, identity, HOST, config.endpoints.master_port)
    env.update(_user_variables(spec, identity.role, identity.teacher))
    return ProcessPlan(f"{label}-{identity.replica}", identity, port, env, float(threads or 1), gpus, argv)


def _user_variables(spec: DistillationJobSpec, role: Role, name: str | None) -> dict[str, str]:
    """The user's variables of a role (spec.env, then the role's), refusing what only Kubernetes
    resolves."""
    out: dict[str, str] = {}
    for e in user_env(spec, role, name):
        if e.value_from is not None:
            raise ValueError(
                f"spec.env {e.name}: valueFrom (a Kubernetes reference) cannot be resolved by "
                "`kubedistill run`; give it a value for local runs"
            )
        out[e.name] = e.value or ""
    return out


def expand_references(text: str, env: Mapping[str, str]) -> str:
    """`text` with each $(NAME) of a variable in `env` replaced by its value, as Kubernetes
    expands a container's command: $$ is a literal $, and a reference to a variable not in `env`
    stays as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text.startswith("$(", i):
            end = text.find(")", i + 2)
            if end != -1 and text[i + 2 : end] in env:
                out.append(env[text[i + 2 : end]])
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def environment_process(config: JobConfig, index: int, replica: int, port: int) -> ProcessPlan:
    """One replica of spec.environments[index]: the user's command (not `kubedistill role`) on
    `port`, which PORT names and $(PORT) in the command becomes (as the operator's pod gets its
    spec port). Started in the working directory of `kubedistill run`."""
    spec = config.spec
    e = spec.environments[index]
    if not e.command:
        raise ValueError(
            f"spec.environments[{index}].command: required by `kubedistill run`, which runs the environment"
            " server as a local process (the image's own entrypoint serves only on Kubernetes)"
        )
    identity = Identity(role=Role.environment, replica=replica, environment=e.name)
    env = role_env(spec, config.job, config.namespace, identity, HOST, config.endpoints.master_port)
    env["PORT"] = str(port)
    env.update(_user_variables(spec, Role.environment, e.name))
    argv = [expand_references(part, env) for part in e.command]
    return ProcessPlan(f"env-{e.name}-{replica}", identity, port, env, float(e.overrides.cpu_threads or 1), 0, argv)


def rollout_process(config: JobConfig, config_path: Path, replica: int, port: int) -> ProcessPlan:
    spec = config.spec
    identity = Identity(role=Role.rollout, replica=replica)
    return role_process(
        config, config_path, identity, port, spec.rollout.overrides.cpu_threads, spec.gpus_of(spec.rollout.gpus)
    )


def fit_gpus(config: JobConfig, processes: list[ProcessPlan], available: int) -> JobConfig:
    """Fit the processes on the `available` GPUs (share_gpus): sets each process's num_gpus and
    extra env, and returns the config with the vLLM servers' gpu_memory_utilization lowered to
    their share (never raised). Unchanged when the GPUs suffice."""
    if not any(p.gpus for p in processes):
        return config  # on CPU: nothing to fit, and no torch import before the roles start
    from kubedistill.runtime.weight_sync.group import resolve_backend  # imports torch

    spec = config.spec
    nccl = resolve_backend(spec.weight_sync.backend, spec.device) == "nccl"
    shares = share_gpus(
        [GpuDemand(name=p.name, role=p.identity.role, gpus=int(p.gpus)) for p in processes], available, nccl
    )
    memory: float | None = None
    for p in processes:
        share = shares[p.name]
        p.gpus = share.num_gpus
        p.env.update(share.env)
        if share.memory_utilization is not None:
            memory = share.memory_utilization
    if memory is None:
        return config
    data = spec.model_dump(by_alias=True)
    for section in [data["rollout"], *data["teachers"]]:
        inference = section["inference"]
        if inference["engine"] == "vllm":  # the hf engine has no memory fraction to lower
            inference["gpuMemoryUtilization"] = min(inference["gpuMemoryUtilization"], memory)
    return config.model_copy(update={"spec": DistillationJobSpec.model_validate(data)})


def _poll_progress(http: BlockingClient, url: str) -> TrainerProgress | None:
    """Trainer rank 0's GET /status; None while it does not answer (starting, restarting, gone)
    or answers with an error or a document it cannot read."""
    try:
        return http.call("GET", f"{url}/status", TrainerProgress, timeout=2)
    except REQUEST_ERRORS:
        return None
    except ValueError:  # pydantic's ValidationError: a document of another version, say
        return None


def _progress_line(progress: TrainerProgress | None, total: int, elapsed: float) -> str:
    parts = [f"step {progress.step if progress is not None else 0}/{total}", f"{elapsed:6.0f}s"]
    if progress is not None:
        shown: tuple[tuple[float | int | None, str, str], ...] = (
            (progress.samples_per_second, "samples/s", "{:.1f}"),
            (progress.reward_mean, "reward", "{:.3f}"),
            (progress.kl_student_teacher, "KL", "{:.4f}"),
            (progress.staleness_mean, "staleness", "{:.2f}"),
            (progress.weight_version, "weights v", "{}"),
        )
        for value, label, fmt in shown:
            if value is not None:
                parts.append(f"{label} {fmt.format(value)}")
        held_out = progress.evaluation
        if held_out is not None and held_out.score is not None:
            parts.append(f"held-out {held_out.score:.3f} @{held_out.step}")
    return " | ".join(parts)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM (e.g. from a supervisor) stops the run like Ctrl-C does.
    raise KeyboardInterrupt


@dataclass
class LocalJob:
    """A job file made ready to run here: its config (loopback endpoints) and its processes."""

    path: Path
    job: DistillationJob
    run_dir: Path
    config: JobConfig
    processes: list[ProcessPlan]

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.json"

    @property
    def history_path(self) -> Path:
        return self.run_dir / "history.jsonl"

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def gang(self) -> list[ProcessPlan]:
        return [p for p in self.processes if p.identity.role is Role.trainer]


def prepare(job_path: Path, workdir: Path | None, log: Callable[[str], object]) -> LocalJob | None:
    """The job ready to run, or None after saying in one line why it cannot run here."""
    from kubedistill.api.validate import load_job

    try:
        job = load_job(job_path)
    except ValueError as exc:
        log(str(exc))
        return None
    if job.spec.suspend:
        log(f"{job_path}: spec.suspend is true, so the job starts nothing; set it to false to run it")
        return None
    if job.spec.ttl_seconds_after_finished is not None:
        log("kubedistill run: spec.ttlSecondsAfterFinished applies in a cluster only; a local run keeps its directory")
    job.spec = absolute_paths(job.spec, Path.cwd())
    run_dir = Path(workdir or Path(".kubedistill/runs") / job.metadata.name).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    try:
        config, processes = local_processes(job, run_dir / "config.json")
    except ValueError as exc:
        log(f"{job_path}: {exc}")
        return None
    local = LocalJob(job_path, job, run_dir, config, processes)
    local.history_path.unlink(missing_ok=True)
    local.gang[0].env[HISTORY_ENV] = str(local.history_path)
    return local


def make_launcher(kind: str, local: LocalJob, address: str | None, zygote: Zygote | None = None) -> Launcher:
    if kind == "ray":
        from kubedistill.runtime.entrypoints.launch_ray import RayLauncher

        return RayLauncher(local.logs, address, sum(p.cpus for p in local.processes))
    return ProcessLauncher(local.logs, visible_gpus(os.environ), zygote)


def run(
    job_path: Path,
    *,
    address: str | None = None,
    launcher: str | None = None,
    workdir: Path | None = None,
    report: Path | None = None,
    progress: bool | None = None,
    log: Callable[[str], object] = print,
    zygote: Zygote | None = None,
) -> int:
    """Run a job locally; returns the process exit code (0 = the trainer succeeded). `launcher`:
    "processes" or "ray"; default Ray with an `address`, else plain processes. `zygote`: one
    already importing (the command line starts it first); without, one starts here where
    `forks_roles` says so. It is closed with the run."""
    kind = launcher_kind(launcher, address)
    if address and launcher == "processes":
        log("kubedistill run: --address (or RAY_ADDRESS) names a Ray cluster; use it with --launcher ray")
        if zygote is not None:
            zygote.close()
        return 1
    if zygote is None and forks_roles(kind, visible_gpus(os.environ)):
        zygote = Zygote()  # the roles' common imports start now, beside reading the job
    local = prepare(job_path, workdir, log)
    if local is None:
        if zygote is not None:
            zygote.close()
        return 1
    launch = make_launcher(kind, local, address, zygote)
    try:
        local.config = fit_gpus(local.config, local.processes, launch.gpus())
    except ValueError as exc:
        launch.close()
        log(f"{job_path}: {exc}")
        return 1
    local.config.dump(local.config_path)
    interactive = sys.stdout.isatty() if progress is None else progress
    outcome: dict[str, Any] = {"job": local.job.metadata.name, "mode": local.job.spec.mode.value, "launcher": kind}
    started = time.time()
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
    loop = Supervisor(local, launch, outcome, log, interactive)
    try:
        code = loop.run(started)
    except KeyboardInterrupt:
        if interactive:
            print()
        log("kubedistill run: interrupted; stopping every process")
        outcome["result"] = "interrupted"
        code = 130
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        loop.http.close()
        launch.close()
    outcome["rolloutScaling"] = loop.scaler.events if loop.scaler is not None else []
    outcome["seconds"] = round(time.time() - started, 1)
    _finish_report(local, outcome, log, report)
    return code


@dataclass
class Supervisor:
    """The I/O around supervisor.decide: observe, decide, carry out, once a second."""

    local: LocalJob
    launch: Launcher
    outcome: dict[str, Any]
    log: Callable[[str], object]
    interactive: bool
    http: BlockingClient = field(default_factory=lambda: BlockingClient(timeout=10.0, name="status-poll"))
    scaler: RolloutScaler | None = None
    polled: TrainerProgress | None = None

    def run(self, started: float) -> int:
        local = self.local
        self.scaler = _scaler(local, self.log)
        self.outcome.update(restarts=[], disruptions=[])
        self.start_waves()  # when a process of an earlier wave ended, the first decision reports it
        self.log(
            f"kubedistill run: {len(local.processes)} processes for job {local.job.metadata.name} "
            f"({local.job.spec.mode.value}, {self.outcome['launcher']}); logs in {local.logs}"
        )
        spec = local.job.spec
        job = Supervised(tuple(p.name for p in local.gang), spec.backoff_limit, spec.active_deadline_seconds, started)
        status = SupervisorStatus()
        last_print = 0.0
        while True:
            self.scale_up()
            exits = self.launch.poll()
            fresh = _poll_progress(self.http, local.config.endpoints.trainer)
            self.polled = fresh or self.polled
            actions = decide(Observed(job, status, exits, frozenset(self.scaler.retiring)), fresh, time.time())
            status = actions.status
            if actions.finish is not None:
                return self.finish(actions.finish, exits)
            if actions.restart_gang is not None:
                if not self.restart_gang(actions.restart_gang, exits[actions.restart_gang.cause.name], started):
                    return 1
                continue
            self.launch.stop(self.scaler.due(fresh))
            last_print = self.show(started, last_print)
            time.sleep(1.0)

    def start_waves(self) -> bool:
        """Start the processes in waves (gpu_share.start_waves); False when a process of a wave
        ended before the next could start."""
        by_name = {p.name: p for p in self.local.processes}
        waves = start_waves([Started(name=p.name, role=p.identity.role, num_gpus=p.gpus) for p in self.local.processes])
        for i, wave in enumerate(waves):
            if i and not self.wait_healthy([by_name[n] for n in waves[i - 1]]):
                return False
            self.launch.start([by_name[n] for n in wave])
        return True

    def wait_healthy(self, wave: Sequence[ProcessPlan]) -> bool:
        """Wait until every server of `wave` answers /health (up to weightSync.timeoutSeconds);
        False as soon as one of the wave's processes has ended."""
        servers = [p for p in wave if p.identity.role is not Role.trainer]
        if not servers:
            return True
        deadline = time.monotonic() + float(self.local.job.spec.weight_sync.timeout_seconds)

        def one_ended() -> bool:
            exits = self.launch.poll()
            return any(exits.get(p.name) is not None for p in wave)

        async def every_server_up() -> bool:
            for p in servers:
                await fetch(self.http.session, "GET", f"http://{HOST}:{p.port}/health", timeout=2)
            return True

        try:
            up = self.http.run(until_healthy(every_server_up, every=0.5, deadline=deadline, give_up=one_ended))
        except REQUEST_ERRORS:
            return True  # not all up by the deadline: the next wave starts anyway
        return up is not None

    def scale_up(self) -> None:
        assert self.scaler is not None
        for p in self.scaler.poll():
            try:
                self.launch.start([p], timeout=PLACE_SECONDS)
            except PlacementError:
                self.scaler.unplaced(p)  # and the replicas after it, which are not started
                break

    def restart_gang(self, decision: GangDecision, code: Exit, started: float) -> bool:
        """Stop every trainer process (a rank may still wait in a collective of the dead gang)
        and start them again with the same config; their logs continue in the same files."""
        name, local = decision.cause.name, self.local
        self.log(
            f"kubedistill run: {decision.reason}: {decision.message}\n"
            f"--- last lines of {name} ---\n{_tail(local.logs / f'{name}.log', 8)}"
        )
        record = gang_record(decision, code, len(read_history(local.history_path)), round(time.time() - started, 1))
        self.outcome["disruptions" if decision.outcome is GangOutcome.disrupted else "restarts"].append(record)
        self.launch.stop(p.name for p in local.gang)
        try:
            self.launch.start(local.gang, timeout=PLACE_SECONDS)
        except PlacementError as e:
            message = f"could not start the restarted trainer gang again: {e}"
            self.log(f"kubedistill run: {message}")
            self.outcome["result"] = message
            return False
        self.polled = None
        return True

    def finish(self, finish: Finish, exits: Mapping[str, Exit]) -> int:
        if self.interactive:
            print()
        self.outcome["result"] = finish.result
        if finish.code != 0:
            self.log(f"kubedistill run: {finish.reason}: {finish.result}")
            trainer0 = self.local.gang[0].name
            for name in [trainer0] + [n for n in exits if n != trainer0]:
                # exits holds the started processes only: an environment wave that failed never started the trainer
                if exits.get(name) not in (None, 0, -signal.SIGTERM):  # the last lines of every failed process
                    self.log(f"--- last lines of {name} ---\n{_tail(self.local.logs / f'{name}.log')}")
        self.outcome["status"] = self.polled.to_json() if self.polled is not None else {}
        return finish.code

    def show(self, started: float, last_print: float) -> float:
        """The progress line: rewritten in place on a terminal, else every 10 s."""
        now = time.time()
        line = _progress_line(self.polled, self.local.job.spec.trainer.total_steps, now - started)
        if self.interactive:
            print("\r" + line.ljust(100), end="", flush=True)
        elif now - last_print >= 10:
            self.log(line)
            return now
        return last_print


def _scaler(local: LocalJob, log: Callable[[str], object]) -> RolloutScaler:
    from kubedistill.api.validate import load_job

    return RolloutScaler(
        job_path=local.path,
        spec=local.job.spec,
        config=local.config,
        config_path=local.config_path,
        template=next(p for p in local.processes if p.identity.role is Role.rollout),
        new_process=lambda cfg, replica, taken: rollout_process(cfg, local.config_path, replica, free_port(taken)),
        load=lambda path: absolute_paths(load_job(path).spec, Path.cwd()),
        log=log,
    )


def _finish_report(local: LocalJob, outcome: dict[str, Any], log: Callable[[str], object], report: Path | None) -> None:
    """The last line, and the JSON report."""
    spec = local.job.spec
    outcome["logs"] = str(local.logs)
    history = read_history(local.history_path)
    outcome["history"] = history
    final: dict[str, Any] = outcome.get("status", {})
    if history:
        # /status is polled once a second and is gone once the trainer exits: the last history
        # line (its fields and the step's extras) is the trainer's final word.
        last = history[-1]
        if TrainerProgress.from_json(last).step >= TrainerProgress.from_json(final).step:
            final = {**final, **{k: v for k, v in last.items() if k != "time"}}
            outcome["status"] = final
    gangs = outcome.get("restarts", []), outcome.get("disruptions", [])
    log(
        f"kubedistill run: {outcome['result']} after {outcome['seconds']} s; "
        + (f"gang restarts {len(gangs[0])}/{spec.backoff_limit}, disruptions {len(gangs[1])}; " if any(gangs) else "")
        + _progress_line(
            TrainerProgress.from_json(final) if final else None, spec.trainer.total_steps, outcome["seconds"]
        )
    )
    if report is not None:
        report.write_text(json.dumps(outcome, indent=2))
