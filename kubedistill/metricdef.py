"""One metric's definition, shared by the runtime's and the operator's metric tables (so the
chart's tests can list every exported name from data, not from scraping)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: type
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    prefix: str = "kubedistill_"
    roles: tuple[str, ...] = ()
    """The processes that export it (runtime roles); empty: every process that uses the table."""

    @property
    def full_name(self) -> str:
        return f"{self.prefix}{self.name}"
