"""`kubedistill run JOB.yaml`: every role of a job as local processes placed by Ray.

The processes are the very `kubedistill role ...` entrypoints and config file the pods use; only
the addresses differ (loopback and free ports instead of pod DNS names). Ray places them (one
machine with a local `ray.init()`, or an existing cluster with `--address`); each role process
runs as a child of a small Ray actor so Ray accounts for its CPUs/GPUs and kills it with the
actor. The launcher waits for trainer rank 0, shows progress from its `/status`, and stops every
process when the trainer ends, when a server process fails, or on Ctrl-C. A stopped trainer
process restarts the whole trainer gang, decided by the operator's own failure policy
(kubedistill.api.failures): a process's own exit counts against spec.backoffLimit, losing the Ray
actor that hosts it (its worker or node went away) is a disruption and does not. The servers keep
running; the new gang resumes from the last checkpoint and re-forms the weight-sync group with them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from io import FileIO
from pathlib import Path
from types import FrameType
from typing import Any

from kubedistill.api.failures import GangDecision, GangFailure, GangOutcome, decide_gang_failure
from kubedistill.api.job import DistillationJob
from kubedistill.api.progress import HISTORY_ENV, TrainerProgress
from kubedistill.api.roleconfig import Endpoints, Identity, JobConfig, Role, role_env, trainer_world_size, user_env
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.driver.history import read_history
from kubedistill.runtime.entrypoints.gpu_share import GpuDemand, Started, share_gpus, start_waves
from kubedistill.runtime.wire.http import REQUEST_ERRORS, BlockingClient

HOST = "127.0.0.1"


@dataclass
class ProcessPlan:
    """One role process to start."""

    name: str
    identity: Identity
    port: int
    env: dict[str, str]
    cpus: float
    gpus: float
    """Ray's num_gpus: a fraction when roles share a GPU (see gpu_share.py)."""
    argv: list[str] = field(default_factory=list)


LOCAL_SCALE_CPUS = 64
"""Logical CPUs a local Ray gets beyond the job's, for rollout replicas added while it runs."""
PLACE_SECONDS = 120.0
"""How long a rollout replica added while the job runs may wait for Ray to place it."""

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
    }
    master_port = free_port(taken)
    endpoints = Endpoints(
        trainer=f"http://{HOST}:{ports['trainer'][0]}",
        master_addr=HOST,
        master_port=master_port,
        weight_sync_port=free_port(taken),
        rollout=[f"http://{HOST}:{p}" for p in ports["rollout"]],
        teachers={t.name: [f"http://{HOST}:{p}" for p in ports[f"teacher/{t.name}"]] for t in spec.teachers},
    )
    config = JobConfig(job=name, namespace=ns, spec=spec, endpoints=endpoints)

    processes: list[ProcessPlan] = []
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
    for e in user_env(spec, identity.role, identity.teacher):
        if e.value_from is not None:
            raise ValueError(
                f"spec.env {e.name}: valueFrom (a Kubernetes reference) cannot be resolved by "
                "`kubedistill run`; give it a value for local runs"
            )
        env[e.name] = e.value or ""
    return ProcessPlan(f"{label}-{identity.replica}", identity, port, env, float(threads or 1), gpus, argv)


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
    from kubedistill.runtime.weight_sync.group import resolve_backend  # imports torch: not at `kubedistill --help`

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
        inference["gpuMemoryUtilization"] = min(inference["gpuMemoryUtilization"], memory)
    return config.model_copy(update={"spec": DistillationJobSpec.model_validate(data)})


