"""Atomic checkpoint directories on a shared volume (spec.checkpoint).

Layout under ``spec.checkpoint.path``::

    step-00000020/          a complete checkpoint
        trainer.pt          model, optimiser, LR scheduler, RNG states (torch.save)
        driver.pkl          the driver's opaque state (data cursor, buffered samples)
        meta.json           {step, weight_version, files, ...}; written last
    .tmp-step-00000040-<pid>-<hex>/   a checkpoint being written (never loaded)

A checkpoint is written into a ``.tmp-*`` directory, every file fsynced, ``meta.json`` last, then
the directory is renamed to ``step-*`` (atomic on POSIX) and the parent fsynced. A process killed
at any point leaves either the previous complete checkpoints only or the new complete one:
:meth:`CheckpointStore.latest` considers only ``step-*`` directories whose ``meta.json`` parses
and lists files that all exist. Only trainer rank 0 writes; see ``Trainer.save_checkpoint`` /
``Trainer.resume`` for what goes in and how the other ranks get their state.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

META = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    weight_version: int
    meta: dict[str, Any]


def checkpoint_due(step: int, every_steps: int, total_steps: int) -> bool:
    """Whether train step `step` (1-based count of completed steps) ends with a checkpoint."""
    return step % every_steps == 0 or step >= total_steps


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """The checkpoint directory: atomic writes, discovery of the newest complete one, pruning."""

    def __init__(self, root: str | Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def save(
        self,
        step: int,
        weight_version: int,
        files: Mapping[str, Callable[[Path], None]],
        extra_meta: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write `files` (name -> writer(path)) as checkpoint `step`, atomically; returns its path."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{step:08d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for name, write in files.items():
                target = tmp / name
                write(target)
                with open(target, "rb+") as f:
                    os.fsync(f.fileno())
            meta = {"step": step, "weight_version": weight_version, "files": sorted(files), **(extra_meta or {})}
            with open(tmp / META, "w") as f:
                json.dump(meta, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            final = self.step_dir(step)
            if final.exists():
                # Re-saving a step (e.g. after a restart): move the old one aside first, since
                # rename onto a non-empty directory fails.
                old = self.root / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune()
        return final

    def complete(self) -> list[CheckpointInfo]:
        """Complete checkpoints, newest first."""
        if not self.root.is_dir():
            return []
        found = []
        for d in self.root.iterdir():
            m = _STEP_DIR.match(d.name)
            if not m or not d.is_dir():
                continue
            try:
                meta = json.loads((d / META).read_text())
                files = meta["files"]
                step, version = int(meta["step"]), int(meta["weight_version"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if step != int(m.group(1)) or not all((d / f).is_file() for f in files):
                continue
            found.append(CheckpointInfo(d, step, version, meta))
        return sorted(found, key=lambda c: c.step, reverse=True)

    def latest(self) -> CheckpointInfo | None:
        done = self.complete()
        return done[0] if done else None

    def prune(self) -> None:
        for old in self.complete()[self.keep :]:
            shutil.rmtree(old.path, ignore_errors=True)

    def remove_partial(self) -> list[Path]:
        """Delete leftovers of interrupted writes (call on start-up, before any save)."""
        if not self.root.is_dir():
            return []
        removed = [d for d in self.root.iterdir() if d.name.startswith(".tmp-") and d.is_dir()]
        for d in removed:
            shutil.rmtree(d, ignore_errors=True)
        return removed


def write_pickle(obj: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        with open(path, "wb") as f:
            pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)

    return write


def read_pickle(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)
