"""Which volumes each pod of a job mounts: the runtime's own (scratch, and the checkpoint claim
the operator provisions when no user volume holds checkpoint.path), the job-wide user volumes it
needs, and its role's own (`overrides.volumes` / `overrides.volumeMounts`).

Only trainer rank 0 touches the checkpoint path (runtime/trainer/state.py). A mount that holds it,
job-wide or a role's own, is therefore left out of every other pod, unless that pod also reads
something under it (its model or tokenizer): on ReadWriteOnce storage a claim mounted by pods on
two nodes leaves the second pod pending on a Multi-Attach error. A volume whose every mount was
left out is left out too. Pure: render.py places the result in the pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubedistill.api.roleconfig import Role, role_overrides
from kubedistill.api.spec import DistillationJobSpec, ResumePolicy

SCRATCH_DIR = "/tmp"
"""The writable emptyDir of every pod; HOME points here, so every cache (HF, vLLM, torch,
triton) lands in it while the root filesystem stays read-only."""

Volume = dict[str, Any]
Mount = dict[str, Any]


def holds(mount: Mount, path: str | Path) -> bool:
    """Whether `mount` holds `path` (at or under its mountPath)."""
    root = str(mount.get("mountPath", "")).rstrip("/")
    p = str(path).rstrip("/") or "/"
    return bool(root) and (p == root or p.startswith(root + "/"))


def writes_checkpoints(role: Role, replica: int) -> bool:
    """Trainer rank 0 saves, resumes and exports; every other pod never opens the checkpoint path."""
    return role is Role.trainer and replica == 0


def reads(spec: DistillationJobSpec, role: Role, teacher: str | None) -> list[str]:
    """The paths a pod of `role` reads from user volumes, besides the checkpoint path (an
    environment's server reads none that the spec names)."""
    if role is Role.environment:
        return []
    model = spec.teacher(teacher or "") if role is Role.teacher else spec.student
    paths = [str(p) for p in (model.model, model.tokenizer) if p is not None]
    if role is Role.trainer:  # rank 0's driver reads the data (the other ranks keep it anyway)
        paths += [str(f) for f in (*spec.data.train, *spec.data.val)]
    return paths


def needs_mount(spec: DistillationJobSpec, mount: Mount, role: Role, replica: int, teacher: str | None) -> bool:
    """A job-wide mount is left out only where it holds the checkpoint path, the pod does not
    write checkpoints, and nothing else the pod reads is under it."""
    if writes_checkpoints(role, replica) or not holds(mount, spec.checkpoint.path):
        return True
    return any(holds(mount, p) for p in reads(spec, role, teacher))


def checkpoint_claim_name(job: str) -> str:
    return f"{job}-checkpoint"


def _trainer_mounts(spec: DistillationJobSpec) -> list[Mount]:
    """The user's mounts on trainer pod 0, the one that writes checkpoints."""
    return [*spec.volume_mounts, *spec.trainer.overrides.volume_mounts]


def _under_scratch(path: str) -> bool:
    return path == SCRATCH_DIR or path.startswith(SCRATCH_DIR + "/")


def provisions_checkpoint_claim(spec: DistillationJobSpec) -> bool:
    """Whether the operator makes the checkpoint claim: checkpoint.path is an absolute path outside
    the scratch directory that no user volume on trainer pod 0 holds."""
    ckpt = spec.checkpoint.path.rstrip("/") or "/"
    return ckpt.startswith("/") and not _under_scratch(ckpt) and not any(holds(m, ckpt) for m in _trainer_mounts(spec))


POD_LIFETIME_VOLUMES = ("emptyDir", "ephemeral")
"""Volume sources that live and die with their pod (a generic ephemeral volume's claim is deleted
with it): a gang restart, which replaces the trainer pods, finds them empty."""


def resume_problem(spec: DistillationJobSpec) -> str | None:
    """Why a gang restart of this job could not resume from its last checkpoint, in one line; None
    when it can, or when checkpoint.resume is never (a restart then starts over, as asked)."""
    if spec.checkpoint.resume is ResumePolicy.never:
        return None
    ckpt = spec.checkpoint.path.rstrip("/") or "/"
    fix = "mount a persistentVolumeClaim there, or set checkpoint.resume never"
    if not ckpt.startswith("/"):
        return f"checkpoint.path {spec.checkpoint.path} is relative: set an absolute path"
    if _under_scratch(ckpt):
        return f"checkpoint.path {ckpt} is on the pods' scratch emptyDir ({SCRATCH_DIR}), which a gang restart empties"
    mount = next((m for m in reversed(_trainer_mounts(spec)) if holds(m, ckpt)), None)
    if mount is None:
        return None  # the operator's claim holds it
    volumes = [*spec.volumes, *spec.trainer.overrides.volumes]
    volume = next((v for v in volumes if v.get("name") == mount.get("name")), None)
    kind = next((k for k in POD_LIFETIME_VOLUMES if volume is not None and k in volume), None)
    if volume is not None and kind is not None:
        return (
            f"checkpoint.path {ckpt} is on {kind} volume {volume['name']}, which a gang restart empties: {fix}"
            " (or remove the mount, and the operator provisions a claim)"
        )
    return None


def scratch_volumes(job: str, spec: DistillationJobSpec, role: Role, replica: int) -> list[tuple[Volume, Mount]]:
    """(volume, mount) pairs for what the runtime writes under a read-only root: the scratch
    directory, and on trainer pods the checkpoint path when no user volume holds it: the claim the
    operator provisions on pod 0, which writes checkpoints (they survive a gang restart), an
    emptyDir on the other ranks, which never open it."""
    out = [({"name": "scratch", "emptyDir": {}}, {"name": "scratch", "mountPath": SCRATCH_DIR})]
    if role is Role.trainer and provisions_checkpoint_claim(spec):
        ckpt = spec.checkpoint.path.rstrip("/") or "/"
        source: Volume = (
            {"persistentVolumeClaim": {"claimName": checkpoint_claim_name(job)}}
            if writes_checkpoints(role, replica)
            else {"emptyDir": {}}
        )
        out.append(({"name": "checkpoint", **source}, {"name": "checkpoint", "mountPath": ckpt}))
    return out


def user_volumes(
    spec: DistillationJobSpec, role: Role, replica: int, teacher: str | None
) -> tuple[list[Volume], list[Mount]]:
    """The user's volumes and mounts on one pod: the job-wide ones it needs, then its role's (a
    role's own mount at the checkpoint path, too, only where `needs_mount` says)."""
    over = role_overrides(spec, role, teacher)
    mounts = [m for m in spec.volume_mounts if needs_mount(spec, m, role, replica, teacher)]
    own = [m for m in over.volume_mounts if needs_mount(spec, m, role, replica, teacher)]
    mounted = {m.get("name") for m in [*mounts, *own]}
    dropped = {m.get("name") for m in [*spec.volume_mounts, *over.volume_mounts]} - mounted
    volumes = [v for v in [*spec.volumes, *over.volumes] if v.get("name") not in dropped]
    return volumes, [*mounts, *own]


def unwritable_tracker_dir(spec: DistillationJobSpec) -> str | None:
    """Why trainer pod 0 could not write a tracker's local directory (trackers.tensorboard.logDir,
    trackers.wandb.dir), in one line; None when every one is on something writable: the scratch
    emptyDir, the checkpoint path (the operator's claim or a user volume), or a writable user mount
    of trainer pod 0. Anywhere else is the image's read-only root filesystem."""
    trackers = spec.trackers
    if trackers is None:
        return None
    wanted = []
    if trackers.tensorboard is not None:
        wanted.append(("trackers.tensorboard.logDir", str(trackers.tensorboard.log_dir)))
    if trackers.wandb is not None and trackers.wandb.dir is not None:
        wanted.append(("trackers.wandb.dir", str(trackers.wandb.dir)))
    writable = [m for m in _trainer_mounts(spec) if not m.get("readOnly")]
    ckpt = spec.checkpoint.path.rstrip("/") or "/"
    for field, path in wanted:
        if not path.startswith("/"):
            return (
                f"{field} {path} is relative: set an absolute path under checkpoint.path ({ckpt}) or a mounted volume"
            )
        on_ckpt = ckpt.startswith("/") and holds({"mountPath": ckpt}, path)
        if not (_under_scratch(path) or on_ckpt or any(holds(m, path) for m in writable)):
            return (
                f"{field} {path} is on the pods' read-only root filesystem: put it under checkpoint.path ({ckpt}) "
                f"or a writable volume mounted on the trainer"
            )
    return None
