"""YAML read and written the way kubectl and the Kubernetes API server read it.

kubectl and the API server turn YAML into JSON with Go (sigs.k8s.io/yaml, on go-yaml v2). Its
plain scalars follow YAML 1.1 as Go implements it, which differs from PyYAML's SafeLoader:

  * a bare ``y``, ``Y``, ``n`` or ``N`` is a boolean (PyYAML: a string), as are yes/no/on/off;
  * integers are Go literals: ``0o17`` and ``0b101`` are numbers, ``1:20`` is a string
    (PyYAML: string, number, and the sexagesimal 80);
  * a float needs no dot: ``1e3`` is 1000 (PyYAML: the string "1e3");
  * timestamps stay strings (PyYAML: datetime objects);
  * every mapping key becomes a JSON string, so ``n: 4`` is the key "false".

``KubeLoader`` is PyYAML's libyaml loader with Go's scalar resolution swapped in, so what
``kubedistill validate`` reads is what the API server receives; ``KubeDumper`` quotes every
string Go would read as something else. ``tests/test_kube_yaml.py`` checks both against the
real kubectl binary. ``load_documents`` adds the bounds a manifest reader needs (size, nesting
depth, alias expansion) so hostile input is refused in one line instead of exhausting memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml
from yaml.resolver import BaseResolver

if TYPE_CHECKING:
    # The stubs declare libyaml's classes whether or not PyYAML was built with it; the pure-Python
    # classes offer the same constructor and resolver methods, all this module uses.
    from yaml import CSafeDumper as _DumperBase
    from yaml import CSafeLoader as _LoaderBase
else:
    # libyaml's parser and emitter when PyYAML was built with it: several times faster.
    _LoaderBase = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    _DumperBase = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

STR = "tag:yaml.org,2002:str"
INT = "tag:yaml.org,2002:int"
FLOAT = "tag:yaml.org,2002:float"
BOOL = "tag:yaml.org,2002:bool"
NULL = "tag:yaml.org,2002:null"
MERGE = "tag:yaml.org,2002:merge"

# go-yaml v2 resolve.go's table of special plain scalars.
_BOOLS = {
    **dict.fromkeys(("y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"), True),
    **dict.fromkeys(("n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"), False),
}
_NULLS = frozenset(("", "~", "null", "Null", "NULL"))
_SPECIAL_FLOATS = {
    **dict.fromkeys((".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"), math.inf),
    **dict.fromkeys(("-.inf", "-.Inf", "-.INF"), -math.inf),
    **dict.fromkeys((".nan", ".NaN", ".NAN"), math.nan),
}
# strconv.ParseInt(s, 0, 64)'s syntax (after go-yaml drops every '_').
_GO_INT = re.compile(r"([-+]?)(0[xX][0-9a-fA-F]+|0[oO][0-7]+|0[bB][01]+|0[0-7]*|[1-9][0-9]*)")
# go-yaml's yamlStyleFloat: what it hands to strconv.ParseFloat.
_GO_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_INT64_MIN, _INT64_MAX, _UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1


def _go_int(plain: str) -> int | None:
    m = _GO_INT.fullmatch(plain)
    if m is None:
        return None
    sign, digits = m.groups()
    if len(digits) > 1 and digits[0] == "0" and digits[1] in "01234567":
        value = int(digits, 8)  # Go's leading-zero octal, which Python's int(x, 0) refuses
    else:
        value = int(digits, 0)
    value = -value if sign == "-" else value
    if _INT64_MIN <= value <= _INT64_MAX or (not sign and value <= _UINT64_MAX):
        return value
    return None


def _go_float(plain: str) -> float | None:
    if not _GO_FLOAT.fullmatch(plain):
        return None
    value = float(plain)
    return value if math.isfinite(value) else None  # ParseFloat's range error: Go keeps the string


def _as_json_number(value: float) -> int | float:
    """The number the API server holds after its JSON decoding: int64 when integral, else float."""
    if value.is_integer() and _INT64_MIN < value < _INT64_MAX:
        return int(value)
    return value


def _resolve(text: str) -> tuple[str, Any]:
    """(tag, value) go-yaml v2 gives a plain (unquoted, untagged) scalar decoded into JSON."""
    if text in _NULLS:
        return NULL, None
    if text in _BOOLS:
        return BOOL, _BOOLS[text]
    if text in _SPECIAL_FLOATS:
        return FLOAT, _SPECIAL_FLOATS[text]
    if text[0] not in "+-0123456789.":
        return STR, text
    plain = text.replace("_", "")
    number = _go_int(plain)
    if number is not None:
        return INT, number if number <= _INT64_MAX else float(number)
    real = _go_float(plain)
    if real is None:
        return STR, text  # timestamps too: decoded into JSON, Go keeps them as strings
    return FLOAT, _as_json_number(real)


def go_scalar(text: str) -> Any:
    """The value kubectl and the API server read from a plain scalar."""
    return _resolve(text)[1]


def json_key(key: Any) -> str:
    """A mapping key as sigs.k8s.io/yaml writes it into JSON."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        return "true" if key else "false"
    if key is None:
        raise yaml.constructor.ConstructorError(None, None, "a mapping key is null (kubectl refuses it)")
    if isinstance(key, float) and key.is_integer():
        return str(int(key))
    return str(key)


