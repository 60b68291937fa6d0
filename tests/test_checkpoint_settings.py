"""spec.checkpoint's settings as the driver and the trainer apply them: when checkpoints are
written, how many are kept, whether a new trainer resumes from one, and the export at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from driver_fakes import job_spec, rig
from kubedistill.runtime.trainer import Trainer
from trainer_cases import make_parts, make_spec

torch.set_num_threads(1)


@pytest.mark.parametrize(("every", "export", "saved"), [(2, True, [2, 4, 5]), (3, False, [3, 5])])
async def test_the_driver_checkpoints_every_n_steps_and_the_last_and_exports_as_asked(
    tmp_path: Path, every: int, export: bool, saved: list[int]
) -> None:
    checkpoint = {"path": str(tmp_path / "ckpt"), "everySteps": every, "exportHf": export}
    r = rig(job_spec(tmp_path, steps=5, checkpoint=checkpoint))
    await r.run()
    assert [c.step for c in r.trainer.checkpoints] == saved
    assert r.trainer.exported == ([tmp_path / "ckpt" / "student-hf"] if export else [])


def test_keep_prunes_and_resume_never_starts_fresh(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    t = Trainer(make_spec(tiny_models["student"], ckpt, **{"checkpoint.keep": 2}))
    try:
        for step in (1, 2, 3):
            t.step(make_parts(seed=step))
            t.save_checkpoint(step, step, {"cursor": step})
    finally:
        t.close()
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == ["step-00000002", "step-00000003"]
    for resume, expected in (("auto", 3), ("never", None)):
        again = Trainer(make_spec(tiny_models["student"], ckpt, **{"checkpoint.resume": resume}))
        try:
            resumed = again.resume()
            assert (resumed.step if resumed is not None else None) == expected, resume
        finally:
            again.close()
