"""Which server gets a request: TeacherRouter (sample -> teacher -> endpoint) and EndpointPool
(least-outstanding-requests balancing over a role's replicas). I/O-free: they pick a base URL;
the HTTP clients (runtime/driver/clients.py) send the request and release the lease when it ends.

    router = TeacherRouter(spec, config.endpoints.teachers)
    with router.lease(sample.route_value) as (teacher, url):
        scores = await teacher_client.score(url, ...)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kubedistill.api.spec import DistillationJobSpec


@dataclass
class _Endpoint:
    url: str
    outstanding: int = 0
    assigned: int = 0
    draining: bool = False


class EndpointPool:
    """Base URLs of one role's replicas; `acquire` picks the one with the fewest requests in
    flight (ties: the one given the fewest requests so far, then the lowest index). While the job
    scales, endpoints are added, and removed in two steps: `drain` (no new requests; those in
    flight go on) and `remove` once none is left in flight."""

    def __init__(self, name: str, urls: Sequence[str]):
        if not urls:
            raise ValueError(f"{name}: no endpoints (need at least one base URL)")
        if len(set(urls)) != len(urls):
            raise ValueError(f"{name}: duplicate endpoints in {list(urls)}")
        self.name = name
        self._endpoints = [_Endpoint(u) for u in urls]
        self._by_url = {e.url: e for e in self._endpoints}

    @property
    def urls(self) -> list[str]:
        """Every endpoint, draining ones included."""
        return [e.url for e in self._endpoints]

    def add(self, url: str) -> None:
        if url in self._by_url:
            raise ValueError(f"{self.name}: {url} is already an endpoint")
        e = _Endpoint(url, assigned=min((x.assigned for x in self._endpoints), default=0))
        self._endpoints.append(e)
        self._by_url[url] = e

    def drain(self, url: str) -> None:
        """No new requests go to `url`; at least one other endpoint must still take them."""
        e = self._get(url)
        if not any(x is not e and not x.draining for x in self._endpoints):
            raise ValueError(f"{self.name}: cannot drain {url}, the last endpoint taking requests")
        e.draining = True

    def remove(self, url: str) -> None:
        e = self._get(url)
        if not e.draining or e.outstanding:
            raise ValueError(f"{self.name}: remove {url} only once drained ({e.outstanding} requests in flight)")
        self._endpoints.remove(e)
        del self._by_url[url]

    def outstanding(self, url: str | None = None) -> int:
        """Requests in flight on one endpoint, or on the whole pool."""
        if url is None:
            return sum(e.outstanding for e in self._endpoints)
        return self._get(url).outstanding

    def acquire(self) -> str:
        best = min((e for e in self._endpoints if not e.draining), key=lambda e: (e.outstanding, e.assigned))
        best.outstanding += 1
        best.assigned += 1
        return best.url

    def release(self, url: str) -> None:
        e = self._get(url)
        if e.outstanding == 0:
            raise ValueError(f"{self.name}: release of {url} without a matching acquire")
        e.outstanding -= 1

    @contextmanager
    def lease(self) -> Iterator[str]:
        url = self.acquire()
        try:
            yield url
        finally:
            self.release(url)

    def _get(self, url: str) -> _Endpoint:
        try:
            return self._by_url[url]
        except KeyError:
            raise ValueError(f"{self.name}: unknown endpoint {url!r} (known: {self.urls})") from None


class TeacherRouter:
    """Sends each sample to the teacher whose `match` covers its routing-key value
    (spec.routing.key, `data_source` by default), then to that teacher's least busy replica."""

    def __init__(self, spec: DistillationJobSpec, teacher_endpoints: Mapping[str, Sequence[str]]):
        names = [t.name for t in spec.teachers]
        unknown = sorted(set(teacher_endpoints) - set(names))
        if unknown:
            raise ValueError(f"endpoints.teachers names unknown teachers {unknown}; spec.teachers are {names}")
        missing = [n for n in names if not teacher_endpoints.get(n)]
        if missing:
            raise ValueError(f"endpoints.teachers has no base URL for teachers {missing}")
        self.spec = spec
        self.key = spec.routing.key
        self.pools = {n: EndpointPool(f"teacher {n}", list(teacher_endpoints[n])) for n in names}

    def route_value(self, row: Mapping[str, Any]) -> str:
        """The routing-key value of a data row (a clear error if the row lacks the key)."""
        if self.key not in row:
            raise KeyError(f"data row has no column {self.key!r} (spec.routing.key); columns: {sorted(row)}")
        return str(row[self.key])

    def teacher_for(self, route_value: Any) -> str:
        """Name of the teacher that scores samples with this routing-key value."""
        return self.spec.teacher_for(route_value).name

    def acquire(self, route_value: Any) -> tuple[str, str]:
        """(teacher name, base URL) for one scoring request; release the URL when it ends."""
        name = self.teacher_for(route_value)
        return name, self.pools[name].acquire()

    def release(self, teacher: str, url: str) -> None:
        self.pools[teacher].release(url)

    @contextmanager
    def lease(self, route_value: Any) -> Iterator[tuple[str, str]]:
        name, url = self.acquire(route_value)
        try:
            yield name, url
        finally:
            self.release(name, url)
