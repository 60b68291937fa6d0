"""docs/fields.md stays whole: one row per leaf field of the DistillationJob spec (as the
pydantic models define it), no row for a field that does not exist, and every row cites at least
one test that exists."""

from __future__ import annotations

import re
import types
import typing
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kubedistill.api.spec import DistillationJobSpec

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "fields.md"
ROW = re.compile(r"^\| `(spec[^`]*)` \|(.*)$")
TEST_REF = re.compile(r"`tests/([\w/]+\.py)::(\w+)(\[[^\]`]*\])?`")


def _bare(tp: Any) -> Any:
    """The type inside Annotated[...] and Optional[...]."""
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
        else:
            return tp


def _nested(tp: Any) -> tuple[type[BaseModel], str] | None:
    """The model a field holds (with "[]" for a list of them), or None for a leaf."""
    tp = _bare(tp)
    suffix = ""
    if typing.get_origin(tp) is list:
        tp, suffix = _bare(typing.get_args(tp)[0]), "[]"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp, suffix
    return None


def leaf_paths(model: type[BaseModel], prefix: str = "spec") -> Iterator[str]:
    """Every leaf field path of `model` as users write it, e.g. spec.teachers[].inference.engine."""
    for name, info in model.model_fields.items():
        path = f"{prefix}.{info.alias or name}"
        nested = _nested(info.annotation)
        if nested is None:
            yield path
        else:
            inner, suffix = nested
            yield from leaf_paths(inner, path + suffix)


def _rows() -> list[tuple[str, str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows.append((m.group(1), m.group(2)))
    return rows


def test_leaf_paths_walk_nested_models_lists_and_optionals() -> None:
    paths = list(leaf_paths(DistillationJobSpec))
    assert len(paths) == len(set(paths))
    for expected in (
        "spec.mode",  # a plain field
        "spec.async.oversample",  # an optional model under its alias
        "spec.teachers[].inference.kvCacheGiB",  # a list of models; an explicit alias
        "spec.teachers[].overrides.env[].valueFrom",  # a list inside a list
        "spec.trainer.lora.targetModules",  # an optional model; a list of strings is a leaf
        "spec.affinity",  # a free-form Kubernetes object is a leaf
    ):
        assert expected in paths, expected
    assert "spec.teachers" not in paths and "spec.trainer.lora" not in paths


def test_every_leaf_field_has_exactly_one_row_and_every_row_a_field() -> None:
    fields = set(leaf_paths(DistillationJobSpec))
    rows = Counter(path for path, _ in _rows())
    assert sorted(f for f in fields if f not in rows) == [], "fields without a row in docs/fields.md"
    assert sorted(p for p in rows if p not in fields) == [], "rows of docs/fields.md naming no field"
    assert sorted(p for p, n in rows.items() if n > 1) == [], "fields with more than one row"


def test_every_row_cites_a_test_and_every_cited_test_exists() -> None:
    missing: list[str] = []
    for path, rest in _rows():
        refs = TEST_REF.findall(rest)
        if not refs:
            missing.append(f"{path}: cites no test")
        for file, name, _param in refs:
            source = ROOT / "tests" / file
            if not source.is_file():
                missing.append(f"{path}: tests/{file} does not exist")
            elif not re.search(rf"^(async )?def {name}\(", source.read_text(), re.MULTILINE):
                missing.append(f"{path}: tests/{file} has no test {name}")
    assert missing == []
