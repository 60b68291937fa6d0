"""YAML as the API server reads it (YAML 1.1 in Go), held against the real kubectl binary.

A real API server refused the CRD and every example because `n:` is the boolean false to Go's
YAML reader and the string "n" to PyYAML. These tests keep that class of bug out: the project's
reader (kubedistill.api.kubeyaml) must agree with kubectl on tricky scalars; every YAML file the
project ships must mean the same to PyYAML, to that reader and to kubectl; no API name, enum
value or default may be a string Go reads as something else; and every field a CEL rule or a
fieldPath names must exist in the schema as the API server reads the committed CRD.
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from k8s_offline import cel_field_errors, crd_schema, helm, kubectl_read
from kubedistill.api import kubeyaml
from kubedistill.api.spec import DistillationJobSpec

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(
    [
        *ROOT.glob("crds/*.yaml"),
        *ROOT.glob("examples/*.yaml"),
        *ROOT.glob("helm/kubedistill/crds/*.yaml"),
        *ROOT.glob("helm/kubedistill/ci/*.yaml"),
        ROOT / "helm/kubedistill/values.yaml",
        ROOT / "helm/kubedistill/Chart.yaml",
        *(p for p in ROOT.glob("tests/manifests/**/*.yaml") if p.name != "bad-yaml.yaml"),
    ]
)
DOCS = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]

# Scalars on which Go's YAML 1.1 and PyYAML disagree, or nearly do.
TRICKY = [
    "y",
    "Y",
    "n",
    "N",
    "yes",
    "No",
    "ON",
    "off",
    "True",
    "FALSE",
    "1e3",
    "1.0e5",
    "-.5e-3",
    ".5",
    "1.",
    "0o17",
    "0777",
    "08",
    "0b101",
    "-0b11",
    "0x1f",
    "1_000",
    "0.1_5",
    "_1",
    "+1",
    "-0",
    "1:20",
    "2001-12-14",
    "2001-12-14T21:59:43.10-05:00",
    "=",
    "~",
    "null",
    "12e",
    "0x",
    "1e400",
    "9223372036854775807",
    "18446744073709551616",
    "yes please",
    "3.14",
    "'n'",
    '"y"',
    "''",
]


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: Go prints numbers its own way (1e3 -> 1000)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-15)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_reader_reads_scalars_and_keys_as_kubectl_does() -> None:
    body = "\n".join(f"  v{i}: {s}" for i, s in enumerate(TRICKY))
    keys = "\n".join(f"  {k}: {i}" for i, k in enumerate(["n", "y", "2", "1.5", "0x10", "plain"]))
    text = f"apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: probe}}\ndata:\n{body}\nkeys:\n{keys}\n"
    (ours,) = kubeyaml.load_all(text)
    (go,) = kubectl_read(text)
    for i, scalar in enumerate(TRICKY):
        assert _same(ours["data"][f"v{i}"], go["data"][f"v{i}"]), (scalar, ours["data"][f"v{i}"], go["data"][f"v{i}"])
    assert ours["keys"] == go["keys"] == {"false": 0, "true": 1, "2": 2, "1.5": 3, "16": 4, "plain": 5}


def test_dumper_quotes_what_either_reader_would_misread() -> None:
    values = {s: s for s in TRICKY} | {"int": 3, "float": 1.0e-6, "bool": True, "none": None}
    text = kubeyaml.dump(values)
    assert kubeyaml.load(text) == {k: v for k, v in values.items()}
    assert yaml.safe_load(text) == values
    (go,) = kubectl_read(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: probe}\ndata:\n"
        + "".join(f"  {line}\n" for line in text.splitlines())
    )
    assert _same(go["data"], values)


def _yaml_blocks(path: Path) -> Iterator[tuple[str, str]]:
    for i, m in enumerate(re.finditer(r"```yaml\n(.*?)```", path.read_text(), re.S)):
        yield f"{path.relative_to(ROOT)} block {i + 1}", m.group(1)


def _shipped_texts() -> Iterator[tuple[str, str]]:
    for p in SHIPPED:
        yield str(p.relative_to(ROOT)), p.read_text()
    for doc in DOCS:
        yield from _yaml_blocks(doc)
    for values in ("", str(ROOT / "helm/kubedistill/ci/full-values.yaml")):
        args = ["template", "kd", str(ROOT / "helm/kubedistill"), "--include-crds"]
        args += ["-f", values] if values else []
        yield f"helm template {values or '(defaults)'}", helm(*args)


def test_every_shipped_yaml_means_the_same_to_pyyaml_and_to_go() -> None:
    checked = 0
    for where, text in _shipped_texts():
        ours = kubeyaml.load_all(text)
        assert ours == [d for d in yaml.safe_load_all(text) if d is not None], f"{where}: PyYAML reads it differently"
        objects = [d for d in ours if isinstance(d, dict) and "kind" in d and "apiVersion" in d]
        if objects and len(objects) == len(ours):
            assert _same(kubectl_read(text), ours), f"{where}: kubectl reads it differently"
            checked += 1
    assert checked >= 8  # the CRDs, the examples, the broken manifests, the rendered chart


def _models(model: type[BaseModel], seen: set[type]) -> Iterator[type[BaseModel]]:
    if model in seen:
        return
    seen.add(model)
    yield model
    for info in model.model_fields.values():
        for tp in _types(info.annotation):
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                yield from _models(tp, seen)


def _types(tp: Any) -> Iterator[Any]:
    yield tp
    for arg in typing.get_args(tp):
        yield from _types(arg)


def test_no_api_name_value_or_default_is_read_as_another_type() -> None:
    """Over what users write (the spec). The status is written by the operator as JSON, and its
    condition statuses "True"/"False" are Kubernetes' own convention."""
    strings: set[str] = set()
    for model in _models(DistillationJobSpec, set()):
        for name, info in model.model_fields.items():
            strings.add(info.alias or name)
            for tp in _types(info.annotation):
                if isinstance(tp, type) and issubclass(tp, Enum):
                    strings.update(str(e.value) for e in tp)
            if isinstance(info.default, str) and info.default:
                strings.add(info.default)
    assert "samplesPerPrompt" in strings and "fullyAsync" in strings
    misread = {s: kubeyaml.go_scalar(s) for s in strings if kubeyaml.go_scalar(s) != s}
    misread |= {s: v for s in strings if (v := yaml.safe_load(f"k: {s}")["k"]) != s}
    assert not misread, f"API strings that a bare YAML scalar would turn into another type: {misread}"


def test_cel_rules_and_field_paths_name_fields_of_the_schema_as_go_reads_it() -> None:
    schema = crd_schema()
    assert cel_field_errors(schema) == []
    # The checker itself: the bug it guards against.
    spec = schema["properties"]["spec"]
    broken = {
        **spec,
        "x-kubernetes-validations": [
            {"rule": "self.rollout.sampling.n >= 2", "message": "m", "fieldPath": ".rollout.sampling.n"},
            {"rule": "self.teachers.all(t, has(t.nope))", "message": "m"},
        ],
    }
    assert cel_field_errors({"type": "object", "properties": {"spec": broken}}) == [
        "spec: rule 'self.rollout.sampling.n >= 2': no field 'n' in .rollout.sampling",
        "spec: fieldPath '.rollout.sampling.n': no field 'n' in .rollout.sampling",
        "spec: rule 'self.teachers.all(t, has(t.nope))': no field 'nope' in .teachers[]",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")),
        "a: " + "[" * 100 + "]" * 100 + "\n",
    ],
    ids=["billion-laughs", "deep-nesting"],
)
def test_hostile_shapes_are_refused_before_they_are_built(text: str) -> None:
    with pytest.raises(kubeyaml.ManifestError):
        kubeyaml.load_all(text)
