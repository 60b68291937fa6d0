"""Which server gets a request: TeacherRouter (sample -> teacher -> endpoint) and EndpointPool
(least-outstanding-requests balancing over a role's replicas). I/O-free: they pick a base URL;
the HTTP clients (runtime/driver/clients.py) send the request, and the driver releases the URL
when it ends.

Failure accounting, per endpoint: the driver reports each request's outcome (`succeeded`,
`failed` on a transport error). MAX_TRANSPORT_FAILURES failures in a row take an endpoint out of
rotation while another one still takes requests; the driver probes it and `restore`s it once it
answers. When none would be left, `failed` raises AllEndpointsDown instead.

    router = TeacherRouter(spec, config.endpoints.teachers)
    name, url = router.acquire(sample.route_value)
    try:
        scores = await clients[url].score(request)
    finally:
        router.release(name, url)

Images and text teachers. A sample whose prompt has images (a vision-language student's image
row) is scored with its images, so its teacher must read images; a text teacher never gets one,
and the driver never strips the images to make it fit: the sample's ids hold the student
processor's image pads, which a text teacher would score as text, with no picture behind them
(a distillation signal for another prompt than the student's). That holds for a *mixed* row too,
one with images and text whose data_source routes to a text teacher: it is refused, not scored
on its text. To train on such rows with a text teacher, drop their images in the data (the
student then does not see them either), or route them to a vision-language teacher.

How the driver knows: `reads_images` maps each teacher to whether its model reads images, from
its model directory's config.json (a `vision_config`; runtime/driver/multimodal.py
`reads_images`), which trainer rank 0 can read since every pod of a job mounts the same volumes.
Before the run starts, the driver checks every image row of the data against its teacher
(`refuse_images`): a text teacher fails the job in one line naming the data_source and the
teacher, before any server does work. A teacher whose config the trainer cannot read is
unknown (None): its image samples are sent, and a server that refuses them as text-only (a 400
whose message says "text-only", as both engines word it) fails the run with the same message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubedistill.api.spec import DistillationJobSpec

MAX_TRANSPORT_FAILURES = 5
"""Transport failures in a row (connection refused or dropped) that take an endpoint out of rotation."""


class AllEndpointsDown(RuntimeError):
    """An endpoint failed MAX_TRANSPORT_FAILURES times in a row and no other one takes requests."""


class ImagesToTextTeacher(ValueError):
    """A sample with images is routed to a teacher whose model reads no images."""


def images_to_text_teacher(data_source: str, teacher: str, why: str, where: str = "") -> str:
    """The one-line refusal of image samples routed to a text teacher."""
    at = f" ({where})" if where else ""
    return (
        f"data_source {data_source!r} has images but is routed to teacher {teacher!r}, {why}{at}: a text teacher "
        "cannot score an image sample and the driver does not strip images; route this data_source to a "
        "vision-language teacher (spec.teachers[].match.dataSource) or drop the images from its rows"
    )


@dataclass
class _Endpoint:
    url: str
    outstanding: int = 0
    assigned: int = 0
    draining: bool = False
    failures: int = 0
    """Transport failures in a row: a success resets it."""
    out_of_rotation: bool = False
    """Taken out after too many failures in a row, until `restore`."""

    @property
    def serving(self) -> bool:
        return not self.draining and not self.out_of_rotation


class EndpointPool:
    """Base URLs of one role's replicas; `acquire` picks, among those serving, the one with the
    fewest requests in flight (ties: the one given the fewest requests so far, then the lowest
    index). While the job scales, endpoints are added, and removed in two steps: `drain` (no new
    requests; those in flight go on) and `remove` once none is left in flight. An endpoint that
    fails `max_failures` times in a row is out of rotation until `restore`."""

    def __init__(self, name: str, urls: Sequence[str], max_failures: int = MAX_TRANSPORT_FAILURES):
        if not urls:
            raise ValueError(f"{name}: no endpoints (need at least one base URL)")
        if len(set(urls)) != len(urls):
            raise ValueError(f"{name}: duplicate endpoints in {list(urls)}")
        if max_failures < 1:
            raise ValueError(f"{name}: max_failures must be >= 1, got {max_failures}")
        self.name = name
        self.max_failures = max_failures
        self._endpoints = [_Endpoint(u) for u in urls]
        self._by_url = {e.url: e for e in self._endpoints}

    @property
    def urls(self) -> list[str]:
        """Every endpoint, draining and out-of-rotation ones included."""
        return [e.url for e in self._endpoints]

    def serving(self) -> list[str]:
        """The endpoints that take new requests."""
        return [e.url for e in self._endpoints if e.serving]

    def out_of_rotation(self) -> list[str]:
        return [e.url for e in self._endpoints if e.out_of_rotation]

    def add(self, url: str) -> None:
        if url in self._by_url:
            raise ValueError(f"{self.name}: {url} is already an endpoint")
        e = _Endpoint(url, assigned=min((x.assigned for x in self._endpoints), default=0))
        self._endpoints.append(e)
        self._by_url[url] = e

    def drain(self, url: str) -> None:
        """No new requests go to `url`; at least one other endpoint must still take them."""
        e = self._get(url)
        if not any(x is not e and x.serving for x in self._endpoints):
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
        serving = [e for e in self._endpoints if e.serving]
        if not serving:  # `failed` and `drain` never leave none: a caller's bug
            raise AllEndpointsDown(f"{self.name}: no endpoint takes requests ({self._states()})")
        best = min(serving, key=lambda e: (e.outstanding, e.assigned))
        best.outstanding += 1
        best.assigned += 1
        return best.url

    def release(self, url: str) -> None:
        e = self._get(url)
        if e.outstanding == 0:
            raise ValueError(f"{self.name}: release of {url} without a matching acquire")
        e.outstanding -= 1

    def succeeded(self, url: str) -> None:
        """A request to `url` was answered: its failures in a row start again from zero."""
        self._get(url).failures = 0

    def failed(self, url: str) -> bool:
        """A request to `url` failed in transport. Returns True if this took `url` out of rotation
        (its `max_failures`-th failure in a row). Raises AllEndpointsDown instead when no other
        endpoint takes requests: a role with none left cannot go on."""
        e = self._get(url)
        e.failures += 1
        if e.out_of_rotation or e.failures < self.max_failures:
            return False
        if not any(x is not e and x.serving for x in self._endpoints):
            raise AllEndpointsDown(
                f"{self.name}: {url} failed {e.failures} times in a row and no other endpoint takes requests "
                f"({self._states()})"
            )
        e.out_of_rotation = True
        return True

    def restore(self, url: str) -> None:
        """Put an endpoint taken out of rotation back (it answers again). It is given requests as
        if it had been busy all along, so it does not take every new one until it catches up."""
        e = self._get(url)
        e.out_of_rotation = False
        e.failures = 0
        e.assigned = max(e.assigned, min((x.assigned for x in self._endpoints if x.serving and x is not e), default=0))

    def _states(self) -> str:
        """Each endpoint's state, for error messages."""

        def state(e: _Endpoint) -> str:
            what = "out of rotation" if e.out_of_rotation else "draining" if e.draining else "serving"
            return f"{what}, {e.failures} failures in a row" if e.failures else what

        return "; ".join(f"{e.url}: {state(e)}" for e in self._endpoints)

    def _get(self, url: str) -> _Endpoint:
        try:
            return self._by_url[url]
        except KeyError:
            raise ValueError(f"{self.name}: unknown endpoint {url!r} (known: {self.urls})") from None


class TeacherRouter:
    """Sends each sample to the teacher whose `match` covers its routing-key value
    (spec.routing.key, `data_source` by default), then to that teacher's least busy replica."""

    def __init__(
        self,
        spec: DistillationJobSpec,
        teacher_endpoints: Mapping[str, Sequence[str]],
        reads_images: Mapping[str, bool | None] | None = None,
    ):
        """`reads_images`: per teacher name, whether its model reads images (None or absent:
        unknown; see the module docstring)."""
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
        self.reads_images: dict[str, bool | None] = {n: (reads_images or {}).get(n) for n in names}
        self._models = {t.name: str(t.model) for t in spec.teachers}

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

    def refuse_images(self, route_value: Any, data_source: str, where: str = "") -> None:
        """Raise ImagesToTextTeacher if a sample with images and this routing-key value would
        reach a teacher known to read no images (an unknown one passes)."""
        name = self.teacher_for(route_value)
        if self.reads_images[name] is False:
            why = f"whose model {self._models[name]} is text-only (its config.json has no vision_config)"
            raise ImagesToTextTeacher(images_to_text_teacher(data_source, name, why, where))
