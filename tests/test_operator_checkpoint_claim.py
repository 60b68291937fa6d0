"""The checkpoint claim (operator/volumes.py, render.py): a job without a volume at checkpoint.path
gets a PersistentVolumeClaim that trainer pod 0 mounts, so a gang restart resumes from the last
checkpoint; a job that could not resume is Blocked with a one-line reason (operator/policy.py).
The real API server and a real gang restart: tests/test_real_node.py."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from kubedistill.api.failures import GangFailure, decide_gang_failure
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.api.status import ConditionType, Phase
from kubedistill.operator.kube import object_collection_path
from kubedistill.operator.observed import Observed, condition
from kubedistill.operator.policy import JobView, plan
from kubedistill.operator.render import owned_by_job, render_children
from kubedistill.operator.volumes import resume_problem
from operator_fixtures import BASE_SPEC

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CLAIM = {"name": "ckpt", "persistentVolumeClaim": {"claimName": "mine"}}


def _raw(**changes: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE_SPEC)
    raw.update(changes)
    return raw


def _children(**changes: Any) -> dict[tuple[str, str], dict[str, Any]]:
    spec = DistillationJobSpec.model_validate(_raw(**changes))
    return {(o["kind"], o["metadata"]["name"]): o for o in render_children("j", "ml", spec)}


def _checkpoint_volume(pod: dict[str, Any]) -> dict[str, Any] | None:
    return next((v for v in pod["spec"]["volumes"] if v["name"] == "checkpoint"), None)


def test_a_job_without_a_checkpoint_volume_gets_a_claim_on_trainer_pod_0() -> None:
    children = _children()
    claim = children[("PersistentVolumeClaim", "j-checkpoint")]
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100Gi"}}}
    assert claim["metadata"]["labels"]["kubedistill.io/job"] == "j"
    assert not owned_by_job(claim), "whenDeleted Retain: the claim outlives the job"
    t0 = children[("Pod", "j-trainer-0")]
    assert _checkpoint_volume(t0) == {"name": "checkpoint", "persistentVolumeClaim": {"claimName": "j-checkpoint"}}
    mounts = t0["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "checkpoint", "mountPath": "/ckpt"} in mounts
    # Only rank 0 opens the path: the claim (ReadWriteOnce) stays off the other pods.
    assert _checkpoint_volume(children[("Pod", "j-trainer-1")]) == {"name": "checkpoint", "emptyDir": {}}
    assert _checkpoint_volume(children[("Pod", "j-rollout-0")]) is None
    # Made before the pods: the scheduler does not place a pod whose claim is missing.
    kinds = [k for k, _ in children]
    assert kinds.index("PersistentVolumeClaim") < kinds.index("Pod")


def test_the_claims_size_class_and_deletion_follow_the_spec() -> None:
    claim_spec = {"size": "20Gi", "storageClassName": "fast", "whenDeleted": "Delete"}
    claim = _children(checkpoint={"path": "/out/ckpt", "claim": claim_spec})[("PersistentVolumeClaim", "j-checkpoint")]
    assert claim["spec"]["resources"] == {"requests": {"storage": "20Gi"}}
    assert claim["spec"]["storageClassName"] == "fast"
    assert owned_by_job(claim), "whenDeleted Delete: owned by the job, deleted with it"
    with pytest.raises(ValueError, match="claim.size"):
        DistillationJobSpec.model_validate(_raw(checkpoint={"claim": {"size": "lots"}}))


@pytest.mark.parametrize(
    "changes",
    [
        {"volumes": [CLAIM], "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]},
        # The trainer's own mount holds it: no claim, and no second volume at the same path.
        {
            "trainer": {
                **BASE_SPEC["trainer"],
                "overrides": {"volumes": [CLAIM], "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]},
            }
        },
    ],
    ids=["job-wide", "trainer-override"],
)
def test_a_user_volume_at_the_checkpoint_path_is_used_instead(changes: dict[str, Any]) -> None:
    children = _children(**changes)
    assert not [k for k in children if k[0] == "PersistentVolumeClaim"]
    t0 = children[("Pod", "j-trainer-0")]
    assert _checkpoint_volume(t0) is None
    assert any(v.get("persistentVolumeClaim") == {"claimName": "mine"} for v in t0["spec"]["volumes"])


UNRESUMABLE = {
    "scratch": ({"checkpoint": {"path": "/tmp/ckpt"}}, "is on the pods' scratch emptyDir (/tmp)"),
    "relative": ({"checkpoint": {"path": "ckpt"}}, "is relative: set an absolute path"),
    "emptyDir": (
        {"volumes": [{"name": "ckpt", "emptyDir": {}}], "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]},
        "is on emptyDir volume ckpt, which a gang restart empties",
    ),
    # A generic ephemeral volume: its claim is made for the pod and deleted with it.
    "ephemeral": (
        {
            "volumes": [
                {
                    "name": "ckpt",
                    "ephemeral": {
                        "volumeClaimTemplate": {
                            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
                        }
                    },
                }
            ],
            "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
        },
        "is on ephemeral volume ckpt, which a gang restart empties",
    ),
}


@pytest.mark.parametrize("case", sorted(UNRESUMABLE))
def test_a_job_that_could_not_resume_is_blocked_with_a_reason(case: str) -> None:
    changes, why = UNRESUMABLE[case]
    p = plan(JobView("j", "ml", 1, _raw(**changes), {}), Observed(), T0)
    assert p.status.phase is Phase.blocked
    assert why in p.status.message and "\n" not in p.status.message
    assert p.status.message.startswith("checkpoint.resume is auto, but a gang restart could not resume")
    assert condition(p.status, ConditionType.created).reason == "CheckpointNotResumable"
    assert not [o for o in p.create if o["kind"] == "Pod"], "no pods while the job cannot resume"
    # checkpoint.resume never asks for no resume: nothing is promised, the job runs.
    never = copy.deepcopy(changes)
    never.setdefault("checkpoint", {})["resume"] = "never"
    assert resume_problem(DistillationJobSpec.model_validate(_raw(**never))) is None
    runs = plan(JobView("j", "ml", 1, _raw(**never), {}), Observed(), T0)
    assert runs.status.phase is Phase.pending and [o for o in runs.create if o["kind"] == "Pod"]


def test_a_resumable_job_is_not_blocked() -> None:
    for changes in ({}, {"volumes": [CLAIM], "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]}):
        assert resume_problem(DistillationJobSpec.model_validate(_raw(**changes))) is None
        assert plan(JobView("j", "ml", 1, _raw(**changes), {}), Observed(), T0).status.phase is Phase.pending


UNWRITABLE_TRACKERS = {
    "tensorboard on the root": ({"tensorboard": {"logDir": "/var/tb"}}, "trackers.tensorboard.logDir /var/tb is on"),
    "wandb relative": ({"wandb": {"project": "p", "dir": "wandb"}}, "trackers.wandb.dir wandb is relative"),
    "on a read-only mount": ({"tensorboard": {"logDir": "/models/tb"}}, "trackers.tensorboard.logDir /models/tb is on"),
}
WRITABLE_TRACKERS = [
    {"tensorboard": {"logDir": "/ckpt/tb"}},  # on the operator's claim
    {"tensorboard": {"logDir": "/tmp/tb"}, "wandb": {"project": "p", "dir": "/tmp/wandb"}},  # the scratch emptyDir
    {"tensorboard": {"logDir": "/logs/tb"}},  # a writable user mount
    {"wandb": {"project": "p"}},  # a temporary directory of wandb's own
]
LOG_VOLUMES = {
    "volumes": [{"name": "logs", "emptyDir": {}}, {"name": "models", "emptyDir": {}}],
    "volumeMounts": [
        {"name": "logs", "mountPath": "/logs"},
        {"name": "models", "mountPath": "/models", "readOnly": True},
    ],
}


@pytest.mark.parametrize("case", sorted(UNWRITABLE_TRACKERS))
def test_a_tracker_directory_on_the_read_only_root_blocks_the_job_with_the_field(case: str) -> None:
    trackers, why = UNWRITABLE_TRACKERS[case]
    p = plan(JobView("j", "ml", 1, _raw(trackers=trackers, **LOG_VOLUMES), {}), Observed(), T0)
    assert p.status.phase is Phase.blocked
    assert p.status.message.startswith(why) and "\n" not in p.status.message, p.status.message
    assert condition(p.status, ConditionType.created).reason == "TrackerDirNotWritable"
    assert not [o for o in p.create if o["kind"] == "Pod"]


@pytest.mark.parametrize("trackers", WRITABLE_TRACKERS)
def test_a_tracker_directory_on_a_writable_volume_runs(trackers: dict[str, Any]) -> None:
    p = plan(JobView("j", "ml", 1, _raw(trackers=trackers, **LOG_VOLUMES), {}), Observed(), T0)
    assert p.status.phase is Phase.pending and [o for o in p.create if o["kind"] == "Pod"]


def test_the_disruption_event_says_where_the_gang_restarts_from() -> None:
    cause = [GangFailure("trainer pod", "j-trainer-0", "was preempted", "PreemptionByScheduler")]
    resumed = decide_gang_failure(cause, restarts=0, disruptions=0, backoff_limit=1, last_checkpoint="/ckpt/step-4")
    fresh = decide_gang_failure(cause, restarts=0, disruptions=0, backoff_limit=1, resumes=False)
    assert resumed is not None and "from the last checkpoint (/ckpt/step-4)" in resumed.message
    assert fresh is not None and "from step 0 (checkpoint.resume never)" in fresh.message


def test_the_claim_is_created_in_the_core_api() -> None:
    claim = _children()[("PersistentVolumeClaim", "j-checkpoint")]
    assert object_collection_path(claim) == "/api/v1/namespaces/ml/persistentvolumeclaims"
