"""The trainer gang's failure policy (kubedistill.api.failures), which the operator and
`kubedistill run` share: what counts against backoffLimit, what does not, and the messages."""

from __future__ import annotations

from kubedistill.api.failures import GangFailure, GangOutcome, decide_gang_failure, taken_how


def test_nothing_failed_is_no_decision() -> None:
    assert decide_gang_failure([], restarts=0, disruptions=0, backoff_limit=3) is None


def test_the_jobs_own_failure_restarts_the_gang_counted() -> None:
    d = decide_gang_failure(
        [GangFailure("trainer pod", "j-trainer-1", "failed (OOMKilled)")], restarts=1, disruptions=2, backoff_limit=3
    )
    assert d is not None and d.outcome is GangOutcome.restart and d.restarts_gang
    assert (d.reason, d.restarts, d.disruptions) == ("GangRestart", 2, 2)
    assert d.message == "trainer pod j-trainer-1 failed (OOMKilled); restarting the trainer gang (2/3)"


def test_a_disruption_restarts_the_gang_uncounted_even_at_the_limit() -> None:
    d = decide_gang_failure(
        [GangFailure("trainer pod", "j-trainer-1", "is gone", "PreemptionByScheduler")],
        restarts=3,
        disruptions=0,
        backoff_limit=3,
        last_checkpoint="/ckpt/step-50",
    )
    assert d is not None and d.outcome is GangOutcome.disrupted and d.restarts_gang
    assert (d.reason, d.restarts, d.disruptions, d.cause.disruption) == ("GangDisrupted", 3, 1, "PreemptionByScheduler")
    assert d.message == (
        "trainer pod j-trainer-1 was preempted by the cluster (PreemptionByScheduler); restarting the trainer "
        "gang from the last checkpoint (/ckpt/step-50); not counted against backoffLimit (disruption 1, "
        "restarts 3/3)"
    )


def test_reaching_the_backoff_limit_fails_the_job() -> None:
    d = decide_gang_failure(
        [GangFailure("trainer process", "trainer-0", "exited with 3")], restarts=2, disruptions=5, backoff_limit=2
    )
    assert d is not None and d.outcome is GangOutcome.failed and not d.restarts_gang
    assert (d.reason, d.restarts, d.disruptions) == ("BackoffLimitExceeded", 2, 5)
    assert d.message == "trainer process trainer-0 exited with 3; backoffLimit 2 reached after 2 gang restarts"


def test_an_own_failure_in_a_disrupted_attempt_counts_and_names_the_first_own_one() -> None:
    failures = [
        GangFailure("trainer pod", "j-trainer-0", "is gone", "Evicted"),
        GangFailure("trainer pod", "j-trainer-1", "failed (Error, exit code 1)"),
        GangFailure("trainer pod", "j-trainer-2", "is gone"),
    ]
    d = decide_gang_failure(failures, restarts=0, disruptions=0, backoff_limit=0)
    assert d is not None and d.outcome is GangOutcome.failed and d.cause.name == "j-trainer-1"
    d = decide_gang_failure(failures, restarts=0, disruptions=0, backoff_limit=1)
    assert d is not None and d.outcome is GangOutcome.restart and (d.restarts, d.disruptions) == (1, 0)


def test_a_disruption_without_a_checkpoint_names_the_first_member() -> None:
    failures = [
        GangFailure("trainer process", "trainer-0", "is gone", "RayActorDied"),
        GangFailure("trainer process", "trainer-1", "is gone", "NodePreempted"),
    ]
    d = decide_gang_failure(failures, restarts=0, disruptions=4, backoff_limit=0)
    assert d is not None and d.outcome is GangOutcome.disrupted and d.disruptions == 5
    assert d.message.startswith(
        "trainer process trainer-0 was taken away by the cluster (RayActorDied); restarting the trainer gang "
        "from step 0 (no checkpoint written yet); not counted"
    )
    assert "last checkpoint" not in d.message


def test_taken_how() -> None:
    assert [taken_how(r) for r in ("PreemptionByScheduler", "Preempted", "Evicted", "TerminationByKubelet")] == [
        "preempted",
        "preempted",
        "evicted",
        "taken away",
    ]
