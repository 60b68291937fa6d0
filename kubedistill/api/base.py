"""Shared building blocks for the DistillationJob API models.

Every API model derives from :class:`ApiModel`: camelCase aliases (the YAML a user writes),
snake_case attributes (the Python that reads it), unknown fields refused, and attribute
docstrings turned into field descriptions so they reach the CRD and ``kubectl explain``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# Marker for free-form Kubernetes objects (tolerations, affinity, volumes, env vars...).
# They are validated by the API server against the core schemas when the pods are created,
# so the CRD keeps them with x-kubernetes-preserve-unknown-fields instead of copying those
# schemas here.
FREE_FORM = "kubedistill-free-form"
FreeForm = Annotated[dict[str, Any], Field(json_schema_extra={FREE_FORM: True})]

LIST_MAP_KEYS = "kubedistill-list-map-keys"


def keyed_by(*keys: str) -> dict[str, Any]:
    """`json_schema_extra` of a list whose items are identified by `keys`: the CRD marks it
    x-kubernetes-list-type map, so server-side apply merges items by key (two managers may own
    different teachers) instead of replacing the list. Every other list is atomic."""
    return {LIST_MAP_KEYS: list(keys)}


def unique_names(items: list[Any]) -> list[Any]:
    """Refuse two items of one name, as the API server refuses a duplicate key of a map list."""
    seen: set[str] = set()
    for item in items:
        if item.name in seen:
            raise ValueError(f"names must be unique: {item.name!r} appears twice")
        seen.add(item.name)
    return items


# The largest integer any API field may take; every integer field is bounded by it (or less), so
# pydantic and the CRD refuse the same values. Unbounded, they did not: the API server holds an
# int64 and refuses 2^63 and above, which a Python int takes (tests/test_k8s_api_server.py).
# 2^53 - 1 is exact in float64, which is how the API server holds a schema's bounds and how JSON
# tools read numbers: the server refuses a CRD whose bound 2^63 - 1 (it rounds to 2^63, not an
# int64) sits over a default.
MAX_SAFE_INT = 2**53 - 1

# Kubernetes DNS-1035 label: what Service names (and so teacher names) must be.
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )

    def to_api(self) -> dict[str, Any]:
        """The object as a user would write it: camelCase keys, unset optionals omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
