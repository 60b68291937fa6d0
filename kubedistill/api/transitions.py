"""The DistillationJob's transition rules (CEL over self and oldSelf, checked by the API server
on updates only), derived from the spec models: a new field of an immutable part is covered. Apart
from kubedistill.api.rules, which the spec imports to check itself."""

from __future__ import annotations

from kubedistill.api.rules import IMMUTABLE_SPEC_FIELDS, KUEUE_FIXED_SIZE_MESSAGE, ROLLOUT_MUTABLE, Rule
from kubedistill.api.spec import DistillationJobSpec, RolloutSpec


def _rollout_transition_rules() -> list[Rule]:
    """Every spec.rollout field but ROLLOUT_MUTABLE is immutable: `self == oldSelf` on the field,
    and where the field is optional without a default (absent unless set, e.g. gpus), a presence
    check on spec.rollout, since a transition rule on the field itself runs only when both the old
    and the new object have it. Derived from RolloutSpec, so a new field is covered."""
    out: list[Rule] = []
    for name, info in RolloutSpec.model_fields.items():
        key = info.alias or name
        if key in ROLLOUT_MUTABLE:
            continue
        only = "only spec.rollout.replicas may change on a running job; delete and recreate the job to change it"
        out.append(Rule(f"spec.rollout.{key}", "self == oldSelf", f"spec.rollout.{key} is immutable: {only}"))
        if info.default is None and info.default_factory is None:
            out.append(
                Rule(
                    "spec.rollout",
                    f"has(self.{key}) == has(oldSelf.{key})",
                    f"spec.rollout.{key} cannot be added or removed: {only}",
                    f".{key}",
                )
            )
    return out


def _optional_immutable_rules() -> list[Rule]:
    """An optional immutable spec field without a default (e.g. async) cannot be added or
    removed either: its own `self == oldSelf` runs only when both objects have it."""
    out: list[Rule] = []
    for name, info in DistillationJobSpec.model_fields.items():
        key = info.alias or name
        if key in IMMUTABLE_SPEC_FIELDS and info.default is None and info.default_factory is None:
            out.append(
                Rule(
                    "spec",
                    f"has(self.{key}) == has(oldSelf.{key})",
                    f"spec.{key} cannot be added or removed; delete and recreate the job to change it",
                    f".{key}",
                )
            )
    return out


TRANSITION_RULES: list[Rule] = [
    # Kueue admits a plain pod group whose size every pod's annotation names: a pod beyond it
    # would never be admitted, and fewer pods would leave the group unfinished.
    Rule(
        "spec",
        "self.scheduling.gangScheduler != 'kueue' || self.rollout.replicas == oldSelf.rollout.replicas",
        KUEUE_FIXED_SIZE_MESSAGE,
        ".rollout.replicas",
    ),
    *_rollout_transition_rules(),
    *_optional_immutable_rules(),
]
"""Rules on updates (CEL over self and oldSelf), checked by the API server only: besides the
`self == oldSelf` of IMMUTABLE_SPEC_FIELDS."""
