"""JSON schemas of the two PodGroup kinds the operator renders, written from each project's
published API types (kubernetes-validate knows only the built-in kinds):

* Volcano, scheduling.volcano.sh/v1beta1 PodGroupSpec: minMember, minTaskMember, queue,
  priorityClassName, minResources, networkTopology;
* scheduler-plugins (coscheduling), scheduling.x-k8s.io/v1alpha1 PodGroupSpec: minMember,
  minResources, scheduleTimeoutSeconds.

Unknown fields are refused, as the API server's strict field validation would."""

from __future__ import annotations

from typing import Any

import jsonschema

# Kubernetes resource.Quantity as the API server parses it.
QUANTITY = {
    "type": "string",
    "pattern": (
        r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
        r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
    ),
}
RESOURCE_LIST = {"type": "object", "additionalProperties": QUANTITY}
INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string", "maxLength": 253},
        "namespace": {"type": "string"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
        "ownerReferences": {"type": "array"},
    },
}


def _pod_group(api_version: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": "PodGroup"},
            "metadata": _META,
            "spec": {"type": "object", "additionalProperties": False, "properties": spec},
        },
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "scheduling.volcano.sh/v1beta1": _pod_group(
        "scheduling.volcano.sh/v1beta1",
        {
            "minMember": INT32,
            "minTaskMember": {"type": "object", "additionalProperties": INT32},
            "queue": {"type": "string"},
            "priorityClassName": {"type": "string"},
            "minResources": RESOURCE_LIST,
            "networkTopology": {"type": "object"},
        },
    ),
    "scheduling.x-k8s.io/v1alpha1": _pod_group(
        "scheduling.x-k8s.io/v1alpha1",
        {"minMember": INT32, "minResources": RESOURCE_LIST, "scheduleTimeoutSeconds": INT32},
    ),
}


def pod_group_errors(doc: dict[str, Any]) -> list[str]:
    """Violations of a PodGroup against its project's API, one line each."""
    schema = SCHEMAS.get(doc.get("apiVersion", ""))
    if schema is None or doc.get("kind") != "PodGroup":
        return [f"no PodGroup schema for {doc.get('apiVersion')}/{doc.get('kind')}"]
    v = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]
