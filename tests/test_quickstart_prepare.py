from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubedistill.demo import arith, quickstart


def test_arith_split_is_disjoint_and_complete() -> None:
    train, held = arith.split()
    assert len(train) == 9000 and len(held) == 1000
    assert not {(p.a, p.b) for p in train} & {(p.a, p.b) for p in held}
    assert arith.Problem(7, 45).prompt == "07+45=" and arith.Problem(7, 45).answer == "52"


def test_prepare_writes_models_and_verl_data(tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    info = quickstart.prepare(tmp_path, teacher_steps=30, student_steps=10, log=lambda *_: None)
    for name in ("teacher", "student", "student-init"):
        assert (tmp_path / name / "model.safetensors").is_file()
    row = json.loads((tmp_path / "data/train.jsonl").read_text().splitlines()[0])
    assert row["data_source"] == "arith" and row["prompt"][0]["role"] == "user"
    assert row["reward_model"]["ground_truth"] == str(eval(row["prompt"][0]["content"].rstrip("=")))
    assert len((tmp_path / "data/val.jsonl").read_text().splitlines()) == 1000
    assert info["student"]["schedule"]["decay"] is False  # the warm start keeps a constant LR
    # A second call with the same schedules reuses the prepared directory instead of training again.
    assert quickstart.prepare(tmp_path, teacher_steps=30, student_steps=10) == info

    same = quickstart.evaluate(tmp_path / "teacher", tmp_path / "teacher", n_problems=50)
    assert same["reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    apart = quickstart.evaluate(tmp_path / "student", tmp_path / "teacher", n_problems=50)
    assert apart["reverse_kl"] > 0.01
    assert 0.0 <= apart["accuracy"] <= 1.0


def test_prepare_replaces_only_a_student_made_with_another_schedule(tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    quickstart.prepare(tmp_path, teacher_steps=5, student_steps=5, log=lambda *_: None)
    # A prepared.json from before schedules were recorded: the student had the teacher's schedule.
    marker = tmp_path / quickstart.MARKER
    old = json.loads(marker.read_text())
    old = {name: {k: v for k, v in entry.items() if k != "schedule"} for name, entry in old.items()}
    marker.write_text(json.dumps(old))
    teacher_mtime = (tmp_path / "teacher/model.safetensors").stat().st_mtime_ns
    lines: list[str] = []
    info = quickstart.prepare(tmp_path, teacher_steps=5, student_steps=5, log=lines.append)
    assert (tmp_path / "teacher/model.safetensors").stat().st_mtime_ns == teacher_mtime
    assert info["teacher"] == old["teacher"] and info["student"]["schedule"]["steps"] == 5
    assert any(line.startswith("quickstart: student trained 5 steps") for line in lines)


def test_progress_line() -> None:
    line = quickstart.progress_line("teacher", 100, 700, 0.81234, 0.123, 9.6)
    assert line == "quickstart: teacher step 100/700, loss 0.812, accuracy 12.3% (10 s)"


def test_train_reports_progress_every_n_steps_but_not_the_last() -> None:
    import dataclasses

    import torch

    from kubedistill.demo.tiny import char_tokenizer

    torch.set_num_threads(1)
    lines: list[str] = []
    cfg = dataclasses.replace(quickstart.STUDENT_WARM_START, steps=5, batch_size=8)
    tok = char_tokenizer(arith.ALPHABET)
    _, acc = quickstart.train("student", quickstart.STUDENT, cfg, tok, log=lines.append, every=2)
    assert [line.split(",")[0] for line in lines] == ["quickstart: student step 2/5", "quickstart: student step 4/5"]
    assert 0.0 <= acc <= 1.0


def test_schedules_match_the_measured_recipes() -> None:
    # The teacher needs cosine decay to pass 95 %; the warm start must not decay (docs/learning.md).
    assert quickstart.TEACHER_TRAINING.decay and not quickstart.STUDENT_WARM_START.decay
    assert quickstart.STUDENT_WARM_START.steps == 300 and quickstart.STUDENT_WARM_START.seed == 1
    assert quickstart.recorded_schedule({"steps": 700}) == quickstart.schedule_json(quickstart.TEACHER_TRAINING)
    assert quickstart.recorded_schedule({}) is None


def test_idle_cores_leaves_busy_cores_alone() -> None:
    assert quickstart.idle_cores(2, 0.1) == 2
    assert quickstart.idle_cores(2, 0.9) == 1
    assert quickstart.idle_cores(2, 7.5) == 1  # never fewer than one
    assert quickstart.idle_cores(8, 2.2) == 6
