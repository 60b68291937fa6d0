"""The operator's reconcile decisions (pure: job + observed children + time -> plan)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from kubedistill.api.roleconfig import Role
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.api.status import ConditionStatus, ConditionType, Phase
from kubedistill.operator.observed import ChildRef, ChildView, Observed, PodPhase, PodView, condition
from kubedistill.operator.policy import (
    JobView,
    Plan,
    Refusal,
    TrainerReport,
    create_backoff,
    is_refusal,
    plan,
    refusal_reason,
)
from kubedistill.operator.render import (
    PodSlot,
    content_digest,
    render_kept_current,
    render_static,
    server_url,
    slots,
)
from kubedistill.operator.running import ROLLOUT_DRAIN_SECONDS, rollout_drain_seconds
from operator_fixtures import BASE_SPEC

T0 = datetime(2026, 1, 1, tzinfo=UTC)
JOB = "j"
NS = "ml"


def _job(status: dict[str, Any] | None = None, **spec_overrides: Any) -> JobView:
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(spec_overrides)
    return JobView(name=JOB, namespace=NS, generation=3, spec=spec, status=status or {})


def _spec(job: JobView) -> DistillationJobSpec:
    return DistillationJobSpec.model_validate(dict(job.spec))


def _world(job: JobView, phase: PodPhase = PodPhase.running, ready: bool = True, attempt: int = 0) -> Observed:
    """Every child present, every pod in `phase`."""
    spec = _spec(job)
    others = {ChildRef(o["kind"], o["metadata"]["name"]) for o in render_static(JOB, NS, spec)}
    pods = {}
    for s in slots(spec):
        name = s.pod_name(JOB)
        pods[name] = PodView(
            name=name,
            role=s.role,
            replica=s.replica,
            teacher=s.teacher,
            attempt=attempt if s.role is Role.trainer else None,
            phase=phase,
            ready=ready and phase is PodPhase.running,
        )
    return Observed(pods=pods, others=others)


def _with(observed: Observed, name: str, **changes: Any) -> Observed:
    pods = dict(observed.pods)
    old = pods[name]
    pods[name] = PodView(**{**old.__dict__, **changes})
    return Observed(pods=pods, others=set(observed.others))


def _next(job: JobView, p: Plan) -> JobView:
    from kubedistill.operator.observed import status_patch

    return JobView(job.name, job.namespace, job.generation, job.spec, status_patch(p.status))


def _deleted_pods(p: Plan) -> set[str]:
    return {c.name for c in p.delete if c.kind == "Pod"}


def test_first_pass_creates_every_child_and_stays_pending() -> None:
    job = _job()
    p = plan(job, Observed(), T0)
    kinds = sorted(o["kind"] for o in p.create)
    assert kinds == sorted(
        ["ConfigMap", "Service", "Service", "Service", "NetworkPolicy", "PersistentVolumeClaim"] + ["Pod"] * 5
    )
    assert p.status.phase is Phase.pending
    assert p.status.start_time == "2026-01-01T00:00:00Z"
    assert p.status.observed_generation == 3
    assert p.status.roles["trainer"].desired == 2 and p.status.roles["teacher/math"].desired == 1
    assert condition(p.status, ConditionType.created).status is ConditionStatus.false


def test_the_children_a_pass_writes_are_observed_as_written_and_their_echoes_show_nothing_new() -> None:
    job = _job()
    p = plan(job, Observed(), T0)
    written = Observed()
    for obj in p.create:
        written.add(obj["kind"], obj)
    # The next pass plans from them: nothing left to create, every child counted as created.
    again = plan(_next(job, p), written, T0)
    assert again.create == []
    assert condition(again.status, ConditionType.created).status is ConditionStatus.true
    # The API server's answer and watch event add a uid, a phase Pending and the like: no news.
    for obj in p.create:
        echo = {**copy.deepcopy(obj), "status": {"phase": "Pending", "qosClass": "Burstable"}}
        echo["metadata"]["uid"] = "u-" + obj["metadata"]["name"]
        kind = obj["kind"]
        assert written.shows(PodView.of(echo) if kind == "Pod" else ChildView.of(kind, echo)), obj["metadata"]["name"]
    # A pod that changed, a config whose content changed, a child never written: news.
    pod = next(o for o in p.create if o["kind"] == "Pod")
    assert not written.shows(PodView.of({**pod, "status": {"phase": "Running"}}))
    config = next(o for o in p.create if o["kind"] == "ConfigMap")
    assert not written.shows(ChildView.of("ConfigMap", {**config, "data": {"config.json": "{}"}}))
    assert not written.shows(ChildView(ChildRef("Service", "someone-else")))
    assert not written.shows(replace(PodView.of(pod), name="j-rollout-9"))


def test_phases_pending_initializing_running_with_events() -> None:
    job = _job({"phase": "Pending", "startTime": "2026-01-01T00:00:00Z"})
    p = plan(job, _world(job, PodPhase.running, ready=False), T0)
    assert p.create == [] and p.status.phase is Phase.initializing
    assert [(e.type, e.reason) for e in p.events] == [("Normal", "Initializing")]
    p2 = plan(_next(job, p), _world(job, PodPhase.running, ready=True), T0 + timedelta(seconds=5))
    assert p2.status.phase is Phase.running
    assert p2.status.ready.trainer == "2/2" and p2.status.ready.rollout == "2/2" and p2.status.ready.teachers == "1/1"
    ready = condition(p2.status, ConditionType.ready)
    assert ready.status is ConditionStatus.true and ready.last_transition_time == "2026-01-01T00:00:05Z"
    assert condition(p2.status, ConditionType.created).status is ConditionStatus.true
    # Nothing changes: the same plan, no events, transition times kept.
    p3 = plan(_next(job, p2), _world(job, PodPhase.running, ready=True), T0 + timedelta(seconds=9))
    assert p3.events == [] and p3.create == [] and p3.delete == []
    assert condition(p3.status, ConditionType.ready).last_transition_time == "2026-01-01T00:00:05Z"


def test_failed_server_pod_is_replaced_alone() -> None:
    job = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    world = _with(_world(job), "j-rollout-1", phase=PodPhase.failed, ready=False, reason="OOMKilled, exit code 137")
    p = plan(job, world, T0)
    assert _deleted_pods(p) == {"j-rollout-1"}
    assert p.status.restarts == 0
    # The job stays Running: rollout-0 still serves, and the trainer goes on with it.
    assert [e.reason for e in p.events] == ["ServerReplaced"] and p.status.phase is Phase.running
    assert "OOMKilled" in p.events[0].message
    # Once it is gone, it alone is recreated.
    del world.pods["j-rollout-1"]
    p2 = plan(_next(job, p), world, T0)
    assert [o["metadata"]["name"] for o in p2.create] == ["j-rollout-1"]
    assert p2.status.phase is Phase.running
    # With no rollout pod ready, the job is no longer Running while they come back.
    world = _with(world, "j-rollout-0", phase=PodPhase.failed, ready=False)
    p3 = plan(_next(job, p2), world, T0)
    assert p3.status.phase is Phase.pending and [e.reason for e in p3.events] == ["ServerReplaced", "Pending"]


def test_failed_trainer_restarts_the_gang_then_recreates_with_next_attempt() -> None:
    job = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    world = _with(_world(job), "j-trainer-1", phase=PodPhase.failed, ready=False)
    p = plan(job, world, T0)
    assert _deleted_pods(p) == {"j-trainer-0", "j-trainer-1"}
    assert p.status.restarts == 1 and p.status.phase is Phase.restarting
    assert any(e.reason == "GangRestart" and e.type == "Warning" for e in p.events)
    # The old gang is gone: new trainer pods with attempt 1.
    for n in ("j-trainer-0", "j-trainer-1"):
        del world.pods[n]
    p2 = plan(_next(job, p), world, T0)
    created = {o["metadata"]["name"]: o for o in p2.create}
    assert set(created) == {"j-trainer-0", "j-trainer-1"}
    assert {o["metadata"]["labels"]["kubedistill.io/attempt"] for o in created.values()} == {"1"}
    assert p2.status.phase is Phase.restarting
    # Running again -> phase Running.
    p3 = plan(_next(job, p2), _world(job, attempt=1), T0)
    assert p3.status.phase is Phase.running and p3.status.restarts == 1


def test_a_vanished_trainer_pod_of_a_running_job_restarts_the_gang() -> None:
    job = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    world = _world(job)
    del world.pods["j-trainer-1"]
    p = plan(job, world, T0)
    assert _deleted_pods(p) == {"j-trainer-0"}
    assert not any(o["kind"] == "Pod" for o in p.create)
    assert p.status.restarts == 1 and p.status.phase is Phase.restarting
    restart = next(e for e in p.events if e.reason == "GangRestart")
    assert restart.type == "Warning" and "j-trainer-1 is gone" in restart.message
    # Once rank 0 is gone too, the whole gang comes back with the next attempt, servers untouched.
    del world.pods["j-trainer-0"]
    p2 = plan(_next(job, p), world, T0)
    assert {o["metadata"]["name"]: o["metadata"]["labels"]["kubedistill.io/attempt"] for o in p2.create} == {
        "j-trainer-0": "1",
        "j-trainer-1": "1",
    }
    assert p2.delete == [] and p2.status.restarts == 1 and p2.status.phase is Phase.restarting


def test_a_trainer_pod_being_deleted_counts_as_lost_and_a_single_trainer_restarts_alone() -> None:
    job = _job(
        {"phase": "Initializing", "startTime": "2026-01-01T00:00:00Z"}, trainer={"replicas": 1, "miniBatchSize": 4}
    )
    world = _with(_world(job, ready=False), "j-trainer-0", deleting=True)
    p = plan(job, world, T0)
    assert p.status.restarts == 1 and p.status.phase is Phase.restarting
    assert not any(o["kind"] == "Pod" for o in p.create)  # it still terminates
    del world.pods["j-trainer-0"]
    p2 = plan(_next(job, p), world, T0)
    assert [(o["metadata"]["name"], o["metadata"]["labels"]["kubedistill.io/attempt"]) for o in p2.create] == [
        ("j-trainer-0", "1")
    ]


def test_a_trainer_pod_missing_before_the_gang_started_is_just_created() -> None:
    job = _job({"phase": "Pending", "startTime": "2026-01-01T00:00:00Z"})
    world = _world(job, phase=PodPhase.pending, ready=False)
    del world.pods["j-trainer-1"]
    p = plan(job, world, T0)
    assert [o["metadata"]["name"] for o in p.create] == ["j-trainer-1"]
    assert p.delete == [] and p.status.restarts == 0 and p.events == []


def test_a_vanished_trainer_pod_after_the_last_restart_fails_the_job() -> None:
    job = _job({"phase": "Running", "restarts": 1, "startTime": "2026-01-01T00:00:00Z"}, backoffLimit=1)
    world = _world(job, attempt=1)
    del world.pods["j-trainer-0"]
    p = plan(job, world, T0)
    assert p.status.phase is Phase.failed
    failed = condition(p.status, ConditionType.failed)
    assert failed.reason == "BackoffLimitExceeded" and "j-trainer-0 is gone" in failed.message
    assert p.create == []


def test_old_gang_pods_are_deleted_and_block_the_new_gang() -> None:
    job = _job({"phase": "Restarting", "restarts": 1, "startTime": "2026-01-01T00:00:00Z"})
    world = _world(job, attempt=0)
    p = plan(job, world, T0)
    assert _deleted_pods(p) == {"j-trainer-0", "j-trainer-1"}
    assert not any(o["kind"] == "Pod" for o in p.create)
    assert p.status.phase is Phase.restarting


def test_backoff_limit_exhausted_fails_the_job() -> None:
    job = _job({"phase": "Running", "restarts": 2, "startTime": "2026-01-01T00:00:00Z"}, backoffLimit=2)
    world = _with(_world(job, attempt=2), "j-trainer-0", phase=PodPhase.failed, ready=False)
    p = plan(job, world, T0)
    assert p.status.phase is Phase.failed and p.status.completion_time == "2026-01-01T00:00:00Z"
    failed = condition(p.status, ConditionType.failed)
    assert failed.status is ConditionStatus.true and failed.reason == "BackoffLimitExceeded"
    # The failed pod stays for its logs; everything still running goes.
    assert "j-trainer-0" not in _deleted_pods(p) and "j-rollout-0" in _deleted_pods(p)
    assert p.create == []


def test_the_trainers_termination_message_gives_the_job_its_last_step_and_evaluation() -> None:
    """The trainer exits right after its last step, before the operator's next GET /status: its
    final /status reaches the job through the pod's termination message (found on a real kubelet,
    tests/test_real_node.py, where the status kept the evaluation of step 30 of 60)."""
    from kubedistill.api.progress import TrainerProgress, termination_message
    from kubedistill.api.status import HeldOutEvaluation, HeldOutSource

    job = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    total = _spec(job).trainer.total_steps
    final = TrainerProgress(step=total, total_steps=total, weight_version=total, last_checkpoint=f"/ckpt/step-{total}")
    final.evaluation = HeldOutEvaluation(
        step=total, weight_version=total, score=0.6, sources={"math": HeldOutSource(score=0.6)}
    )
    done = _with(_world(job), "j-trainer-0", phase=PodPhase.succeeded, termination_message=termination_message(final))
    early = HeldOutEvaluation(step=30, weight_version=30, score=0.2, sources={"math": HeldOutSource(score=0.2)})
    stale = TrainerReport(step=30, weight_version=30, last_checkpoint="/ckpt/step-30", evaluation=early)
    p = plan(job, done, T0, stale)
    assert p.status.phase is Phase.succeeded
    assert (p.status.step, p.status.last_checkpoint) == (total, f"/ckpt/step-{total}")
    assert p.status.evaluation is not None and (p.status.evaluation.step, p.status.evaluation.score) == (total, 0.6)
    assert ("Normal", "Evaluated") in [(e.type, e.reason) for e in p.events]
    # Later passes keep it: the last poll (step 30) must not take the finished job back.
    again = plan(_next(job, p), done, T0 + timedelta(seconds=5), stale)
    assert (again.status.step, again.status.evaluation) == (total, p.status.evaluation) and not again.events
    # Not ours, or none at all: the job still succeeds on what it saw.
    for message in ("", "OOM", '{"step": "x"}'):
        other = plan(job, _with(_world(job), "j-trainer-0", phase=PodPhase.succeeded, termination_message=message), T0)
        assert other.status.phase is Phase.succeeded and other.status.step == total


def test_a_termination_message_fits_the_kubelets_limit_dropping_the_least_needed_first() -> None:
    from kubedistill.api.progress import TrainerProgress, termination_message
    from kubedistill.api.status import HeldOutEvaluation, HeldOutSource

    final = TrainerProgress(step=7, weight_version=7, rollout_servers=["http://r-0:8000"] * 50)
    final.evaluation = HeldOutEvaluation(
        step=7, score=0.5, sources={f"s{i}": HeldOutSource(score=0.5) for i in range(80)}
    )
    full = termination_message(final, limit=100_000)
    assert json.loads(full)["rolloutServers"] and len(json.loads(full)["evaluation"]["sources"]) == 80
    for limit in (4096, 700, 60):
        text = termination_message(final, limit=limit)
        assert len(text.encode()) <= limit, (limit, len(text))
        doc = json.loads(text)
        assert (doc["step"], doc["weightVersion"]) == (7, 7)
    assert json.loads(termination_message(final, limit=4096))["evaluation"]["score"] == 0.5


def test_trainer_rank0_success_completes_the_job_and_deletes_servers() -> None:
    job = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"}, ttlSecondsAfterFinished=60)
    world = _with(_with(_world(job), "j-trainer-0", phase=PodPhase.succeeded), "j-trainer-1", phase=PodPhase.succeeded)
    p = plan(job, world, T0, TrainerReport(step=100, weight_version=100, last_checkpoint="/ckpt/step-100"))
    assert p.status.phase is Phase.succeeded
    assert _deleted_pods(p) == {"j-rollout-0", "j-rollout-1", "j-teacher-math-0"}
    assert (p.status.step, p.status.weight_version, p.status.last_checkpoint) == (100, 100, "/ckpt/step-100")
    assert [(e.type, e.reason) for e in p.events] == [("Normal", "TrainerSucceeded")]
    assert p.wake_after == 60
    # A final /status the operator never saw: success means every step was trained.
    late = plan(job, world, T0, TrainerReport(step=96, weight_version=96, last_checkpoint="/ckpt/step-90"))
    assert late.status.step == _spec(job).trainer.total_steps
    # TTL: later, the job itself goes.
    done = _next(job, p)
    assert not plan(done, world, T0 + timedelta(seconds=30)).delete_job
    assert plan(done, world, T0 + timedelta(seconds=61)).delete_job


def test_a_rank_that_exits_before_rank0_keeps_the_job_running() -> None:
    job = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    world = _with(_world(job), "j-trainer-1", phase=PodPhase.succeeded, ready=False)
    p = plan(job, world, T0)
    assert p.status.phase is Phase.running and p.events == [] and p.delete == [] and p.create == []
    # Before the job ran, a finished rank does not make it Running.
    pending = _job({"phase": "Initializing", "startTime": "2026-01-01T00:00:00Z"})
    assert plan(pending, world, T0).status.phase is not Phase.running


def test_suspend_deletes_pods_and_resume_recreates_them() -> None:
    job = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"}, suspend=True)
    p = plan(job, _world(job), T0)
    assert _deleted_pods(p) == set(_world(job).pods)
    assert p.status.phase is Phase.suspended and p.status.start_time is None
    assert condition(p.status, ConditionType.suspended).status is ConditionStatus.true
    resumed = JobView(JOB, NS, 4, {**job.spec, "suspend": False}, _next(job, p).status)
    world = _world(job)
    world.pods.clear()
    p2 = plan(resumed, world, T0 + timedelta(seconds=10))
    assert len([o for o in p2.create if o["kind"] == "Pod"]) == 5
    assert p2.status.phase is Phase.pending and p2.status.start_time == "2026-01-01T00:00:10Z"
    assert condition(p2.status, ConditionType.suspended).status is ConditionStatus.false


def test_active_deadline_fails_the_job() -> None:
    job = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"}, activeDeadlineSeconds=100)
    early = plan(job, _world(job), T0 + timedelta(seconds=40))
    assert early.status.phase is Phase.running and early.wake_after == 60
    late = plan(job, _world(job), T0 + timedelta(seconds=100))
    assert late.status.phase is Phase.failed
    assert condition(late.status, ConditionType.failed).reason == "DeadlineExceeded"


def test_a_spec_that_slipped_past_the_crd_fails_with_the_field_named() -> None:
    job = _job({}, trainer={"replicas": 1, "miniBatchSize": 3}, rollout={"sampling": {"samplesPerPrompt": 2}})
    p = plan(job, Observed(), T0)
    assert p.create == []
    assert p.status.phase is Phase.failed
    failed = condition(p.status, ConditionType.failed)
    assert failed.reason == "InvalidSpec" and "spec.trainer.miniBatchSize" in failed.message
    assert [e.reason for e in p.events] == ["InvalidSpec"]
    # Later passes do not repeat the event.
    assert plan(_next(job, p), Observed(), T0).events == []


def test_a_missing_child_is_recreated() -> None:
    job = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    world = _world(job)
    world.others.discard(ChildRef("Service", "j-rollout"))
    del world.pods["j-teacher-math-0"]
    p = plan(job, world, T0)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in p.create) == [
        ("Pod", "j-teacher-math-0"),
        ("Service", "j-rollout"),
    ]


def test_per_job_gauges_follow_status_and_vanish_with_the_job() -> None:
    from kubedistill.api.status import DistillationJobStatus, RoleStatus
    from kubedistill.operator.metrics import OperatorMetrics

    m = OperatorMetrics()
    status = DistillationJobStatus(
        restarts=2, roles={"trainer": RoleStatus(desired=2, ready=1), "teacher/math": RoleStatus(desired=1, ready=1)}
    )
    m.job_phase("ns", "j", Phase.running)
    m.job_status("ns", "j", status)
    get = m.registry.get_sample_value
    assert get("kubedistill_operator_role_ready", {"namespace": "ns", "job": "j", "role": "trainer"}) == 1
    assert get("kubedistill_operator_role_ready", {"namespace": "ns", "job": "j", "role": "teacher/math"}) == 1
    assert get("kubedistill_operator_job_restarts", {"namespace": "ns", "job": "j"}) == 2
    m.job_phase("ns", "j", None)
    assert get("kubedistill_operator_role_ready", {"namespace": "ns", "job": "j", "role": "trainer"}) is None
    assert get("kubedistill_operator_job_restarts", {"namespace": "ns", "job": "j"}) is None


PSA = 'pods "j-trainer-0" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false'


def test_a_refused_child_blocks_the_job_waits_for_its_backoff_and_then_is_created_again() -> None:
    job = _job()
    world = _world(job)
    world = Observed(pods={n: q for n, q in world.pods.items() if n != "j-trainer-0"}, others=world.others)
    refused = {("Pod", "j-trainer-0"): Refusal("PodSecurity", PSA, attempts=2, retry_at=T0 + timedelta(seconds=4))}

    p = plan(job, world, T0, refusals=refused)
    assert p.create == [] and p.wake_after == 4.0  # held back until its backoff ends
    assert p.status.phase is Phase.blocked
    assert p.status.message == f"creating Pod j-trainer-0 was refused: {PSA}"
    created = condition(p.status, ConditionType.created)
    assert created.status is ConditionStatus.false
    assert (created.reason, created.message) == ("PodSecurity", p.status.message)
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "Blocked")] and PSA in p.events[0].message

    later = plan(_next(job, p), world, T0 + timedelta(seconds=4), refusals=refused)
    assert [o["metadata"]["name"] for o in later.create] == ["j-trainer-0"]  # due: try again
    assert later.status.phase is Phase.blocked and later.events == []  # still Blocked until it is made

    # Made at last: the job goes on and says nothing of the refusal any more.
    recovered = plan(_next(job, later), _world(job, phase=PodPhase.pending, ready=False), T0 + timedelta(seconds=5))
    assert recovered.status.phase is Phase.pending and recovered.status.message == ""
    assert condition(recovered.status, ConditionType.created).status is ConditionStatus.true


def test_refusal_reasons_and_backoff() -> None:
    assert refusal_reason(403, PSA) == "PodSecurity"
    assert (
        refusal_reason(403, 'pods "x" is forbidden: exceeded quota: gpu, requested: nvidia.com/gpu=1')
        == "QuotaExceeded"
    )
    # kube-apiserver 1.36's answer to a pod without requests in a namespace with a requests.cpu quota.
    assert (
        refusal_reason(403, 'pods "x" is forbidden: failed quota: q: must specify requests.cpu for: kubedistill')
        == "QuotaRequiresResources"
    )
    assert refusal_reason(400, 'admission webhook "v.kyverno.io" denied the request: no') == "AdmissionWebhookDenied"
    assert refusal_reason(422, "Pod is invalid: spec.affinity") == "Invalid"
    prio = 'pods "x" is forbidden: no PriorityClass with name training was found'
    assert refusal_reason(403, prio) == "PriorityClassNotFound"
    assert refusal_reason(403, "forbidden: User cannot create") == "Forbidden"
    assert [is_refusal(s) for s in (400, 403, 404, 409, 422, 429, 500, 0)] == [
        True,
        True,
        True,
        False,
        True,
        False,
        False,
        False,
    ]
    assert [create_backoff(n, 2.0, 30.0) for n in (1, 2, 3, 4, 5, 6, 10_000)] == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


# --- live rollout scaling -------------------------------------------------------------------------


def _url(replica: int) -> str:
    return server_url(JOB, NS, PodSlot(Role.rollout, replica))


def _scaled_down(status: dict[str, Any] | None = None) -> tuple[JobView, Observed]:
    """A Running job with 2 rollout pods whose spec now asks for 1."""
    before = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    running = _next(before, plan(before, _world(before), T0))
    assert running.status["roles"]["rollout"]["desired"] == 2
    job = _job(status or dict(running.status), rollout={"replicas": 1})
    return job, _world(before)


def test_a_scale_down_keeps_the_surplus_pod_until_the_drain_deadline() -> None:
    job, world = _scaled_down()
    held = TrainerReport(step=4, weight_version=4, last_checkpoint=None, rollout_servers=(_url(0), _url(1)), attempt=0)
    p = plan(job, world, T0, held)
    assert p.delete == [] and p.create == [] and p.status.phase is Phase.running
    assert [(e.type, e.reason) for e in p.events] == [("Normal", "RolloutScaled")]
    assert "spec.rollout.replicas 2 -> 1: draining rollout pod(s) j-rollout-1" in p.events[0].message
    assert p.status.rollout_drain_start_time == "2026-01-01T00:00:00Z"
    drain = rollout_drain_seconds(_spec(job))
    assert drain == max(ROLLOUT_DRAIN_SECONDS, 600) and p.wake_after == drain
    # The surplus pod is neither missing nor extra in the status; it still counts as a replica.
    assert p.status.roles["rollout"].desired == 1 and p.status.ready.rollout == "1/1"
    assert p.status.rollout_replicas == 2
    assert p.status.rollout_selector == "kubedistill.io/job=j,kubedistill.io/role=rollout"
    assert condition(p.status, ConditionType.ready).status is ConditionStatus.true
    # The ConfigMap the world holds was rendered for 2 replicas.
    world.digests[ChildRef("ConfigMap", "j-config")] = "rendered-for-2"
    p = plan(job, world, T0, held)
    assert [o["metadata"]["name"] for o in p.update] == ["j-config"]
    assert json.loads(p.update[0]["data"]["config.json"])["endpoints"]["rollout"] == [_url(0)]

    later = _next(job, p)
    p = plan(later, world, T0 + timedelta(seconds=drain - 1), held)
    assert p.delete == [] and p.events == [] and p.wake_after == 1
    p = plan(later, world, T0 + timedelta(seconds=drain), held)
    assert _deleted_pods(p) == {"j-rollout-1"} and p.status.restarts == 0 and p.status.disruptions == 0
    (event,) = p.events
    assert event.reason == "RolloutScaled" and "drain deadline" in event.message
    assert p.create == []  # a surplus pod is never recreated
    del world.pods["j-rollout-1"]
    p = plan(_next(later, p), world, T0 + timedelta(seconds=drain + 1), held)
    assert p.create == [] and p.delete == [] and p.status.rollout_drain_start_time is None
    assert p.status.rollout_replicas == 1


def test_the_trainers_report_lets_a_surplus_pod_go_only_for_the_current_attempt() -> None:
    job, world = _scaled_down()
    released = TrainerReport(step=4, weight_version=4, last_checkpoint=None, rollout_servers=(_url(0),), attempt=0)
    assert _deleted_pods(plan(job, world, T0, released)) == {"j-rollout-1"}
    # The same report from an earlier gang attempt, or no report at all: wait.
    for progress in (replace(released, attempt=None), None, replace(released, rollout_servers=None)):
        assert plan(job, world, T0, progress).delete == [], progress
    # A URL as the trainer may write it (trailing slash) is the same server.
    held = replace(released, rollout_servers=(_url(0) + "/", _url(1) + "/"))
    assert plan(job, world, T0, TrainerReport.of({**_status_doc(held)}, attempt=0)).delete == []


def _status_doc(progress: TrainerReport) -> dict[str, Any]:
    return {
        "step": progress.step,
        "weightVersion": progress.weight_version,
        "rolloutServers": list(progress.rollout_servers or ()),
    }


def test_a_surplus_pod_goes_at_once_when_the_trainer_is_not_running() -> None:
    job, world = _scaled_down()
    world = _with(world, "j-trainer-0", phase=PodPhase.pending, ready=False)
    held = TrainerReport(step=4, weight_version=4, last_checkpoint=None, rollout_servers=(_url(0), _url(1)), attempt=0)
    p = plan(job, world, T0, held)
    assert _deleted_pods(p) == {"j-rollout-1"} and p.status.restarts == 0
    assert any("the trainer is not running" in e.message for e in p.events)


def test_a_scale_up_creates_the_new_rollout_pods_and_updates_the_config() -> None:
    before = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    running = _next(before, plan(before, _world(before), T0))
    job = _job(dict(running.status), rollout={"replicas": 4})
    world = _world(before)
    world.digests[ChildRef("ConfigMap", "j-config")] = "rendered-for-2"
    p = plan(job, world, T0)
    assert [o["metadata"]["name"] for o in p.create] == ["j-rollout-2", "j-rollout-3"]
    assert [o["metadata"]["name"] for o in p.update] == ["j-config"] and p.delete == []
    assert p.status.restarts == 0 and p.status.disruptions == 0
    (event,) = [e for e in p.events if e.reason == "RolloutScaled"]
    assert "2 -> 4: creating rollout pod(s) j-rollout-2, j-rollout-3" in event.message


def _as_rendered(world: Observed, job: JobView) -> None:
    """The world's ConfigMap and PodGroup hold what `job` renders."""
    for o in render_kept_current(JOB, NS, _spec(job)):
        world.digests[ChildRef(o["kind"], o["metadata"]["name"])] = content_digest(o["kind"], o)


