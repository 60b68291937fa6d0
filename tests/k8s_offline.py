"""What the Kubernetes API server does with a custom resource, done offline for tests:
reading YAML as Go does, structural defaulting, strict OpenAPI schema validation
(fieldValidation=Strict), CEL rules and the field names they may use.

Manifests and the CRD are read with kubedistill.api.kubeyaml (Go's YAML 1.1, checked against
the real kubectl in test_kube_yaml.py), never with PyYAML's own rules: a bare `n:` is the key
"false" to the API server."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
from celpy.celparser import CELParser
from lark import Token, Tree

from kubedistill.api import kubeyaml

ROOT = Path(__file__).resolve().parent.parent
CRD_FILE = ROOT / "crds" / "kubedistill.io_distillationjobs.yaml"


def read_manifest(path: Path) -> Any:
    """The single document of a manifest file, as the API server receives it."""
    (doc,) = kubeyaml.load_all(path.read_text())
    return doc


def crd_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the committed CRD, as the API server reads the file."""
    crd = read_manifest(CRD_FILE)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def tool(name: str) -> str:
    """helm or kubectl (Go binaries from scripts/install-helm.sh, at .venv/tools)."""
    local = ROOT / ".venv" / "tools" / name
    found = str(local) if local.exists() else shutil.which(name)
    assert found, f"{name} not found: run `bash scripts/install-helm.sh` (scripts/install.sh does)"
    return found


def helm(*args: str) -> str:
    r = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"helm {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


PROBE_ANNOTATION = "kubedistill.io/probe"


def kubectl_read(text: str) -> list[Any]:
    """The objects of a YAML stream as the real kubectl reads them (Go's YAML, no server):
    `kubectl annotate --local` prints what it parsed; the probe annotation is removed again."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        r = subprocess.run(
            [tool("kubectl"), "annotate", "--local", "-f", f.name, f"{PROBE_ANNOTATION}=1", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"KUBECONFIG": "/dev/null", "PATH": "/usr/bin:/bin"},
        )
    assert r.returncode == 0, f"kubectl could not read it: {r.stderr}"
    items: list[Any] = []
    decoder, at = json.JSONDecoder(), 0
    while r.stdout[at:].strip():  # one JSON object per document, back to back
        obj, at = decoder.raw_decode(r.stdout, at + len(r.stdout[at:]) - len(r.stdout[at:].lstrip()))
        items.extend(obj["items"] if obj.get("kind") == "List" and "items" in obj else [obj])
    for item in items:
        meta = item["metadata"]
        meta["annotations"].pop(PROBE_ANNOTATION)
        if not meta["annotations"]:
            del meta["annotations"]
    return items


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Structural defaulting: fill absent properties that have a default, recursively."""
    value = copy.deepcopy(value)
    _default(value, schema)
    return value


