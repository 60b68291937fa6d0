"""`kubedistill run`'s trainer gang under a real local Ray, with `sleep` as the role processes
(about 10 s): the Ray worker hosting a rank dying is a disruption and the rank gets a new actor;
a signal to the process itself is the job's own failure."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubedistill.api.failures import GangOutcome, decide_gang_failure
from kubedistill.api.roleconfig import Identity, Role
from kubedistill.runtime.entrypoints import local

ray = pytest.importorskip("ray")


@pytest.fixture
def role_process() -> Iterator[Any]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield local._process_actor_class()
    finally:
        ray.shutdown()


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _eventually(check: Any, what: str, seconds: float = 20.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {seconds} s: {what}")


def test_a_dead_actor_is_a_disruption_and_a_killed_process_is_not(role_process: Any, tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    gang = [
        local.ProcessPlan(f"trainer-{i}", Identity(role=Role.trainer, replica=i), 0, {}, 1.0, 0, argv) for i in range(2)
    ]
    names = [p.name for p in gang]
    actors: dict[str, Any] = {}
    pids: dict[str, int] = {}
    for p in gang:
        actors[p.name] = role_process.options(num_cpus=1, num_gpus=0).remote()
        pids[p.name] = ray.get(actors[p.name].start.remote(p.argv, p.env, str(tmp_path / "logs" / f"{p.name}.log")))
    assert local._poll_exits(actors) == {"trainer-0": None, "trainer-1": None}

    # The Ray worker hosting rank 1 goes away (as with its node): the process goes with it.
    worker = ray.get(actors["trainer-1"].__ray_call__.remote(lambda self: os.getpid()))
    os.kill(worker, signal.SIGKILL)
    exits = _eventually(lambda: (e := local._poll_exits(actors))["trainer-1"] is not None and e, "the actor's death")
    assert isinstance(exits["trainer-1"], local.ActorLost) and exits["trainer-1"].reason == "RayActorDied"
    _eventually(lambda: _gone(pids["trainer-1"]), "the process dies with its actor")
    d = decide_gang_failure(local.gang_failures(names, exits), restarts=0, disruptions=0, backoff_limit=0)
    assert d is not None and d.outcome is GangOutcome.disrupted and (d.restarts, d.disruptions) == (0, 1)

    lost_actor = actors["trainer-1"]
    local._restart_gang(actors, gang, tmp_path, exits, role_process)
    assert actors["trainer-1"] is not lost_actor
    assert local._poll_exits(actors) == {"trainer-0": None, "trainer-1": None}
    assert _gone(pids["trainer-0"])  # the surviving rank was restarted too

    # A signal to the process itself counts, whoever sent it.
    pid = ray.get(actors["trainer-0"].__ray_call__.remote(lambda self: self.proc.pid))
    os.kill(pid, signal.SIGTERM)
    exits = _eventually(lambda: (e := local._poll_exits(actors))["trainer-0"] is not None and e, "the exit")
    d = decide_gang_failure(local.gang_failures(names, exits), restarts=0, disruptions=1, backoff_limit=0)
    assert d is not None and d.outcome is GangOutcome.failed
    assert (
        d.message == "trainer process trainer-0 exited with -15 (SIGTERM); backoffLimit 0 reached after 0 gang restarts"
    )
    ray.get([a.stop.remote() for a in actors.values()])
