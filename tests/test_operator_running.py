"""Each phase of a running job's reconcile pass (kubedistill.operator.running), as a table."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kubedistill.api.failures import GangOutcome
from kubedistill.api.roleconfig import Role
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.api.status import DistillationJobStatus, Phase
from kubedistill.operator import running
from kubedistill.operator.observed import ChildRef, Observed, PodPhase, PodView
from kubedistill.operator.render import server_url, slots
from operator_fixtures import BASE_SPEC

T0 = datetime(2026, 1, 1, tzinfo=UTC)
JOB, NS = "j", "ml"
R, P, S, F = PodPhase.running, PodPhase.pending, PodPhase.succeeded, PodPhase.failed


def _spec(**overrides: Any) -> DistillationJobSpec:
    return DistillationJobSpec.model_validate({**BASE_SPEC, **overrides})


def _pods(spec: DistillationJobSpec, attempt: int = 0, **changes: dict[str, Any]) -> dict[str, PodView]:
    """Every pod of `spec`, Running and ready; `changes` by pod-name suffix ("trainer_0": {...});
    a change of None drops the pod."""
    out = {}
    for s in slots(spec):
        name = s.pod_name(JOB)
        fields: dict[str, Any] = {
            "name": name,
            "role": s.role,
            "replica": s.replica,
            "teacher": s.teacher,
            "attempt": attempt if s.role is Role.trainer else None,
            "phase": R,
            "ready": True,
        }
        key = name.removeprefix(f"{JOB}-").replace("-", "_")
        if key in changes and changes[key] is None:
            continue
        fields.update(changes.get(key) or {})
        out[name] = PodView(**fields)
    return out


def _observed(spec: DistillationJobSpec, attempt: int = 0, **changes: dict[str, Any]) -> Observed:
    return Observed(pods=_pods(spec, attempt, **changes))


@pytest.mark.parametrize(
    ("deadline", "start", "expected"),
    [
        (None, "2026-01-01T00:00:00Z", None),
        (60, None, None),
        (60, "2026-01-01T00:00:00Z", 50.0),
        (10, "2026-01-01T00:00:00Z", 0.0),
        (5, "2026-01-01T00:00:00Z", -5.0),
    ],
)
def test_deadline_left(deadline: int | None, start: str | None, expected: float | None) -> None:
    spec = _spec(activeDeadlineSeconds=deadline) if deadline else _spec()
    assert running.deadline_left(spec, start, T0 + timedelta(seconds=10)) == expected


@pytest.mark.parametrize(
    ("changes", "attempt", "done"),
    [
        ({}, 0, None),
        ({"trainer_0": {"phase": S}}, 0, "j-trainer-0"),
        ({"trainer_1": {"phase": S}}, 0, None),  # a rank > 0 exiting first is not the end
        ({"trainer_0": {"phase": S, "attempt": 0}}, 1, None),  # of an earlier attempt
        ({"trainer_0": {"phase": F}}, 0, None),
    ],
)
def test_succeeded_rank0(changes: dict[str, Any], attempt: int, done: str | None) -> None:
    spec = _spec()
    gang = running.gang_of(spec, Observed(pods=_pods(spec, attempt, **changes)), attempt)
    found = running.succeeded_rank0(gang)
    assert (found.name if found else None) == done


@pytest.mark.parametrize(
    ("changes", "phase", "restarts", "failed", "lost", "outcome"),
    [
        ({}, Phase.running, 0, [], [], None),
        (
            {"trainer_1": {"phase": F, "reason": "OOMKilled"}},
            Phase.running,
            0,
            ["j-trainer-1"],
            [],
            GangOutcome.restart,
        ),
        ({"trainer_1": {"phase": F}}, Phase.running, 2, ["j-trainer-1"], [], GangOutcome.failed),
        (
            {"trainer_0": {"phase": F, "disruption": "Evicted"}},
            Phase.running,
            2,
            ["j-trainer-0"],
            [],
            GangOutcome.disrupted,
        ),
        ({"trainer_1": None}, Phase.running, 0, [], ["j-trainer-1"], GangOutcome.restart),
        ({"trainer_1": {"deleting": True}}, Phase.initializing, 0, [], ["j-trainer-1"], GangOutcome.restart),
        ({"trainer_1": None}, Phase.pending, 0, [], [], None),  # not created yet
        ({"rollout_0": {"phase": F}}, Phase.running, 0, [], [], None),  # servers are replaced alone
    ],
)
def test_check_gang(
    changes: dict[str, Any],
    phase: Phase,
    restarts: int,
    failed: list[str],
    lost: list[str],
    outcome: GangOutcome | None,
) -> None:
    spec = _spec()
    observed = _observed(spec, **changes)
    status = DistillationJobStatus(phase=phase, restarts=restarts)
    check = running.check_gang(JOB, spec, observed, running.gang_of(spec, observed, 0), status)
    assert [q.name for q in check.failed] == failed and check.lost == lost
    assert (check.decision.outcome if check.decision else None) is outcome


def _gone(attempt: int) -> PodView:
    return PodView("j-trainer-1", Role.trainer, 1, attempt=attempt, disruption="PreemptionByScheduler")


def test_a_vanished_trainer_carries_the_disruption_seen_for_its_attempt() -> None:
    spec = _spec()
    pods = _pods(spec, trainer_1=None)
    for attempt, expected in ((0, GangOutcome.disrupted), (1, GangOutcome.restart)):
        observed = Observed(pods=pods, disrupted={"j-trainer-1": _gone(attempt)})
        check = running.check_gang(
            JOB, spec, observed, running.gang_of(spec, observed, 0), DistillationJobStatus(phase=Phase.running)
        )
        assert check.decision is not None and check.decision.outcome is expected


@pytest.mark.parametrize(
    ("replicas", "changes", "deleting", "expected"),
    [
        (2, {}, set(), []),
        (2, {"rollout_1": {"phase": F, "reason": "Error"}}, set(), [("j-rollout-1", "ServerReplaced")]),
        (2, {"teacher_math_0": {"phase": F}}, set(), [("j-teacher-math-0", "ServerReplaced")]),
        (1, {"rollout_1": {"phase": F}}, set(), [("j-rollout-1", "RolloutScaled")]),  # surplus: not replaced
        (2, {"trainer_0": {"phase": F}}, set(), []),  # the gang's business
        (2, {"rollout_1": {"phase": F}}, {"j-rollout-1"}, []),  # already being deleted
    ],
)
def test_replacements(
    replicas: int, changes: dict[str, Any], deleting: set[str], expected: list[tuple[str, str]]
) -> None:
    spec = _spec()
    live = list(_pods(spec, **changes).values())
    out = running.replacements(_spec(rollout={"replicas": replicas}), live, {ChildRef("Pod", n) for n in deleting})
    assert [(ref.name, event.reason) for ref, event in out] == expected


def _url(replica: int) -> str:
    from kubedistill.operator.render import PodSlot

    return server_url(JOB, NS, PodSlot(Role.rollout, replica))


@pytest.mark.parametrize(
    ("trainer", "held", "start", "deleted", "start_after", "wake"),
    [
        (R, None, None, [], "2026-01-01T00:00:00Z", 600.0),  # the deadline (the sync timeout) starts now
        (R, None, "2025-12-31T23:58:00Z", [], "2025-12-31T23:58:00Z", 480.0),
        (R, None, "2025-12-31T23:50:00Z", ["j-rollout-1"], "2025-12-31T23:50:00Z", None),  # passed
        (R, (_url(0), _url(1)), None, [], "2026-01-01T00:00:00Z", 600.0),  # still held
        (R, (_url(0),), None, ["j-rollout-1"], "2026-01-01T00:00:00Z", None),  # drained
        (P, None, None, ["j-rollout-1"], "2026-01-01T00:00:00Z", None),  # no trainer to wait for
    ],
)
def test_drain(
    trainer: PodPhase,
    held: tuple[str, ...] | None,
    start: str | None,
    deleted: list[str],
    start_after: str,
    wake: float | None,
) -> None:
    spec = _spec(rollout={"replicas": 1})
    pods = _pods(_spec(), trainer_0={"phase": trainer})
    gang = running.gang_of(spec, Observed(pods=pods), 0)
    d = running.drain(JOB, NS, spec, gang, held, start, set(), T0)
    assert [c.name for c in d.delete] == deleted and [e.reason for e in d.events] == ["RolloutScaled"] * len(deleted)
    assert (d.start_time, d.wake_after) == (start_after, wake)


def test_drain_without_surplus_clears_the_start_time() -> None:
    spec = _spec()
    gang = running.gang_of(spec, _observed(spec), 0)
    assert running.drain(JOB, NS, spec, gang, None, "2026-01-01T00:00:00Z", set(), T0) == running.Drain(
        [], [], None, None
    )


@pytest.mark.parametrize(
    ("gang_scheduler", "changes", "stale_attempt", "group", "expected"),
    [
        ("none", {}, False, False, []),
        ("none", {"rollout_1": None, "trainer_1": None}, False, False, ["j-trainer-1", "j-rollout-1"]),
        ("none", {"rollout_1": None, "trainer_1": None}, True, False, ["j-rollout-1"]),  # old gang still there
        ("none", {"trainer_0": {"deleting": True}, "trainer_1": None}, False, False, []),  # a member still terminating
        ("volcano", {"rollout_1": None}, False, False, []),  # waits for its PodGroup
        ("volcano", {"rollout_1": None}, False, True, ["j-rollout-1"]),
        ("kueue", {"rollout_1": None}, True, False, []),  # with Kueue every pod is of the gang
    ],
)
def test_creates(
    gang_scheduler: str, changes: dict[str, Any], stale_attempt: bool, group: bool, expected: list[str]
) -> None:
    queue = {"queue": "research"} if gang_scheduler == "kueue" else {}
    spec = _spec(scheduling={"gangScheduler": gang_scheduler, **queue})
    pods = _pods(spec, **changes)
    if stale_attempt:
        pods = {n: PodView(**{**q.__dict__, "attempt": 5}) if q.role is Role.trainer else q for n, q in pods.items()}
        if gang_scheduler == "kueue":
            pods = {n: PodView(**{**q.__dict__, "attempt": 5}) for n, q in pods.items()}
    others = {ChildRef("PodGroup", JOB)} if group else set()
    observed = Observed(pods=pods, others=others)
    gone = running.gang_gone(spec, observed, running.gang_of(spec, observed, 0))
    made = running.creates(JOB, NS, spec, observed, 0, gone)
    assert [o["metadata"]["name"] for o in made] == expected
    assert all(o["metadata"]["labels"].get("kubedistill.io/attempt", "0") == "0" for o in made)


@pytest.mark.parametrize(
    ("changes", "previous", "restarting", "expected"),
    [
        ({}, Phase.pending, False, Phase.running),
        ({}, Phase.running, True, Phase.restarting),
        ({"rollout_0": {"ready": False}}, Phase.pending, False, Phase.initializing),
        ({"rollout_0": {"phase": P, "ready": False}}, Phase.pending, False, Phase.pending),
        ({"rollout_0": None}, Phase.running, False, Phase.running),  # replaced while rollout-1 serves
        ({"rollout_0": None, "rollout_1": {"ready": False}}, Phase.running, False, Phase.pending),
        ({"trainer_1": {"phase": S, "ready": False}}, Phase.running, False, Phase.running),  # ranks exiting
        ({"trainer_1": {"phase": P, "ready": False}}, Phase.restarting, False, Phase.restarting),
        ({}, Phase.restarting, False, Phase.running),  # the new gang runs
    ],
)
def test_next_phase(changes: dict[str, Any], previous: Phase, restarting: bool, expected: Phase) -> None:
    spec = _spec()
    assert running.next_phase(JOB, spec, _observed(spec, **changes), 0, previous, restarting) is expected
