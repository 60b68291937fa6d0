from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubedistill.runtime.entrypoints import quickstart
from kubedistill.runtime.tasks import arith


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
    # A second call reuses the prepared directory instead of training again.
    assert quickstart.prepare(tmp_path, teacher_steps=10_000) == info

    same = quickstart.evaluate(tmp_path / "teacher", tmp_path / "teacher", n_problems=50)
    assert same["reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    apart = quickstart.evaluate(tmp_path / "student", tmp_path / "teacher", n_problems=50)
    assert apart["reverse_kl"] > 0.01
    assert 0.0 <= apart["accuracy"] <= 1.0
