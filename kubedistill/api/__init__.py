"""The DistillationJob API (kubedistill.io/v1alpha1): pydantic models, rules, CRD, validation."""

from kubedistill.api.job import API_VERSION, GROUP, KIND, PLURAL, VERSION, DistillationJob
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.api.status import DistillationJobStatus, Phase

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "DistillationJob",
    "DistillationJobSpec",
    "DistillationJobStatus",
    "Phase",
]