def _process_actor_class() -> Any:
    """The Ray actor class (a ray.remote class: typed Any, like the rest of ray)."""
    import ray

    @ray.remote
    class RoleProcess:
        """Runs one `kubedistill role` process; it dies with this actor (PDEATHSIG)."""

        log: FileIO
        proc: subprocess.Popen[bytes]

        def start(self, argv: list[str], env: dict[str, str], log_path: str) -> int:
            def die_with_parent() -> None:
                import ctypes

                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

            if getattr(self, "log", None) is not None:  # a restarted trainer rank
                self.log.close()
            self.log = open(log_path, "ab", buffering=0)
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, **env},
                stdout=self.log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
                start_new_session=True,
            )
            return self.proc.pid

        def poll(self) -> int | None:
            return self.proc.poll()

        def stop(self, grace: float = 10.0) -> int | None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(grace)
                except Exception:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
            return self.proc.returncode

    return RoleProcess


@dataclass(frozen=True)
class ActorLost:
    """The Ray actor hosting a process died: its worker process or its node went away, and the
    process with it (PDEATHSIG). What the cluster would call a disruption: nothing the process did."""

    reason: str
    """CamelCase, as a disruption reason: NodePreempted (Ray drained the node to preempt it) or RayActorDied."""
    detail: str
    """Ray's own word on why."""


Exit = int | None | ActorLost
"""A process as one poll sees it: running (None), exited with this code, or lost with its actor."""


def actor_lost(err: BaseException) -> ActorLost:
    """An ActorLost from the RayActorError a call on a dead actor raised."""
    # Ray's message: a fixed first line, tab-indented fields (ids, pid, ip), then why it died.
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith("\t")]
    detail = lines[-1] if lines else type(err).__name__
    return ActorLost("NodePreempted" if getattr(err, "preempted", False) else "RayActorDied", detail[:500])


def exit_text(code: Exit) -> str:
    """How a process ended, for messages: "exited with -9 (SIGKILL)", "lost its Ray actor (...)"."""
    if isinstance(code, ActorLost):
        return f"lost its Ray actor ({code.reason}: {code.detail})"
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"exited with {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exited with {code}"


def gang_failures(gang: Sequence[str], exits: Mapping[str, Exit]) -> list[GangFailure]:
    """The stopped members of the trainer gang (`gang`: process names in rank order), as the
    failure policy's causes.

    Any exit of the process itself, whatever the code or signal (a crash, the OOM killer's
    SIGKILL, a SIGTERM or `kill -9` by hand), is the job's own failure: the launcher cannot tell
    who sent a signal, and the operator likewise counts a pod deleted by hand. Only the Ray actor
    hosting the process dying is the cluster taking it away. Ranks >= 1 exit 0 when rank 0 closes
    the gang, and rank 0's exit 0 is the job's success, after which nothing counts as a failure."""
    if exits.get(gang[0]) == 0:
        return []
    out = []
    for name in gang:
        code = exits.get(name)
        if isinstance(code, ActorLost):
            out.append(GangFailure("trainer process", name, "is gone", code.reason))
        elif code not in (None, 0):
            out.append(GangFailure("trainer process", name, exit_text(code)))
    return out


def gang_record(decision: GangDecision, code: Exit, history_lines: int, seconds: float) -> dict[str, Any]:
    """The report's entry for a gang restart (outcome["restarts"]) or a disruption (outcome["disruptions"])."""
    record: dict[str, Any] = {"process": decision.cause.name}
    if decision.outcome is GangOutcome.disrupted:
        record["reason"] = decision.cause.disruption
        record["detail"] = code.detail if isinstance(code, ActorLost) else exit_text(code)
    else:
        record["exitCode"] = code if not isinstance(code, ActorLost) else None
    record.update(historyLines=history_lines, seconds=seconds, message=decision.message)
    return record


def _poll_exits(actors: Mapping[str, Any]) -> dict[str, Exit]:
    import ray

    refs = {name: a.poll.remote() for name, a in actors.items()}
    exits: dict[str, Exit] = {}
    for name, ref in refs.items():
        try:
            exits[name] = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            exits[name] = None  # unreachable for now, not dead (a network blip): the next poll tells
        except ray.exceptions.RayActorError as e:
            exits[name] = actor_lost(e)
    return exits


