"""The trainer gang's failure policy: what a stopped trainer member means for the job.

One pure decision, shared by the operator (kubedistill.operator.policy, from pods) and by
`kubedistill run` (kubedistill.runtime.entrypoints.local, from processes), so that
spec.backoffLimit, status.restarts and status.disruptions mean the same thing in both:

  * the job's own failure (non-zero exit, OOM kill, a pod deleted or a process killed by hand)
    restarts the whole gang, counted in restarts, while restarts < backoffLimit; then the job
    fails (BackoffLimitExceeded);
  * the cluster taking a member away (preemption, eviction, drain, a lost node or Ray worker)
    restarts the gang too, counted in disruptions and never against backoffLimit;
  * when both hit the same attempt, it counts: a disruption must not hide a crash.

It lives in the API package because backoffLimit, restarts and disruptions are API fields and
this is what they mean; both callers already depend on it, and it imports neither kopf nor torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class GangOutcome(str, Enum):
    """What happens to the gang; the value is the Event (and, for failed, the condition) reason."""

    restart = "GangRestart"
    """Restart, counted against backoffLimit."""
    disrupted = "GangDisrupted"
    """Restart, not counted: the cluster took a member away."""
    failed = "BackoffLimitExceeded"
    """No restart left: the job fails."""


@dataclass(frozen=True)
class GangFailure:
    """One trainer member of the current gang attempt that stopped."""

    what: str
    """What the member is, as messages name it: "trainer pod", "trainer process"."""
    name: str
    """The pod's or process's name."""
    how: str
    """What happened to it, as the job's own failure: "failed (OOMKilled)", "exited with 3", "is gone"."""
    disruption: str = ""
    """Why the cluster took it away (CamelCase, e.g. PreemptionByScheduler, Evicted), or "" when
    it stopped on its own."""


@dataclass(frozen=True)
class GangDecision:
    outcome: GangOutcome
    restarts: int
    """status.restarts after the decision."""
    disruptions: int
    """status.disruptions after the decision."""
    cause: GangFailure
    """The failure the decision (and its message) is about."""
    message: str
    """The Event's message; also the Failed condition's (failed) or the Disrupted condition's (disrupted)."""

    @property
    def reason(self) -> str:
        return self.outcome.value

    @property
    def restarts_gang(self) -> bool:
        return self.outcome is not GangOutcome.failed


def taken_how(reason: str) -> str:
    """The verb for a disruption reason: preempted, evicted, or taken away."""
    text = reason.lower()
    if "preempt" in text:
        return "preempted"
    if "evict" in text:
        return "evicted"
    return "taken away"


def decide_gang_failure(
    failures: Sequence[GangFailure],
    *,
    restarts: int,
    disruptions: int,
    backoff_limit: int,
    last_checkpoint: str | None = None,
    resumes: bool = True,
) -> GangDecision | None:
    """The decision for the failing members of the current gang attempt (in rank order), given
    the restarts and disruptions so far; None when nothing failed. `resumes`: whether the
    restarted gang resumes from the last checkpoint (checkpoint.resume auto) or starts over."""
    if not failures:
        return None
    own = [f for f in failures if not f.disruption]
    if own:
        cause = own[0]
        why = f"{cause.what} {cause.name} {cause.how}"
        if restarts >= backoff_limit:
            msg = f"{why}; backoffLimit {backoff_limit} reached after {restarts} gang restarts"
            return GangDecision(GangOutcome.failed, restarts, disruptions, cause, msg)
        restarts += 1
        msg = f"{why}; restarting the trainer gang ({restarts}/{backoff_limit})"
        return GangDecision(GangOutcome.restart, restarts, disruptions, cause, msg)
    cause = failures[0]
    disruptions += 1
    if not resumes:
        start = "from step 0 (checkpoint.resume never)"
    elif last_checkpoint:
        start = f"from the last checkpoint ({last_checkpoint})"
    else:
        start = "from step 0 (no checkpoint written yet)"
    msg = (
        f"{cause.what} {cause.name} was {taken_how(cause.disruption)} by the cluster ({cause.disruption}); "
        f"restarting the trainer gang {start}; not counted against backoffLimit (disruption "
        f"{disruptions}, restarts {restarts}/{backoff_limit})"
    )
    return GangDecision(GangOutcome.disrupted, restarts, disruptions, cause, msg)