def test_the_pod_group_follows_the_pod_count_unless_min_member_is_set() -> None:
    spec = {"gangScheduler": "volcano"}
    before = _job({"phase": "Running"}, scheduling=spec)
    world = _world(before)
    world.others.add(ChildRef("PodGroup", "j"))
    _as_rendered(world, before)
    assert plan(before, world, T0).update == []
    p = plan(_job({"phase": "Running"}, scheduling=spec, rollout={"replicas": 3}), world, T0)
    assert {o["kind"]: o for o in p.update}["PodGroup"]["spec"]["minMember"] == 6
    # An explicit minMember (and no resources on cpu) leaves the PodGroup as it is.
    fixed = {"gangScheduler": "volcano", "minMember": 3}
    before = _job({"phase": "Running"}, scheduling=fixed)
    _as_rendered(world, before)
    p = plan(_job({"phase": "Running"}, scheduling=fixed, rollout={"replicas": 3}), world, T0)
    assert [o["kind"] for o in p.update] == ["ConfigMap"]


def test_a_pod_that_cannot_get_its_image_blocks_the_job_with_the_kubelets_reason_until_it_starts() -> None:
    from kubedistill.operator.observed import PodView as View

    back_off = 'Back-off pulling image "ghcr.io/kubedistill/kubedistill-runtime:nope"'
    pod = {
        "metadata": {"name": "j-rollout-0", "labels": {"kubedistill.io/role": "rollout"}},
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"name": "main", "state": {"waiting": {"reason": "ImagePullBackOff", "message": back_off}}}
            ],
        },
    }
    assert View.of(pod).image_problem == ("ImagePullBackOff", back_off)
    creating = copy.deepcopy(pod)
    creating["status"]["containerStatuses"][0]["state"]["waiting"] = {"reason": "ContainerCreating"}
    assert View.of(creating).image_problem is None  # on its way: no problem

    job = _job()
    world = _with(_world(job, phase=PodPhase.pending, ready=False), "j-rollout-0", image_problem=("ErrImagePull", "x"))
    p = plan(job, world, T0)
    assert p.status.phase is Phase.blocked
    assert p.status.message == "pod j-rollout-0 cannot get its image: ErrImagePull: x"
    ready = condition(p.status, ConditionType.ready)
    assert (ready.status, ready.reason) == (ConditionStatus.false, "ErrImagePull")
    assert "pod j-rollout-0: ErrImagePull: x" in ready.message
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "Blocked")]
    assert p.create == [] or all(o["kind"] != "Pod" or o["metadata"]["name"] != "j-rollout-0" for o in p.create)

    # The image arrives and the kubelet's retry starts the container: the job goes on by itself.
    later = plan(_next(job, p), _world(job), T0 + timedelta(seconds=30))
    assert later.status.phase is not Phase.blocked and later.status.message == ""
    assert condition(later.status, ConditionType.ready).reason == "AllPodsReady"


