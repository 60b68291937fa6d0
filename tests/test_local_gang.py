"""`kubedistill run --launcher ray`: the trainer gang under a real local Ray, with `sleep` as the
role processes (about 10 s): the Ray worker hosting a rank dying is a disruption and the rank gets
a new actor; a signal to the process itself is the job's own failure."""

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
from kubedistill.runtime.entrypoints.launch import ProcessPlan
from kubedistill.runtime.entrypoints.supervisor import ActorLost, gang_failures

ray = pytest.importorskip("ray")
launch_ray = pytest.importorskip("kubedistill.runtime.entrypoints.launch_ray")


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Any]:
    started = launch_ray.RayLauncher(tmp_path, address=None, cpus=2)
    try:
        yield started
    finally:
        started.close()


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


def _pid(launcher: Any, name: str) -> int:
    return int(ray.get(launcher.actors[name].__ray_call__.remote(lambda self: self.proc.pid)))


def test_a_dead_actor_is_a_disruption_and_a_killed_process_is_not(launcher: Any) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    gang = [ProcessPlan(f"trainer-{i}", Identity(role=Role.trainer, replica=i), 0, {}, 1.0, 0, argv) for i in range(2)]
    names = [p.name for p in gang]
    launcher.start(gang)
    pids = {n: _pid(launcher, n) for n in names}
    assert launcher.poll() == {"trainer-0": None, "trainer-1": None}

    # The Ray worker hosting rank 1 goes away (as with its node): the process goes with it.
    worker = ray.get(launcher.actors["trainer-1"].__ray_call__.remote(lambda self: os.getpid()))
    os.kill(worker, signal.SIGKILL)
    exits = _eventually(lambda: (e := launcher.poll())["trainer-1"] is not None and e, "the actor's death")
    assert isinstance(exits["trainer-1"], ActorLost) and exits["trainer-1"].reason == "RayActorDied"
    _eventually(lambda: _gone(pids["trainer-1"]), "the process dies with its actor")
    d = decide_gang_failure(gang_failures(names, exits), restarts=0, disruptions=0, backoff_limit=0)
    assert d is not None and d.outcome is GangOutcome.disrupted and (d.restarts, d.disruptions) == (0, 1)

    # The gang restart: every rank stopped, then started again on new actors.
    lost_actor = launcher.actors["trainer-1"]
    launcher.stop(names)
    launcher.start(gang, timeout=60)
    assert launcher.actors["trainer-1"] is not lost_actor
    assert launcher.poll() == {"trainer-0": None, "trainer-1": None}
    assert _gone(pids["trainer-0"])  # the surviving rank was restarted too

    # A signal to the process itself counts, whoever sent it.
    os.kill(_pid(launcher, "trainer-0"), signal.SIGTERM)
    exits = _eventually(lambda: (e := launcher.poll())["trainer-0"] is not None and e, "the exit")
    d = decide_gang_failure(gang_failures(names, exits), restarts=0, disruptions=1, backoff_limit=0)
    assert d is not None and d.outcome is GangOutcome.failed
    assert (
        d.message == "trainer process trainer-0 exited with -15 (SIGTERM); backoffLimit 0 reached after 0 gang restarts"
    )
