"""`kubedistill prepare-vl` (kubedistill/demo/vl_prepare.py): the VL twin's models and data in
the layout examples/multi-teacher-vl-cpu.yaml points at, cached per part (the quick recipe: the
same files in seconds; the measured recipe runs in bench/learning.py --task vl)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from kubedistill.demo import arith, dots, vl_prepare

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    import torch

    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("vl-prepare") / vl_prepare.VL_DIR
    return base, vl_prepare.prepare_vl(base, recipe=vl_prepare.QUICK, log=lambda *_: None)


def test_writes_what_the_example_points_at(prepared: tuple[Path, dict]) -> None:
    from kubedistill.api.validate import load_job
    from kubedistill.runtime.entrypoints.local import absolute_paths
    from kubedistill.runtime.models.loading import check_job_vocabulary, is_vision_language

    base, info = prepared
    spec = absolute_paths(load_job(ROOT / vl_prepare.VL_JOB).spec, base.parents[1])
    for path in [spec.student.model, *(t.model for t in spec.teachers), *spec.data.train]:
        assert Path(path).exists(), path
    check_job_vocabulary(spec)  # one tokenizer for the student and both teachers

    from transformers import AutoConfig

    kinds = {t.name: is_vision_language(AutoConfig.from_pretrained(t.model)) for t in spec.teachers}
    assert kinds == {"text": False, "vision": True}
    assert is_vision_language(AutoConfig.from_pretrained(spec.student.model))
    # Every teacher's match names a data_source the file holds, and every row is routed.
    import pyarrow.parquet as pq

    rows = pq.read_table(spec.data.train[0]).to_pylist()
    sources = {r["data_source"] for r in rows}
    assert sources == {arith.DATA_SOURCE, dots.DATA_SOURCE}
    assert sources == {s for t in spec.teachers for s in t.match.data_source}
    image_rows = [r for r in rows if r["data_source"] == dots.DATA_SOURCE]
    assert all(r["images"] and r["prompt"][0]["content"].startswith("<image>") for r in image_rows)
    assert len(rows) == 2 * vl_prepare.QUICK.train_rows
    assert set(info) == set(vl_prepare.PARTS)


def test_student_sees_with_the_vision_teachers_tower(prepared: tuple[Path, dict]) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    base, _ = prepared
    student = AutoModelForImageTextToText.from_pretrained(str(base / "student")).state_dict()
    teacher = AutoModelForImageTextToText.from_pretrained(str(base / "teacher-vision")).state_dict()
    tower = [k for k in student if k.startswith(vl_prepare.VISION_PREFIX)]
    assert tower and all(torch.equal(student[k], teacher[k]) for k in tower)
    init = AutoModelForImageTextToText.from_pretrained(str(base / "student-init")).state_dict()
    assert all(torch.equal(student[k], init[k]) for k in student)


def test_a_second_call_reuses_and_a_changed_part_alone_is_rebuilt(prepared: tuple[Path, dict]) -> None:
    base, info = prepared
    assert vl_prepare.prepare_vl(base, recipe=vl_prepare.QUICK) == info
    mtimes = {p: (base / p).stat().st_mtime_ns for p in ("teacher-vision", "teacher-text")}
    lines: list[str] = []
    changed = dataclasses.replace(vl_prepare.QUICK, student_steps=vl_prepare.QUICK.student_steps + 1)
    new = vl_prepare.prepare_vl(base, recipe=changed, log=lines.append)
    assert [line.split(" made")[0] for line in lines if " made in " in line] == ["vl-prepare: student"]
    assert {p: (base / p).stat().st_mtime_ns for p in mtimes} == mtimes
    assert new["student"]["recipe"]["steps"] == changed.student_steps
    assert json.loads((base / vl_prepare.MARKER).read_text()) == new


def test_the_student_depends_on_the_vision_teachers_recipe() -> None:
    other = dataclasses.replace(vl_prepare.FULL, vision_teacher_steps=1)
    assert vl_prepare.FULL.part("student") != other.part("student")
    assert vl_prepare.FULL.part("teacher-text") == other.part("teacher-text")
    no_tower = dataclasses.replace(vl_prepare.FULL, student_vision_from_teacher=False)
    assert no_tower.part("student")["vision_from"] is None
    with pytest.raises(ValueError, match="unknown part"):
        vl_prepare.FULL.part("nope")


def test_the_example_names_the_prepare_command() -> None:
    header = (ROOT / vl_prepare.VL_JOB).read_text()
    assert "kubedistill prepare-vl" in header
    assert yaml.safe_load(header)["spec"]["student"]["model"] == str(vl_prepare.VL_DIR / "student")
