"""spec.routing.key names the column the driver routes by, spec.routing.defaultTeacher scores
what no teacher's match.dataSource covers, and match.dataSource picks each teacher's samples."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.driver.routing import TeacherRouter
from operator_fixtures import BASE_SPEC


def _router(default_teacher: str | None) -> TeacherRouter:
    raw = copy.deepcopy(BASE_SPEC)
    raw["teachers"] = [
        {"name": "math", "model": "/m", "match": {"dataSource": ["gsm8k", "math"]}},
        {"name": "chat", "model": "/c", **({} if default_teacher else {"match": {"dataSource": ["chat"]}})},
    ]
    raw["routing"] = {"key": "task", **({"defaultTeacher": default_teacher} if default_teacher else {})}
    spec = DistillationJobSpec.model_validate(raw)
    return TeacherRouter(spec, {"math": ["http://math-0:8000"], "chat": ["http://chat-0:8000"]})


def test_the_routing_key_column_selects_the_teacher() -> None:
    router = _router(None)
    assert router.route_value({"task": "math", "data_source": "chat"}) == "math"
    assert router.acquire(router.route_value({"task": "gsm8k"}))[0] == "math"
    assert router.acquire(router.route_value({"task": "chat"}))[0] == "chat"
    with pytest.raises(KeyError, match="no column 'task'"):
        router.route_value({"data_source": "math"})
    with pytest.raises(LookupError, match="no teacher matches task='poetry'"):
        router.teacher_for("poetry")


def test_the_default_teacher_scores_what_no_match_covers() -> None:
    router = _router("chat")
    assert router.teacher_for("poetry") == "chat"
    assert router.teacher_for("math") == "math"


@pytest.mark.parametrize("split", ["train", "val"])
def test_the_driver_reads_the_routing_key_column_of_every_row(tmp_path: Path, split: str) -> None:
    """The live path: PromptSource.from_spec reads spec.routing.key's column into each item's
    route_value, the value the driver routes by (loop.py, evaluation.py), not data_source."""
    from kubedistill.demo.tiny import char_tokenizer
    from kubedistill.runtime.driver.data import PromptSource

    rows = tmp_path / "rows.jsonl"
    with rows.open("w") as f:
        for i, task in enumerate(["gsm8k", "chat", "math", "chat"]):
            prompt = [{"role": "user", "content": f"{i}+{i}="}]
            f.write(json.dumps({"data_source": "chat", "task": task, "prompt": prompt, "reward_model": {}}) + "\n")
    raw = copy.deepcopy(BASE_SPEC)
    raw["data"] = {"train": [str(rows)], "val": [str(rows)], "shuffle": False}
    raw["teachers"] = [
        {"name": "math", "model": "/m", "match": {"dataSource": ["gsm8k", "math"]}},
        {"name": "chat", "model": "/c", "match": {"dataSource": ["chat"]}},
    ]
    raw["routing"] = {"key": "task"}
    spec = DistillationJobSpec.model_validate(raw)
    source = PromptSource.from_spec(spec, char_tokenizer("0123456789+="), split=split)
    items = source.take(4) if split == "val" else [next(source) for _ in range(4)]
    router = TeacherRouter(spec, {"math": ["http://math-0:8000"], "chat": ["http://chat-0:8000"]})
    assert [i.route_value for i in items] == ["gsm8k", "chat", "math", "chat"]
    assert [router.teacher_for(i.route_value) for i in items] == ["math", "chat", "math", "chat"]
