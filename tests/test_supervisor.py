"""`kubedistill run`'s supervisor: decide() as a table of what it observed and what it does, and
the plain-process launcher that carries it out."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kubedistill.api.failures import GangOutcome
from kubedistill.api.progress import TrainerProgress
from kubedistill.api.roleconfig import Identity, Role
from kubedistill.runtime.entrypoints.gpu_ids import visible_gpus
from kubedistill.runtime.entrypoints.launch import ProcessLauncher, ProcessPlan, place_gpus
from kubedistill.runtime.entrypoints.supervisor import (
    Actions,
    ActorLost,
    Exit,
    Finish,
    Observed,
    Supervised,
    SupervisorStatus,
    decide,
)
from kubedistill.runtime.entrypoints.zygote import fork_blockers
from server_fixtures import zygote_handle

JOB = Supervised(("trainer-0", "trainer-1"), backoff_limit=2, active_deadline_seconds=None, started=1000.0)
RUNNING: dict[str, Exit] = {"trainer-0": None, "trainer-1": None, "rollout-0": None, "teacher-arith-0": None}
FRESH = SupervisorStatus()
LOST = ActorLost("RayActorDied", "its node died")


def _decide(
    exits: dict[str, Exit],
    status: SupervisorStatus = FRESH,
    now: float = 1010.0,
    deadline: int | None = None,
    retiring: frozenset[str] = frozenset(),
    progress: TrainerProgress | None = None,
) -> Actions:
    job = Supervised(JOB.gang, JOB.backoff_limit, deadline, JOB.started)
    return decide(Observed(job, status, {**RUNNING, **exits}, retiring), progress, now)


@pytest.mark.parametrize(
    ("exits", "status", "finish"),
    [
        # rank 0's exit 0 is the job's success, whatever the others did after it
        ({"trainer-0": 0}, SupervisorStatus(), Finish(0, "TrainerSucceeded", "succeeded")),
        ({"trainer-0": 0, "trainer-1": 3}, SupervisorStatus(), Finish(0, "TrainerSucceeded", "succeeded")),
        # the backoff limit reached: rank 0's own code is the run's
        (
            {"trainer-0": 3},
            SupervisorStatus(restarts=2),
            Finish(
                3,
                "BackoffLimitExceeded",
                "trainer process trainer-0 exited with 3; backoffLimit 2 reached after 2 gang restarts",
            ),
        ),
        (
            {"trainer-1": -signal.SIGKILL},
            SupervisorStatus(restarts=2),
            Finish(
                1,
                "BackoffLimitExceeded",
                "trainer process trainer-1 exited with -9 (SIGKILL); backoffLimit 2 reached after 2 gang restarts",
            ),
        ),
        # a server's end ends the run; a removed replica's does not
        ({"rollout-0": 1}, SupervisorStatus(), Finish(1, "ProcessFailed", "rollout-0 exited with 1")),
        ({"teacher-arith-0": 0}, SupervisorStatus(), Finish(1, "ProcessFailed", "teacher-arith-0 exited with 0")),
    ],
)
def test_what_ends_the_run(exits: dict[str, Exit], status: SupervisorStatus, finish: Finish) -> None:
    actions = _decide(exits, status)
    assert actions.finish == finish and actions.restart_gang is None


@pytest.mark.parametrize(
    ("exits", "status", "outcome", "after"),
    [
        ({"trainer-1": 1}, SupervisorStatus(), GangOutcome.restart, SupervisorStatus(restarts=1)),
        (
            {"trainer-0": -signal.SIGTERM},
            SupervisorStatus(restarts=1),
            GangOutcome.restart,
            SupervisorStatus(restarts=2),
        ),
        # the cluster taking a rank away is not counted against backoffLimit, even at the limit
        ({"trainer-1": LOST}, SupervisorStatus(restarts=2), GangOutcome.disrupted, SupervisorStatus(2, 1)),
        # both at once: the crash counts
        ({"trainer-0": LOST, "trainer-1": 1}, SupervisorStatus(), GangOutcome.restart, SupervisorStatus(restarts=1)),
    ],
)
def test_a_stopped_trainer_rank_restarts_the_gang(
    exits: dict[str, Exit], status: SupervisorStatus, outcome: GangOutcome, after: SupervisorStatus
) -> None:
    actions = _decide(exits, status)
    assert actions.finish is None and actions.restart_gang is not None
    assert actions.restart_gang.outcome is outcome and actions.status == after


def test_nothing_to_do_while_everything_runs() -> None:
    assert _decide({}) == Actions(SupervisorStatus())
    # rank 1 ends (exit 0) a moment before rank 0 when rank 0 closes the gang
    assert _decide({"trainer-1": 0}) == Actions(SupervisorStatus())
    # a removed rollout replica stopped after draining
    assert _decide({"rollout-1": -signal.SIGTERM}, retiring=frozenset({"rollout-1"})) == Actions(SupervisorStatus())


def test_active_deadline_fails_the_job_from_the_start_of_its_processes() -> None:
    assert _decide({}, now=1059.9, deadline=60).finish is None
    finish = _decide({}, now=1060.0, deadline=60).finish
    assert finish == Finish(1, "DeadlineExceeded", "the job ran longer than activeDeadlineSeconds (60 s)")
    # as in the operator, the deadline is checked before anything else
    assert _decide({"trainer-0": 0}, now=1061.0, deadline=60).finish == finish


def test_the_newest_checkpoint_is_carried_and_named_in_a_disruption() -> None:
    progress = TrainerProgress(step=10, last_checkpoint="/ckpt/step-00000010")
    assert _decide({}, progress=progress).status.last_checkpoint == "/ckpt/step-00000010"
    # the trainer not answering (None, or no checkpoint yet) keeps the last one known
    kept = SupervisorStatus(last_checkpoint="/ckpt/step-00000010")
    assert _decide({}, kept, progress=TrainerProgress(step=0)).status == kept
    actions = _decide({"trainer-1": LOST}, kept)
    assert actions.restart_gang is not None and "(/ckpt/step-00000010)" in actions.restart_gang.message


# --- the plain-process launcher ----------------------------------------------------------------


def test_gpus_are_placed_as_ray_places_them() -> None:
    ids = ["0", "1"]
    assert place_gpus(0, {}, ids) == []
    assert place_gpus(1, {"0": 1.0}, ids) == ["1"]
    assert place_gpus(2, {}, ids) == ["0", "1"] and place_gpus(2, {"1": 0.5}, ids) is None
    # fractions pack onto the first GPU with room (roles sharing one GPU)
    assert place_gpus(0.33, {"0": 0.66}, ids) == ["0"] and place_gpus(0.33, {"0": 0.99}, ids) == ["1"]
    assert place_gpus(0.5, {"0": 1.0, "1": 0.75}, ids) is None


def test_visible_gpus_without_torch(tmp_path: Path) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpus({}, dev=tmp_path) == ["0", "1"]


def _plan(name: str, code: str, gpus: float = 0) -> ProcessPlan:
    return ProcessPlan(
        name,
        Identity(role=Role.trainer, replica=0),
        0,
        {"KUBEDISTILL_WHO": name},
        1.0,
        gpus,
        [sys.executable, "-c", code],
    )


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])


@pytest.mark.parametrize("forked", [False, True], ids=["spawned", "forked"])
def test_process_launcher_starts_polls_and_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forked: bool) -> None:
    """The same behaviour whether each process is spawned or forked from a zygote."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PYTEST_CURRENT_TEST")  # as the session's fork server has it
    zygote = zygote_handle() if forked else None
    if zygote is not None:
        # The process's environment as the fork server saw it at its start: a variable an earlier
        # test left behind (the server is the session's) would make the launcher spawn instead.
        for name in fork_blockers(zygote.env, dict(os.environ)):
            if name in zygote.env:
                monkeypatch.setenv(name, zygote.env[name])
            else:
                monkeypatch.delenv(name)
    launcher = ProcessLauncher(tmp_path, gpu_ids=["0"], zygote=zygote)

    def _said(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text() if (tmp_path / f"{name}.log").exists() else ""

    show = "import os; print(os.environ['KUBEDISTILL_WHO'], os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)"
    launcher.start(
        [
            _plan("a", show + "; raise SystemExit(3)", gpus=0.5),
            _plan("b", show + "; import time; time.sleep(600)", gpus=0.5),
            _plan("c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
        ]
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (None in (launcher.poll()["a"], launcher.poll()["c"]) or not _said("b")):
        time.sleep(0.05)
    assert launcher.poll() == {"a": 3, "b": None, "c": -signal.SIGKILL}
    b = launcher.running["b"].proc
    assert (_parent(b.pid) == os.getpid()) != forked  # a forked one's parent is the fork server
    assert (tmp_path / "a.log").read_text() == "a 0\n"
    with pytest.raises(Exception, match="no GPU free for d"):  # a and b hold the one GPU
        launcher.start([_plan("d", "pass", gpus=1)])
    launcher.stop(["a", "b"])  # b ends on SIGTERM; both are forgotten, their GPU share freed
    assert launcher.poll() == {"c": -signal.SIGKILL} and (tmp_path / "b.log").read_text() == "b 0\n"
    # a whole GPU, and its CPUs as OMP_NUM_THREADS (as Ray sets them for an actor)
    launcher.start([_plan("d", show + "; print(os.environ['OMP_NUM_THREADS'], flush=True)", gpus=1)])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and launcher.poll()["d"] is None:
        time.sleep(0.05)
    assert (tmp_path / "d.log").read_text() == "d 0\n1\n"
    launcher.close()
    assert launcher.poll() == {}
    if zygote is not None:
        assert zygote.gone  # closed with the launcher