def _pyyaml_tag(resolver: BaseResolver, kind: Any, value: Any, implicit: Any) -> str:
    """The tag PyYAML's own (YAML 1.1) resolution gives a node."""
    # types-PyYAML leaves BaseResolver.resolve unannotated; it returns the tag string.
    tag: str = BaseResolver.resolve(resolver, kind, value, implicit)  # type: ignore[no-untyped-call]
    return tag


class _GoResolution(BaseResolver):
    """Plain scalars resolve as go-yaml v2 resolves them; quoted ones stay strings.

    A mixin placed before PyYAML's loader or dumper class (whose resolver it replaces)."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        if kind is yaml.ScalarNode and implicit[0]:
            if value == "<<":
                return MERGE
            return _resolve(value)[0]
        return _pyyaml_tag(self, kind, value, implicit)


class KubeLoader(_GoResolution, _LoaderBase):
    """PyYAML's safe loader (libyaml when present) reading scalars and keys as kubectl does."""

    def construct_go_scalar(self, node: yaml.ScalarNode) -> Any:
        return go_scalar(self.construct_scalar(node))

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        """Every key as the string sigs.k8s.io/yaml makes of it."""
        raw = super().construct_mapping(node, deep=deep)
        return {json_key(k): v for k, v in raw.items()}


for _tag in (INT, FLOAT, BOOL, NULL):
    KubeLoader.add_constructor(_tag, KubeLoader.construct_go_scalar)


class KubeDumper(_GoResolution, _DumperBase):
    """PyYAML's safe dumper that quotes every string kubectl would read as another type, and
    every string PyYAML would (``1:20``, dates), so the output means one thing to both."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        tag = super().resolve(kind, value, implicit)
        if tag == STR and kind is yaml.ScalarNode and implicit[0]:
            return _pyyaml_tag(self, kind, value, implicit)
        return tag


def dump(data: Any, *, sort_keys: bool = True, width: int | None = None) -> str:
    return yaml.dump(data, Dumper=KubeDumper, sort_keys=sort_keys, width=width)


def dump_all(docs: list[Any], *, sort_keys: bool = True, width: int | None = None) -> str:
    return yaml.dump_all(docs, Dumper=KubeDumper, sort_keys=sort_keys, width=width)


# -- bounded reading of untrusted manifests ---------------------------------------------------

MAX_BYTES = 3 * 1024 * 1024
"""The API server's request-body limit (3 MiB): no larger manifest can be applied."""
MAX_DEPTH = 64
"""Nesting levels; the deepest real field (affinity terms) is about 10 levels down."""
MAX_NODES = 100_000
"""Values in one file after expanding aliases; a large real manifest has a few thousand."""


class ManifestError(ValueError):
    """A file that cannot be read as a manifest; the message is one line for the user."""


@dataclass(frozen=True)
class Limits:
    max_bytes: int = MAX_BYTES
    max_depth: int = MAX_DEPTH
    max_nodes: int = MAX_NODES


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"invalid YAML: {where}{problem}"


def _at(ev: yaml.Event) -> str:
    """(line N) where the parser saw the event; it marks every event it emits."""
    return f" (line {ev.start_mark.line + 1})" if ev.start_mark is not None else ""


def check_shape(text: str, limits: Limits = Limits()) -> None:
    """Refuse, from libyaml's event stream and before anything is built, a document nested
    deeper than max_depth or whose aliases expand past max_nodes (a "billion laughs")."""
    depth = 0
    nodes = 0
    anchored: dict[str, int] = {}
    open_at: list[tuple[int, str | None]] = []
    try:
        for ev in yaml.parse(text, Loader=KubeLoader):
            if isinstance(ev, yaml.AliasEvent):
                nodes += anchored.get(ev.anchor, 1) if ev.anchor is not None else 1
            elif isinstance(ev, yaml.ScalarEvent):
                nodes += 1
                if ev.anchor:
                    anchored[ev.anchor] = 1
            elif isinstance(ev, yaml.CollectionStartEvent):
                nodes += 1
                depth += 1
                open_at.append((nodes, ev.anchor))
                if depth > limits.max_depth:
                    raise ManifestError(
                        f"nested more than {limits.max_depth} levels deep{_at(ev)}; no manifest field is that deep"
                    )
            elif isinstance(ev, yaml.CollectionEndEvent):
                depth -= 1
                start, anchor = open_at.pop()
                if anchor:
                    anchored[anchor] = nodes - start + 1
            if nodes > limits.max_nodes:
                raise ManifestError(
                    f"more than {limits.max_nodes} values once aliases are expanded{_at(ev)}; a manifest is far smaller"
                )
    except yaml.YAMLError as exc:
        raise ManifestError(_yaml_problem(exc)) from None


def decode(data: bytes, limits: Limits = Limits()) -> str:
    if len(data) > limits.max_bytes:
        raise ManifestError(
            f"{len(data)} bytes; a manifest may be at most {limits.max_bytes} bytes "
            f"({limits.max_bytes // (1024 * 1024)} MiB, the API server's request limit)"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def load_all(text: str, limits: Limits = Limits()) -> list[Any]:
    """The non-empty documents of a YAML stream as kubectl reads them, within `limits`."""
    check_shape(text, limits)
    try:
        return [d for d in yaml.load_all(text, Loader=KubeLoader) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(_yaml_problem(exc)) from None


def load(text: str) -> Any:
    """One trusted document (the project's own files) as kubectl reads it."""
    return yaml.load(text, Loader=KubeLoader)
