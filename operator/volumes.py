"""Which volumes each pod of a job mounts: the runtime's own (scratch, and a checkpoint directory
when no user volume holds it), the job-wide user volumes it needs, and its role's own
(`overrides.volumes` / `overrides.volumeMounts`).

Only trainer rank 0 touches the checkpoint path (runtime/trainer/state.py). A job-wide mount that
holds it is therefore left out of every other pod, unless that pod also reads something under it
(its model or tokenizer): on ReadWriteOnce storage a claim mounted by pods on two nodes leaves the
second pod pending on a Multi-Attach error. A volume whose every job-wide mount was left out is
left out too. Pure: render.py places the result in the pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubedistill.api.roleconfig import Role, role_overrides
from kubedistill.api.spec import DistillationJobSpec

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
    """The paths a pod of `role` reads from user volumes, besides the checkpoint path."""
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


def scratch_volumes(spec: DistillationJobSpec, role: Role) -> list[tuple[Volume, Mount]]:
    """(volume, mount) pairs for what the runtime writes under a read-only root: the scratch
    directory, and on trainer pods the checkpoint path when no user volume holds it (the
    checkpoints then live as long as the pod, as they would on the container's own disk)."""
    out = [({"name": "scratch", "emptyDir": {}}, {"name": "scratch", "mountPath": SCRATCH_DIR})]
    ckpt = spec.checkpoint.path.rstrip("/") or "/"
    if (
        role is Role.trainer
        and ckpt.startswith("/")
        and ckpt != SCRATCH_DIR
        and not ckpt.startswith(SCRATCH_DIR + "/")
        and not any(holds(m, ckpt) for m in spec.volume_mounts)
    ):
        out.append(({"name": "checkpoint", "emptyDir": {}}, {"name": "checkpoint", "mountPath": ckpt}))
    return out


def user_volumes(
    spec: DistillationJobSpec, role: Role, replica: int, teacher: str | None
) -> tuple[list[Volume], list[Mount]]:
    """The user's volumes and mounts on one pod: the job-wide ones it needs, then its role's."""
    over = role_overrides(spec, role, teacher)
    mounts = [m for m in spec.volume_mounts if needs_mount(spec, m, role, replica, teacher)]
    mounted = {m.get("name") for m in [*mounts, *over.volume_mounts]}
    dropped = {m.get("name") for m in spec.volume_mounts} - mounted
    volumes = [v for v in spec.volumes if v.get("name") not in dropped]
    return [*volumes, *over.volumes], [*mounts, *over.volume_mounts]