def _poll_progress(http: BlockingClient, url: str) -> TrainerProgress | None:
    """Trainer rank 0's GET /status; None while it does not answer (starting, restarting, gone)
    or answers with an error or a document it cannot read."""
    try:
        return http.call("GET", f"{url}/status", TrainerProgress, timeout=2)
    except REQUEST_ERRORS:
        return None
    except ValueError:  # pydantic's ValidationError: a document of another version, say
        return None


def _wait_healthy(
    http: BlockingClient, wave: Sequence[ProcessPlan], actors: Mapping[str, Any], spec: DistillationJobSpec
) -> bool:
    """Wait until every server of `wave` answers /health (up to weightSync.timeoutSeconds); False
    as soon as one of the wave's processes has ended."""
    servers = [p for p in wave if p.identity.role is not Role.trainer]
    deadline = time.monotonic() + float(spec.weight_sync.timeout_seconds)
    while servers and time.monotonic() < deadline:
        exits = _poll_exits({p.name: actors[p.name] for p in wave})
        if any(code is not None for code in exits.values()):
            return False
        try:
            for p in servers:
                http.fetch("GET", f"http://{HOST}:{p.port}/health", timeout=2)
            return True
        except REQUEST_ERRORS:
            time.sleep(0.5)
    return True


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
    return " | ".join(parts)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM (e.g. from a supervisor) stops the run like Ctrl-C does.
    raise KeyboardInterrupt


