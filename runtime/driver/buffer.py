"""The driver's SampleBuffer: groups in flight and groups ready to train on, under the staleness
rule of kubedistill.runtime.driver.staleness.

The generation side calls `await reserve(group)` before starting a group (it waits while the
staleness bound or the in-flight cap would be exceeded), mutates the group's samples as results
come back (telling `sample_finished()` when one is generated), and calls `await put(group)` once
the group is generated and scored.
The trainer side calls `await take()` for the next step's samples. The weight-sync code calls
`await synced(version)` after every sync: the bound's count restarts at what is buffered or in
flight, and buffered groups now too stale are dropped. No network, no clock: asyncio only.

`state_dict()` holds every group generated but not yet trained on *and* every group in flight
(with the tokens generated so far), so a checkpoint taken with the PromptSource cursor loses and
repeats no prompt: after `load_state_dict()` the driver resubmits `in_flight_groups()`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kubedistill.runtime.driver.samples import SampleGroup
from kubedistill.runtime.driver.staleness import StalenessPolicy, version_lag

if TYPE_CHECKING:
    from kubedistill.runtime.metrics import RoleMetrics

STATE_FORMAT = 1
COUNTERS = ("generated", "consumed", "dropped_stale", "resumed")


class BufferClosed(RuntimeError):
    """The buffer was closed (the job is ending) while a caller waited on it."""


class SampleBuffer:
    def __init__(self, staleness_policy: StalenessPolicy, metrics: RoleMetrics | None = None, version: int = 0):
        self.staleness_policy = staleness_policy
        self.metrics = metrics
        """None in tests that read the counters directly."""
        self.version = version
        """Weight version of the last sync: the trainer's version for the staleness rule."""
        self.stale_count = 0
        """Samples counted against the bound: buffered/in flight at the last sync + submitted since."""
        self.counters: dict[str, int] = {k: 0 for k in COUNTERS}
        self._ready: list[SampleGroup] = []
        self._in_flight: dict[int, SampleGroup] = {}
        # Samples in each, kept as they change: the waits' predicates read them at every wake-up
        # (a finished sample wakes them), where a sum over the groups grew with the buffer.
        self._ready_samples = 0
        self._in_flight_samples = 0
        self._arrivals = 0
        self._closed = False
        self._cond = asyncio.Condition()
        if metrics is not None:
            # Every state's series from the start, at 0: a job that never drops a stale sample
            # shows a stale-drop rate of 0 on the dashboard, not "No data" (a series that does
            # not exist until its first increment; found on a real Prometheus).
            for state in COUNTERS:
                metrics["samples"].labels(state=state)

    # ---- what the driver reads -------------------------------------------------------------
    @property
    def buffered(self) -> int:
        """Samples ready to train on."""
        return self._ready_samples

    @property
    def in_flight(self) -> int:
        """Samples generating (or being scored)."""
        return self._in_flight_samples

    @property
    def generating(self) -> int:
        """Samples of in-flight groups not yet finished (generating, or aborted to be resumed)."""
        return sum(1 for g in self._in_flight.values() for s in g.samples if not s.finished)

    @property
    def capped(self) -> int:
        """What the in-flight cap counts: generating samples (fullyAsync) or every in-flight one."""
        return self.generating if self.staleness_policy.cap_counts_generating else self.in_flight

    def in_flight_groups(self) -> list[SampleGroup]:
        return list(self._in_flight.values())

    def ready_groups(self) -> list[SampleGroup]:
        return list(self._ready)

    # ---- generation side -------------------------------------------------------------------
    def try_reserve(self, group: SampleGroup) -> bool:
        """Register `group` as in flight if the staleness rule allows it now."""
        self._check_open()
        if group.group_id in self._in_flight:
            raise ValueError(f"group {group.group_id} is already in flight")
        if not self._may_submit(len(group)):
            return False
        self._add_in_flight(group)
        self.stale_count += len(group)
        return True

    async def reserve(self, group: SampleGroup) -> None:
        """Wait until the staleness rule lets `group` start, then register it as in flight."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed or self._may_submit(len(group)))
            self.try_reserve(group)

    async def sample_finished(self) -> None:
        """A sample of an in-flight group finished generating: under fullyAsync's cap that frees a
        place for new work before its group is complete."""
        if self.staleness_policy.cap_counts_generating:
            async with self._cond:
                self._cond.notify_all()

    async def put(self, group: SampleGroup) -> bool:
        """A generated (and scored) group is ready. Returns False if it was dropped as too stale."""
        async with self._cond:
            self._take_in_flight(group.group_id)
            if not group.finished:
                self._add_in_flight(group)
                raise ValueError(
                    f"group {group.group_id} is not finished: finish reasons {[s.finish_reason for s in group.samples]}"
                )
            self._count("generated", len(group))
            self._count("resumed", sum(s.resumed for s in group.samples))
            if self._too_stale(group):
                self._count("dropped_stale", len(group))
                kept = False
            else:
                group.arrival = self._arrivals
                self._arrivals += 1
                self._ready.append(group)
                self._ready_samples += len(group)
                kept = True
            self._gauge()
            self._cond.notify_all()
            return kept

    # ---- trainer side ----------------------------------------------------------------------
    async def take(self, samples: int | None = None) -> list[SampleGroup]:
        """Wait for and remove the next step's groups (`staleness_policy.required` samples by default).

        Oldest weight version first (then arrival order), so the stalest usable samples are
        trained on before they expire. Raises BufferClosed if the buffer closes first."""
        want = self.staleness_policy.required if samples is None else samples
        if want % self.staleness_policy.group_size:
            raise ValueError(f"take({want}): must be a multiple of the group size {self.staleness_policy.group_size}")
        async with self._cond:
            # Once, not at every wake-up: only a sync (which drops them itself) or a restored state
            # makes ready groups too stale, and `put` refuses the ones that arrive too stale.
            self._drop_stale()
            while self.buffered < want:
                if self._closed:
                    raise BufferClosed(f"buffer closed with {self.buffered} of {want} samples ready")
                await self._cond.wait()
            self._ready.sort(key=lambda g: (_oldest(g, self.version), g.arrival))
            taken, total = [], 0
            while total < want:
                g = self._ready.pop(0)
                taken.append(g)
                total += len(g)
            self._ready_samples -= total
            self._count("consumed", total)
            if self.metrics is not None:
                hist = self.metrics["staleness"]
                for g in taken:
                    for s in g.samples:
                        hist.observe(version_lag(self.version, _oldest_sample(s.min_version, self.version)))
            self._gauge()
            self._cond.notify_all()
            return taken

    # ---- weight sync -----------------------------------------------------------------------
    async def synced(self, version: int) -> int:
        """Weights of `version` are on the rollout servers. Restarts the bound's count at what is
        buffered or in flight, drops buffered groups now too stale; returns samples dropped."""
        if version < self.version:
            raise ValueError(f"weight version went back from {self.version} to {version}")
        async with self._cond:
            self.version = version
            dropped = self._drop_stale()
            self.stale_count = self.buffered + self.in_flight
            self._gauge()
            self._cond.notify_all()
            return dropped

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "version": self.version,
            "stale_count": self.stale_count,
            "arrivals": self._arrivals,
            "counters": dict(self.counters),
            "ready": [g.to_dict() for g in self._ready],
            "in_flight": [g.to_dict() for g in self._in_flight.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"buffer state format {state.get('format')!r} is not {STATE_FORMAT}")
        self.version = int(state["version"])
        self.stale_count = int(state["stale_count"])
        self._arrivals = int(state["arrivals"])
        self.counters = {k: int(state["counters"].get(k, 0)) for k in COUNTERS}
        self._ready = [SampleGroup.from_dict(g) for g in state["ready"]]
        self._ready_samples = sum(len(g) for g in self._ready)
        self._in_flight, self._in_flight_samples = {}, 0
        for d in state["in_flight"]:
            self._add_in_flight(SampleGroup.from_dict(d))
        self._gauge()

    def to_bytes(self) -> bytes:
        import msgpack

        packed: bytes = msgpack.packb(self.state_dict(), use_bin_type=True)
        return packed

    def load_bytes(self, data: bytes) -> None:
        import msgpack

        self.load_state_dict(msgpack.unpackb(data, raw=False, strict_map_key=False))

    # ---- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosed("buffer is closed")

    def _may_submit(self, group_size: int) -> bool:
        """The staleness rule for one more group. The bound's own count is checked first: while it
        holds the group back, the cap's count (under fullyAsync, a scan of the samples in flight)
        is not needed."""
        policy = self.staleness_policy
        if not policy.may_submit(self.stale_count, 0, group_size):
            return False
        return policy.may_submit(self.stale_count, self.capped, group_size)

    def _add_in_flight(self, group: SampleGroup) -> None:
        self._in_flight[group.group_id] = group
        self._in_flight_samples += len(group)

    def _take_in_flight(self, group_id: int) -> SampleGroup:
        try:
            group = self._in_flight.pop(group_id)
        except KeyError:
            raise ValueError(f"group {group_id} is not in flight (reserve it first)") from None
        self._in_flight_samples -= len(group)
        return group

    def _too_stale(self, group: SampleGroup) -> bool:
        return self.staleness_policy.is_too_stale(self.version, _oldest(group, self.version))

    def _drop_stale(self) -> int:
        keep = [g for g in self._ready if not self._too_stale(g)]
        dropped = self.buffered - sum(len(g) for g in keep)
        if dropped:
            self._ready = keep
            self._ready_samples -= dropped
            self._count("dropped_stale", dropped)
        return dropped

    def _count(self, state: str, n: int) -> None:
        if n <= 0:
            return
        self.counters[state] += n
        if self.metrics is not None:
            self.metrics["samples"].labels(state=state).inc(n)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics["buffer_size"].set(self.buffered)


def _oldest_sample(min_version: int | None, current: int) -> int:
    # A sample with no tokens yet has no version; it cannot be stale.
    return current if min_version is None else min_version


def _oldest(group: SampleGroup, current: int) -> int:
    return _oldest_sample(group.min_version, current)
