"""Atomic checkpoints: complete ones are found, partial ones never, even after SIGKILL mid-write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubedistill.runtime.checkpoint import CheckpointStore, checkpoint_due, read_pickle, write_pickle

CHUNK = 1 << 20

# Saves checkpoints 1, 2, 3, ... forever; each has a 24 MiB file written in 1 MiB chunks whose
# every byte is the step number (mod 256), so a torn file is detectable.
WRITER = """
import sys
from kubedistill.runtime.checkpoint import CheckpointStore, write_pickle
store = CheckpointStore(sys.argv[1], keep=2)
CHUNK = int(sys.argv[2])
def payload(step):
    def write(path):
        with open(path, "wb") as f:
            for _ in range(24):
                f.write(bytes([step % 256]) * CHUNK)
                f.flush()
    return write
step = 0
while True:
    step += 1
    store.save(step, step * 10, {"trainer.pt": payload(step), "driver.pkl": write_pickle({"cursor": step})})
"""


def _verify(store: CheckpointStore) -> int:
    info = store.latest()
    assert info is not None
    data = (info.path / "trainer.pt").read_bytes()
    assert len(data) == 24 * CHUNK and data == bytes([info.step % 256]) * len(data)
    assert read_pickle(info.path / "driver.pkl") == {"cursor": info.step}
    assert info.weight_version == info.step * 10
    return info.step


def test_sigkill_mid_write_never_leaves_a_loadable_partial_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(CHUNK)])
    try:
        deadline = time.monotonic() + 60
        # Wait until one checkpoint is complete and the next is half written, then kill.
        while time.monotonic() < deadline:
            if root.is_dir() and any(d.name.startswith("step-") for d in root.iterdir()):
                partial = [d for d in root.iterdir() if d.name.startswith(".tmp-") and (d / "trainer.pt").exists()]
                if partial and (partial[0] / "trainer.pt").stat().st_size > 0:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            time.sleep(0.001)
        else:
            pytest.fail("writer never reached a half-written checkpoint")
    finally:
        proc.kill()
        proc.wait()
    store = CheckpointStore(root, keep=2)
    leftovers = [d for d in root.iterdir() if d.name.startswith(".tmp-")]
    assert leftovers, "the kill should have interrupted a write"
    step = _verify(store)
    assert all(c.path.name.startswith("step-") for c in store.complete())
    # Start-up cleans the debris; the next save works and becomes the latest.
    assert sorted(store.remove_partial()) == sorted(leftovers)
    store.save(
        step + 1,
        0,
        {
            "trainer.pt": lambda p: p.write_bytes(bytes([(step + 1) % 256]) * 24 * CHUNK),
            "driver.pkl": write_pickle({"cursor": step + 1}),
        },
    )
    assert store.latest().step == step + 1


def test_incomplete_or_inconsistent_dirs_are_ignored_and_old_ones_pruned(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3):
        store.save(step, step, {"driver.pkl": write_pickle(step)})
    assert [c.step for c in store.complete()] == [3, 2]  # keep=2 pruned step 1
    # A step dir without meta.json, one with a missing file, and one whose meta disagrees.
    (tmp_path / "step-00000009").mkdir()
    bad = tmp_path / "step-00000008"
    bad.mkdir()
    (bad / "meta.json").write_text('{"step": 8, "weight_version": 1, "files": ["driver.pkl"]}')
    liar = tmp_path / "step-00000007"
    liar.mkdir()
    (liar / "meta.json").write_text('{"step": 70, "weight_version": 1, "files": []}')
    assert store.latest().step == 3
    # Re-saving an existing step replaces it atomically.
    store.save(3, 33, {"driver.pkl": write_pickle("again")})
    assert store.latest().weight_version == 33 and read_pickle(store.latest().path / "driver.pkl") == "again"


def test_checkpoint_due() -> None:
    assert [s for s in range(1, 11) if checkpoint_due(s, 4, 10)] == [4, 8, 10]
    with pytest.raises(ValueError, match="checkpoint.keep must be >= 1"):
        CheckpointStore("/tmp/x", keep=0)