def _default(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, prop in schema.get("properties", {}).items():
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
            if key in value:
                _default(value[key], prop)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for v in value.values():
                _default(v, extra)
    elif isinstance(value, list) and "items" in schema:
        for v in value:
            _default(v, schema["items"])


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The openAPIV3Schema as JSON Schema draft 4, refusing unknown fields like kubectl's
    default fieldValidation=Strict (draft 4 shares OpenAPI 3.0's boolean exclusiveMinimum)."""
    out = {k: strict_schema(v) if isinstance(v, dict) else v for k, v in schema.items()}
    if "items" in out:
        out["items"] = strict_schema(schema["items"])
    if "properties" in schema:
        out["properties"] = {k: strict_schema(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(strict_schema(schema))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


_env = celpy.Environment()
_programs: dict[str, Any] = {}


def _evaluate(rule: str, self_value: Any, old_value: Any = None) -> bool:
    if rule not in _programs:
        _programs[rule] = _env.program(_env.compile(rule))
    activation = {"self": celpy.json_to_cel(self_value)}
    if old_value is not None:
        activation["oldSelf"] = celpy.json_to_cel(old_value)
    result = _programs[rule].evaluate(activation)
    if isinstance(result, Exception):
        raise result
    return bool(result)


def cel_violations(obj: Any, schema: dict[str, Any], old: Any = None, path: str = "") -> Iterator[tuple[str, str]]:
    """(field path, message) of every x-kubernetes-validations rule that fails, as the API
    server would report them (transition rules only when `old` is given)."""
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        if not _evaluate(rule["rule"], obj, old if transition else None):
            yield (path + rule.get("fieldPath", ""), rule["message"])
    if isinstance(obj, dict):
        for key, prop in schema.get("properties", {}).items():
            if key in obj:
                sub_old = old.get(key) if isinstance(old, dict) else None
                yield from cel_violations(obj[key], prop, sub_old, f"{path}.{key}" if path else key)
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            yield from cel_violations(item, schema["items"], None, f"{path}[{i}]")


# -- CEL field names ---------------------------------------------------------------------------

_MACROS = {"all", "exists", "exists_one", "map", "filter"}
_parser = CELParser()


def cel_field_errors(schema: dict[str, Any], path: str = "") -> list[str]:
    """Every field a CEL rule or fieldPath names that the schema lacks, as the API server's
    type check reports it at CRD creation ("undefined field 'n'", "must be a valid path")."""
    out: list[str] = []
    where = path.lstrip(".") or "<root>"
    for rule in schema.get("x-kubernetes-validations", []):
        for problem in _CelFields(schema).check(_parser.parse(rule["rule"])):
            out.append(f"{where}: rule {rule['rule']!r}: {problem}")
        field_path = rule.get("fieldPath")
        if field_path:
            node: dict[str, Any] | None = schema
            walked = ""
            for part in field_path.lstrip(".").split("."):
                node, problem = _field(node, part, walked)
                if problem:
                    out.append(f"{where}: fieldPath {field_path!r}: {problem}")
                    break
                walked += f".{part}"
    for key, prop in schema.get("properties", {}).items():
        out += cel_field_errors(prop, f"{path}.{key}")
    if "items" in schema:
        out += cel_field_errors(schema["items"], f"{path}[]")
    return out


def _field(node: dict[str, Any] | None, name: str, walked: str) -> tuple[dict[str, Any] | None, str]:
    """The schema of field `name` of `node` (None: unknown, not checked) and any problem."""
    if node is None or node.get("x-kubernetes-preserve-unknown-fields"):
        return None, ""
    if isinstance(node.get("additionalProperties"), dict):
        return node["additionalProperties"], ""
    props = node.get("properties")
    if props is None:
        return None, ""
    if name not in props:
        return None, f"no field {name!r} in {walked or '<self>'}"
    return props[name], ""


class _CelFields:
    """Walks a parsed CEL expression, typing `self`, its fields and macro variables by schema."""

    def __init__(self, root: dict[str, Any]):
        self.root = root
        self.problems: list[str] = []

    def check(self, tree: Tree) -> list[str]:
        self._walk(tree, {"self": (self.root, "")})
        return self.problems

    def _walk(self, tree: Any, env: dict[str, tuple[dict[str, Any] | None, str]]) -> None:
        if not isinstance(tree, Tree):
            return
        if tree.data in ("member_dot", "member_dot_arg", "primary", "member"):
            self._typed(tree, env)
            return
        for child in tree.children:
            self._walk(child, env)

    def _typed(self, tree: Tree, env: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """(schema, path) of a member expression, checking every field it selects."""
        if tree.data in ("member", "primary") and len(tree.children) == 1:
            child = tree.children[0]
            if isinstance(child, Tree):
                if child.data == "ident":
                    return env.get(str(child.children[0]), (None, ""))
                if child.data in ("member_dot", "member_dot_arg", "primary", "member"):
                    return self._typed(child, env)
                self._walk(child, env)
            return None, ""
        if tree.data == "member_dot":
            receiver, name = tree.children
            node, walked = self._typed(receiver, env)
            found, problem = _field(node, str(name), walked)
            if problem:
                self.problems.append(problem)
            return found, f"{walked}.{name}"
        if tree.data == "member_dot_arg":
            receiver, method, *args = tree.children
            node, walked = self._typed(receiver, env)
            exprs = args[0].children if args and isinstance(args[0], Tree) else []
            if str(method) in _MACROS and len(exprs) >= 2:
                var = _ident(exprs[0])
                items = node.get("items") if node else None
                for e in exprs[1:]:
                    self._walk(e, {**env, var: (items, f"{walked}[]")} if var else env)
            else:
                for e in exprs:
                    self._walk(e, env)
            return None, ""
        for child in tree.children:
            self._walk(child, env)
        return None, ""


def _ident(tree: Any) -> str | None:
    """The name of an expression that is a bare identifier (a macro's variable)."""
    while isinstance(tree, Tree):
        if tree.data == "ident":
            return str(tree.children[0])
        if len(tree.children) != 1:
            return None
        tree = tree.children[0]
    return str(tree) if isinstance(tree, Token) else None
