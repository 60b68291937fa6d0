"""Where a held-out evaluation shows beyond the driver: the job's status and events (the operator's
plan), the CRD's printer column, and `kubedistill run`'s progress line."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

from kubedistill.api.crd import crd
from kubedistill.api.progress import TrainerProgress
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.operator.observed import ChildRef, Observed, PodPhase, PodView, status_patch
from kubedistill.operator.policy import JobView, TrainerReport, plan
from kubedistill.operator.render import render_static, slots
from kubedistill.runtime.entrypoints.local import _progress_line
from operator_fixtures import BASE_SPEC

T0 = datetime(2026, 1, 1, tzinfo=UTC)
EVALUATION = {
    "step": 20,
    "weightVersion": 20,
    "score": 0.625,
    "sources": {
        "arith": {"score": 0.75, "responseLength": 3.0, "reverseKL": 0.125, "teacher": "arith"},
        "gsm8k": {"score": 0.5, "responseLength": 90.5},
    },
}


def _job(status: dict[str, Any]) -> JobView:
    return JobView(name="j", namespace="ml", generation=1, spec=copy.deepcopy(BASE_SPEC), status=status)


def _world(job: JobView) -> Observed:
    spec = DistillationJobSpec.model_validate(dict(job.spec))
    others = {ChildRef(o["kind"], o["metadata"]["name"]) for o in render_static("j", "ml", spec)}
    pods = {}
    for s in slots(spec):
        name = s.pod_name("j")
        pods[name] = PodView(
            name=name,
            role=s.role,
            replica=s.replica,
            teacher=s.teacher,
            attempt=0 if s.role.value == "trainer" else None,
            phase=PodPhase.running,
            ready=True,
        )
    return Observed(pods=pods, others=others)


def _report(doc: dict[str, Any]) -> TrainerReport:
    return TrainerReport.of({"step": doc.get("step", 0), **doc}, attempt=0)


def test_the_last_evaluation_goes_into_the_status_with_one_event() -> None:
    job = _job({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    world = _world(job)
    p = plan(job, world, T0, _report({"step": 21, "evaluation": EVALUATION}))
    patch = status_patch(p.status)
    assert patch["evaluation"]["score"] == 0.625 and patch["evaluation"]["step"] == 20
    assert patch["evaluation"]["sources"]["arith"]["reverseKL"] == 0.125
    evaluated = [e for e in p.events if e.reason == "Evaluated"]
    assert [e.type for e in evaluated] == ["Normal"]
    assert evaluated[0].message == "held-out score 0.625 at step 20 (weight version 20): arith 0.75, gsm8k 0.5"

    # The same evaluation reported again: no second event. A restarted trainer, before its first
    # evaluation, reports none: the status keeps the last one.
    after = JobView(job.name, job.namespace, job.generation, job.spec, patch)
    again = plan(after, world, T0, _report({"step": 22, "evaluation": EVALUATION}))
    assert not [e for e in again.events if e.reason == "Evaluated"]
    restarted = plan(after, world, T0, _report({"step": 0}))
    assert status_patch(restarted.status)["evaluation"]["step"] == 20
    later = plan(after, world, T0, _report({"step": 40, "evaluation": {**EVALUATION, "step": 40, "score": 0.7}}))
    assert [e.message.split(":")[0] for e in later.events if e.reason == "Evaluated"] == [
        "held-out score 0.7 at step 40 (weight version 20)"
    ]


def test_kubectl_get_shows_the_headline_score() -> None:
    columns = crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    assert {"name": "Score", "type": "number", "jsonPath": ".status.evaluation.score"} in columns


def test_the_progress_line_shows_the_last_held_out_score() -> None:
    progress = TrainerProgress.from_json({"step": 21, "totalSteps": 50, "evaluation": EVALUATION})
    assert _progress_line(progress, 50, 12.0).endswith("| held-out 0.625 @20")
    assert "held-out" not in _progress_line(TrainerProgress.from_json({"step": 3}), 50, 1.0)


def test_the_quickstart_takes_its_accuracies_from_the_jobs_evaluations() -> None:
    from kubedistill.demo.quickstart import held_out_scores, summary_line, with_job_accuracy

    history = [
        {"step": 1, "evaluations": [{"step": 0, "score": 0.43}]},
        {"step": 2},
        {"step": 21, "evaluations": [{"step": 20, "score": 0.292}]},
        {"step": 40, "evaluations": [{"step": 40, "score": 0.516}]},
    ]
    scores = held_out_scores(history)
    assert scores == [(0, 0.43), (20, 0.292), (40, 0.516)]
    measured = {"accuracy": 0.1, "reverse_kl": 1.3}, {"accuracy": 0.2, "reverse_kl": 1.2}
    before, after = with_job_accuracy(*measured, scores)
    assert (before["accuracy"], after["accuracy"]) == (0.43, 0.516)
    assert summary_line(before, after, 0.9).endswith("accuracy 43.0% → 51.6% (teacher 90.0%)")
    # No evaluation before the first step (or none at all): evaluate()'s accuracies stay.
    assert with_job_accuracy(*measured, scores[1:]) == measured