def run(
    job_path: Path,
    *,
    address: str | None = None,
    workdir: Path | None = None,
    report: Path | None = None,
    progress: bool | None = None,
    log: Callable[[str], object] = print,
) -> int:
    """Run a job locally; returns the process exit code (0 = the trainer succeeded)."""
    from kubedistill.api.validate import load_job

    try:
        job = load_job(job_path)
    except ValueError as exc:
        log(str(exc))
        return 1
    job.spec = absolute_paths(job.spec, Path.cwd())
    run_dir = Path(workdir or Path(".kubedistill/runs") / job.metadata.name).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    try:
        config, processes = local_processes(job, config_path)
    except ValueError as exc:
        log(f"{job_path}: {exc}")
        return 1
    history_path = run_dir / "history.jsonl"
    history_path.unlink(missing_ok=True)
    for p in processes:
        if p.identity.role is Role.trainer and p.identity.replica == 0:
            p.env[HISTORY_ENV] = str(history_path)

    import ray

    wanted_cpus = sum(p.cpus for p in processes)
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # Locally the roles share the machine on purpose (like separate GPU pools share a node):
        # give Ray enough logical CPUs that every role gets placed, and rollout replicas added
        # while the job runs too (Ray only accounts these CPUs; it starts no worker per CPU).
        ray.init(
            num_cpus=max(int(wanted_cpus + 0.999), os.cpu_count() or 1) + LOCAL_SCALE_CPUS,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        config = fit_gpus(config, processes, int(ray.cluster_resources().get("GPU", 0)))
    except ValueError as exc:
        ray.shutdown()
        log(f"{job_path}: {exc}")
        return 1
    config.dump(config_path)
    from kubedistill.runtime.entrypoints.local_scaling import RolloutScaler

    scaler = RolloutScaler(
        job_path=job_path,
        spec=job.spec,
        config=config,
        config_path=config_path,
        template=next(p for p in processes if p.identity.role is Role.rollout),
        new_process=lambda cfg, replica, taken: rollout_process(cfg, config_path, replica, free_port(taken)),
        load=lambda path: absolute_paths(load_job(path).spec, Path.cwd()),
        log=log,
    )
    RoleProcess = _process_actor_class()
    actors: dict[str, Any] = {}
    started = time.time()
    interactive = sys.stdout.isatty() if progress is None else progress
    outcome: dict[str, Any] = {"job": job.metadata.name, "mode": job.spec.mode.value}
    code = 1
    http = BlockingClient(timeout=10.0, name="status-poll")
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
    try:
        by_name = {p.name: p for p in processes}
        waves = start_waves([Started(name=p.name, role=p.identity.role, num_gpus=p.gpus) for p in processes])
        for i, wave in enumerate(waves):
            if i and not _wait_healthy(http, [by_name[n] for n in waves[i - 1]], actors, job.spec):
                break  # a process of the previous wave ended: the loop below reports it
            # A wave's actors are placed and started together: each takes Ray a worker process.
            wave_actors = {
                n: RoleProcess.options(num_cpus=by_name[n].cpus, num_gpus=by_name[n].gpus).remote() for n in wave
            }
            ray.get(
                [
                    a.start.remote(by_name[n].argv, by_name[n].env, str(run_dir / "logs" / f"{n}.log"))
                    for n, a in wave_actors.items()
                ]
            )
            actors.update(wave_actors)
        log(
            f"kubedistill run: {len(processes)} processes for job {job.metadata.name} "
            f"({job.spec.mode.value}); logs in {run_dir / 'logs'}"
        )
        trainer0 = next(p.name for p in processes if p.identity.role is Role.trainer and p.identity.replica == 0)
        gang = [p for p in processes if p.identity.role is Role.trainer]
        restarts: list[dict[str, Any]] = []
        disruptions: list[dict[str, Any]] = []
        outcome["restarts"] = restarts
        outcome["disruptions"] = disruptions
        last_print = 0.0
        polled: TrainerProgress | None = None
        checkpoint: str | None = None  # the newest the trainer reported, across gang restarts
        while True:
            for p in scaler.poll():
                actor = RoleProcess.options(num_cpus=p.cpus, num_gpus=p.gpus, name=None).remote()
                try:
                    ray.get(
                        actor.start.remote(p.argv, p.env, str(run_dir / "logs" / f"{p.name}.log")),
                        timeout=PLACE_SECONDS,
                    )
                except ray.exceptions.GetTimeoutError:
                    ray.kill(actor)
                    scaler.unplaced(p)  # and the replicas after it, which are not started
                    break
                actors[p.name] = actor
            exits = _poll_exits(actors)
            decision = decide_gang_failure(
                gang_failures([p.name for p in gang], exits),
                restarts=len(restarts),
                disruptions=len(disruptions),
                backoff_limit=job.spec.backoff_limit,
                last_checkpoint=checkpoint,
            )
            if decision is not None:
                name = decision.cause.name
                if decision.outcome is GangOutcome.failed:  # the last lines of every failed process follow
                    log(f"kubedistill run: {decision.reason}: {decision.message}")
                    outcome["result"] = decision.message
                    rank0 = exits[trainer0]
                    code = rank0 if isinstance(rank0, int) and rank0 != 0 else 1
                    break
                log(
                    f"kubedistill run: {decision.reason}: {decision.message}\n"
                    f"--- last lines of {name} ---\n{_tail(run_dir / 'logs' / f'{name}.log', 8)}"
                )
                record = gang_record(
                    decision, exits[name], len(read_history(history_path)), round(time.time() - started, 1)
                )
                (disruptions if decision.outcome is GangOutcome.disrupted else restarts).append(record)
                try:
                    _restart_gang(actors, gang, run_dir, exits, RoleProcess)
                except PlacementError as e:
                    log(f"kubedistill run: {e}")
                    outcome["result"] = str(e)
                    code = 1
                    break
                polled = None
                continue
            fresh = _poll_progress(http, config.endpoints.trainer)
            polled = fresh or polled
            checkpoint = (fresh.last_checkpoint if fresh is not None else None) or checkpoint
            for name in scaler.due(fresh):
                try:
                    ray.get(actors.pop(name).stop.remote(), timeout=30)
                except Exception as e:
                    log(f"kubedistill run: stopping {name}: {e!r}")
            now = time.time()
            line = _progress_line(polled, job.spec.trainer.total_steps, now - started)
            if interactive:
                print("\r" + line.ljust(100), end="", flush=True)
            elif now - last_print >= 10:
                log(line)
                last_print = now
            # Any other end of a trainer rank went through the failure policy above.
            if exits[trainer0] == 0:
                code = 0
                outcome["result"] = "succeeded"
                break
            # Trainer ranks >= 1 end (exit 0) when rank 0 closes the gang, a moment before it exits.
            followers = {p.name for p in gang if p.name != trainer0}
            failed = [
                n
                for n, c in exits.items()
                if c is not None and not (n in followers and c == 0) and n not in scaler.retiring and n in actors
            ]
            if failed:
                outcome["result"] = f"{failed[0]} {exit_text(exits[failed[0]])}"
                code = 1
                break
            time.sleep(1.0)
        if interactive:
            print()
        if code != 0:
            last = _poll_exits(actors)
            for name in [trainer0] + [n for n in actors if n != trainer0]:
                if last[name] not in (None, 0, -signal.SIGTERM):
                    log(f"--- last lines of {name} ---\n{_tail(run_dir / 'logs' / f'{name}.log')}")
        outcome["status"] = polled.to_json() if polled is not None else {}
    except KeyboardInterrupt:
        if interactive:
            print()
        log("kubedistill run: interrupted; stopping every process")
        outcome["result"] = "interrupted"
        code = 130
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        http.close()
        for actor in actors.values():
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception:
                pass
        ray.shutdown()
    outcome["rolloutScaling"] = scaler.events
    outcome["seconds"] = round(time.time() - started, 1)
    outcome["logs"] = str(run_dir / "logs")
    history = read_history(history_path)
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
        + (
            f"gang restarts {len(gangs[0])}/{job.spec.backoff_limit}, disruptions {len(gangs[1])}; "
            if any(gangs)
            else ""
        )
        + _progress_line(
            TrainerProgress.from_json(final) if final else None, job.spec.trainer.total_steps, outcome["seconds"]
        )
    )
    if report is not None:
        report.write_text(json.dumps(outcome, indent=2))
    return code


