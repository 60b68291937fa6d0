"""Which volumes each pod mounts (operator/volumes.py) and what it requests (operator/requests.py),
through the rendered pods."""

from __future__ import annotations

import copy
from typing import Any

from kubedistill.api.spec import DistillationJobSpec
from kubedistill.operator.render import render_children
from operator_fixtures import BASE_SPEC


def _pods(**changes: Any) -> dict[str, dict[str, Any]]:
    raw = copy.deepcopy(BASE_SPEC)
    raw.update(changes)
    spec = DistillationJobSpec.model_validate(raw)
    return {o["metadata"]["name"]: o for o in render_children("j", "ml", spec) if o["kind"] == "Pod"}


def _names(pod: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(volume names, mount names) of a pod's user volumes (the runtime's own left out)."""
    own = {"kubedistill-config", "dshm", "scratch", "checkpoint"}
    volumes = {v["name"] for v in pod["spec"]["volumes"]} - own
    mounts = {m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]} - own
    return volumes, mounts


CLAIMS = [
    {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
    {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}},
]


def test_a_checkpoint_claim_is_mounted_only_where_checkpoints_are_written() -> None:
    pods = _pods(
        checkpoint={"path": "/ckpt/run1"},
        volumes=CLAIMS,
        volumeMounts=[{"name": "models", "mountPath": "/models"}, {"name": "ckpt", "mountPath": "/ckpt"}],
    )
    assert _names(pods["j-trainer-0"]) == ({"models", "ckpt"}, {"models", "ckpt"})
    for name in ("j-trainer-1", "j-rollout-0", "j-rollout-1", "j-teacher-math-0"):
        assert _names(pods[name]) == ({"models"}, {"models"}), name


def test_a_claim_holding_models_and_checkpoints_stays_where_the_models_are_read() -> None:
    pods = _pods(
        student={"model": "/shared/models/student"},
        checkpoint={"path": "/shared/ckpt"},
        volumes=[{"name": "shared", "persistentVolumeClaim": {"claimName": "shared"}}],
        volumeMounts=[{"name": "shared", "mountPath": "/shared"}],
    )
    # The rollout servers load the student from it; the teacher's model lives elsewhere.
    assert _names(pods["j-rollout-0"]) == ({"shared"}, {"shared"})
    assert _names(pods["j-trainer-1"]) == ({"shared"}, {"shared"})
    assert _names(pods["j-teacher-math-0"]) == (set(), set())


def test_role_overrides_add_volumes_to_their_role_only() -> None:
    cache = {"name": "cache", "emptyDir": {"sizeLimit": "10Gi"}}
    pods = _pods(
        rollout={
            "replicas": 2,
            "overrides": {"volumes": [cache], "volumeMounts": [{"name": "cache", "mountPath": "/c"}]},
        },
    )
    assert _names(pods["j-rollout-1"]) == ({"cache"}, {"cache"})
    assert cache in pods["j-rollout-1"]["spec"]["volumes"]
    assert _names(pods["j-trainer-0"]) == (set(), set()) and _names(pods["j-teacher-math-0"]) == (set(), set())


def test_every_pod_requests_cpu_and_memory_and_overrides_win_per_key() -> None:
    pods = _pods(
        trainer={"replicas": 2, "miniBatchSize": 4, "overrides": {"resources": {"requests": {"memory": "9Gi"}}}}
    )
    assert pods["j-trainer-0"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "250m", "memory": "9Gi"}}
    assert pods["j-rollout-0"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "250m", "memory": "2Gi"}}
    gpu = _pods(device="cuda", rollout={"replicas": 1, "gpus": 2, "inference": {"tensorParallelSize": 2}})
    assert gpu["j-rollout-0"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "2"},
        "limits": {"nvidia.com/gpu": "2"},
    }
    trainer = gpu["j-trainer-0"]["spec"]["containers"][0]["resources"]["requests"]
    assert trainer == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}


def test_a_trainer_override_claim_at_the_checkpoint_path_goes_on_trainer_pod_0_only() -> None:
    """A ReadWriteOnce claim the trainer's overrides mount at checkpoint.path: on trainer pod 0,
    which writes checkpoints, and on no other trainer pod (two nodes would Multi-Attach)."""
    trainer = copy.deepcopy(BASE_SPEC["trainer"])
    trainer["overrides"] = {
        "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}],
        "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
    }
    pods = _pods(checkpoint={"path": "/ckpt/run1"}, trainer=trainer)
    assert _names(pods["j-trainer-0"]) == ({"ckpt"}, {"ckpt"})
    assert _names(pods["j-trainer-1"]) == (set(), set())
    assert _names(pods["j-rollout-0"]) == (set(), set())


def test_the_reference_jobs_datasets_claim_goes_on_trainer_pods_only() -> None:
    """examples/multi-teacher-6gpu.yaml: the data is read by the driver, on the trainer; the
    rollout and teacher pods mount the models and nothing else."""
    from pathlib import Path

    from kubedistill.api.validate import load_job

    spec = load_job(Path(__file__).resolve().parent.parent / "examples/multi-teacher-6gpu.yaml").spec
    pods = [o for o in render_children("j", "ml", spec) if o["kind"] == "Pod"]
    assert len(pods) == 6
    for pod in pods:
        claims = {
            v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v
        }
        trainer = pod["metadata"]["name"].startswith("j-trainer-")
        assert ("datasets" in claims) is trainer, pod["metadata"]["name"]
