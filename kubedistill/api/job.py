"""The whole DistillationJob object and the API identity (group, version, names)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kubedistill.api.rules import NAME_MAX
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.api.status import DistillationJobStatus

GROUP = "kubedistill.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DistillationJob"
PLURAL = "distillationjobs"
SINGULAR = "distillationjob"
SHORT_NAMES = ["dj", "distjob"]

_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class ObjectMeta(BaseModel):
    """The parts of metadata kubedistill reads; the rest passes through untouched."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: Annotated[str, Field(min_length=1)]
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _dns_label(cls, v: str) -> str:
        # Same messages as NAME_RULES' CEL (kubedistill.api.rules).
        if len(v) > NAME_MAX:
            raise ValueError(
                f"must be at most {NAME_MAX} characters (pod and service names add role, teacher and index)"
            )
        if not _NAME.match(v):
            raise ValueError("must be a DNS label starting with a letter (lowercase letters, digits, '-')")
        return v


class DistillationJob(BaseModel):
    """A DistillationJob manifest."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: Literal["kubedistill.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["DistillationJob"]
    metadata: ObjectMeta
    spec: DistillationJobSpec
    status: DistillationJobStatus | None = None

    def to_api(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": self.metadata.model_dump(exclude_none=True, exclude_defaults=True),
            "spec": self.spec.to_api(),
        }
        out["metadata"]["name"] = self.metadata.name
        if self.status is not None:
            out["status"] = self.status.to_api()
        return out