def test_a_pod_waiting_for_a_missing_claim_blocks_the_job_until_it_is_scheduled() -> None:
    from kubedistill.operator.observed import PodView as View

    message = '0/3 nodes are available: persistentvolumeclaim "ckpt" not found. preemption: 0/3 nodes'
    pod = {
        "metadata": {"name": "j-trainer-0", "labels": {"kubedistill.io/role": "trainer"}},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}],
        },
    }
    assert View.of(pod).volume_problem == message
    other = copy.deepcopy(pod)
    other["status"]["conditions"][0]["message"] = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    assert View.of(other).volume_problem == ""  # waiting for capacity is not a volume problem

    job = _job()
    world = _with(_world(job, phase=PodPhase.pending, ready=False), "j-trainer-0", volume_problem=message)
    p = plan(job, world, T0)
    assert p.status.phase is Phase.blocked
    assert p.status.message == f"pod j-trainer-0 cannot be scheduled: {message}"
    created = condition(p.status, ConditionType.created)
    assert (created.status, created.reason) == (ConditionStatus.false, "VolumeUnavailable")
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "Blocked")]

    # The claim appears and the pod is scheduled: the job goes on.
    later = plan(_next(job, p), _world(job, phase=PodPhase.pending, ready=False), T0 + timedelta(seconds=5))
    assert later.status.phase is Phase.pending and later.status.message == ""