class PlacementError(RuntimeError):
    """Ray could not place a trainer process again (its node is gone and no other has room)."""


def _restart_gang(
    actors: dict[str, Any], gang: list[ProcessPlan], run_dir: Path, exits: Mapping[str, Exit], role_process: Any
) -> None:
    """Stop every trainer process (a rank may still wait in a collective of the dead gang),
    then start them all again with the same config; their logs continue in the same files. A
    rank whose actor died (or dies while stopping) gets a new actor, which Ray places where
    there is room."""
    import ray

    stopping = {p.name: actors[p.name].stop.remote() for p in gang if not isinstance(exits.get(p.name), ActorLost)}
    lost = {p.name for p in gang if p.name not in stopping}
    for name, ref in stopping.items():
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            lost.add(name)
    for p in gang:
        if p.name in lost:
            actors[p.name] = role_process.options(num_cpus=p.cpus, num_gpus=p.gpus, name=None).remote()
        try:
            ray.get(
                actors[p.name].start.remote(p.argv, p.env, str(run_dir / "logs" / f"{p.name}.log")),
                timeout=PLACE_SECONDS,
            )
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
            if p.name in lost:  # not placed: it must not hold its CPUs/GPUs, nor the shutdown up
                ray.kill(actors.pop(p.name))
            raise PlacementError(
                f"could not start {p.name} again for the restarted trainer gang within {PLACE_SECONDS:.0f} s: {e!r}"
            ) from e


def _run_command(args: argparse.Namespace) -> int:
    return run(
        Path(args.job),
        address=args.address,
        workdir=Path(args.workdir) if args.workdir else None,
        report=Path(args.report) if args.report else None,
        progress=args.progress,
    )


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="run every role of a job as local processes placed by Ray")
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="existing Ray cluster (default: local)")
    p.add_argument("--workdir", help="run directory (config, logs); default .kubedistill/runs/<job>")
    p.add_argument("--report", metavar="FILE", help="write a JSON summary here")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress line (default: when stdout is a terminal)",
    )
    p.set_defaults(func=_run_command)
