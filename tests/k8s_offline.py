"""What the Kubernetes API server does with a custom resource, done offline for tests:
structural defaulting, strict OpenAPI schema validation (fieldValidation=Strict) and CEL rules."""

from __future__ import annotations

import copy
from typing import Any, Iterator

import celpy
import jsonschema


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


def cel_violations(
    obj: Any, schema: dict[str, Any], old: Any = None, path: str = ""
) -> Iterator[tuple[str, str]]:
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
