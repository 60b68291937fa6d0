"""The servers the driver talks to, while the job runs: the rollout servers it follows as the job
scales (admit a new one once healthy, drain one no longer wanted) and the probing of a server of
either role taken out of rotation after transport failures. The bookkeeping is I/O-free
(runtime/driver/membership.py, runtime/driver/routing.py); this module does the waiting and the
HTTP it asks for, as tasks the driver spawns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kubedistill.api.progress import TrainerProgress
from kubedistill.runtime.driver.clients import RolloutClientLike, ServerClients, TeacherClientLike
from kubedistill.runtime.driver.membership import RolloutMembership
from kubedistill.runtime.driver.routing import AllEndpointsDown, EndpointPool
from kubedistill.runtime.wire.http import until_healthy

log = logging.getLogger("kubedistill.driver")

ROLLOUT_POLL_SECONDS = 2.0
"""How often the driver re-reads the rollout servers the job wants, and re-probes a new one."""
PROBE_SECONDS = 2.0
"""How often the driver checks /health of a server out of rotation."""
PROBE_TIMEOUT_SECONDS = 10.0
"""A probe's wait for /health: a connect to a vanished pod's address may hang far longer."""

Spawn = Callable[[Coroutine[Any, Any, None], str], None]
"""Runs a background task of the driver's (an error in it ends the run)."""


@dataclass
class Fleet:
    """The rollout pool and membership, every server's client, and the tasks that change them."""

    pool: EndpointPool
    rollouts: RolloutMembership
    status: TrainerProgress
    """Its rollout_servers follow the membership (GET /status)."""
    spawn: Spawn
    leave_group: Callable[[str], Awaitable[None]]
    """Takes a drained server out of the weight-sync group (on the trainer's thread)."""
    version: Callable[[], int]
    """The weight version the rollout servers should serve now."""
    partial_rollout: bool
    rollout_source: Callable[[], list[str]] | None = None
    """The rollout servers the job wants now (the re-read config's endpoints.rollout). None: the
    servers it started with, for good."""
    rollout_poll_seconds: float = ROLLOUT_POLL_SECONDS
    probe_seconds: float = PROBE_SECONDS
    servers: ServerClients | None = None
    """Makes a client for a server that joins; set when the run starts."""
    rollout: dict[str, RolloutClientLike] = field(default_factory=dict)
    teacher: dict[str, TeacherClientLike] = field(default_factory=dict)

    # ---- rollout servers joining and leaving -------------------------------------------------
    async def follow_rollouts(self) -> None:
        """Follow the desired rollout servers while the job runs (it scales): admit new ones,
        drain the ones no longer wanted. A config that cannot be read keeps the current set."""
        assert self.rollout_source is not None
        failing: str | None = None
        while True:
            try:
                desired = await asyncio.to_thread(self.rollout_source)
                admit, drain = self.rollouts.update(desired)
                failing = None
            except Exception as e:
                message = f"{type(e).__name__}: {e}"
                if message != failing:
                    log.warning("cannot read the wanted rollout servers (%s); keeping %s", message, self.pool.urls)
                failing, admit, drain = message, [], []
            for url in admit:
                log.info("rollout server %s wanted: it joins once healthy, at the next weight sync", url)
                self.spawn(self.admit(url), "admitting a rollout server")
            for url in drain:
                log.info("rollout server %s no longer wanted: draining it", url)
                self.spawn(self.drain(url), "draining a rollout server")
            # /status follows here only: a server let go stays listed until the next poll, which
            # only delays its pod's deletion.
            self.status.rollout_servers = self.rollouts.held()
            await asyncio.sleep(self.rollout_poll_seconds)

    async def admit(self, url: str) -> None:
        """Wait until a new server answers /health (its engine is loaded), then mark it ready:
        the next weight sync takes it into the group, and the pool after that sync."""
        assert self.servers is not None, "rollout servers are admitted while the driver runs"
        client = self.servers.rollout(url)

        def let_go() -> bool:
            return not self.rollouts.wanted(url)

        if await until_healthy(client.health, every=self.rollout_poll_seconds, give_up=let_go) is None:
            return
        self.rollout[url] = client
        if self.rollouts.healthy(url):
            log.info("rollout server %s is healthy: it joins the weight-sync group at the next sync", url)

    def joined(self, urls: list[str], version: int) -> None:
        """The sync that re-formed the group with `urls` succeeded: they take requests now."""
        if not urls:
            return
        self.rollouts.joined(urls)
        for url in urls:
            self.pool.add(url)
        log.info("rollout servers %s joined at weight version %d; now %d", urls, version, len(self.pool.urls))

    async def drain(self, url: str) -> None:
        """No new requests to `url`; the ones in flight finish there, or, with partial rollouts,
        are aborted and resumed on the other servers (their tokens kept). Then it leaves the
        group's next epoch and the driver lets it go."""
        while not any(u != url for u in self.pool.serving()):
            await asyncio.sleep(self.rollout_poll_seconds)  # never drain the last server taking requests
        self.pool.drain(url)
        in_flight = self.pool.outstanding(url)
        if in_flight and self.partial_rollout:
            try:
                await self.rollout[url].abort()
            except Exception as e:  # it may be gone already: its requests fail over as transport errors
                log.warning("abort on draining %s: %r", url, e)
        while self.pool.outstanding(url):
            await asyncio.sleep(0.05)
        await self.leave_group(url)
        self.pool.remove(url)
        self.rollouts.drained(url)
        self.rollout.pop(url, None)
        log.info("rollout server %s drained (%d requests were in flight) and let go", url, in_flight)

    # ---- servers out of rotation ---------------------------------------------------------------
    def transport_failure(self, pool: EndpointPool, url: str, what: str, e: Exception) -> None:
        """Count a failed connection against `url`. Too many in a row take it out of rotation and
        start probing it, unless none of its role would be left: then the run fails (a server that
        stays down needs its pod replaced)."""
        try:
            taken_out = pool.failed(url)
        except AllEndpointsDown as down:
            raise AllEndpointsDown(f"{what}: {e!r}; {down}") from e
        if not taken_out:
            log.warning("%s: %r; retrying", what, e)
            return
        log.warning(
            "%s: %r; %d failures in a row: %s is out of rotation until it answers /health (serving: %s)",
            what,
            e,
            pool.max_failures,
            url,
            pool.serving(),
        )
        self.spawn(self.bring_back(pool, url), f"probing {url}")

    async def bring_back(self, pool: EndpointPool, url: str) -> None:
        """Probe a server out of rotation every probe_seconds; put it back once /health answers.
        A rollout server must also serve the current weights: a replaced pod starts with its
        initial ones, and the next sync (which re-forms the group with it) brings it up to date.
        Ends as well when the server is drained and let go meanwhile.

        The probe's deadline is asyncio.timeout, not asyncio.wait_for: on Python 3.11, a task
        cancelled by the end of the run just as wait_for's /health is refused gets that refusal
        instead of its CancelledError (wait_for returns the inner result when both are ready), and
        the `except` below would swallow it: the probe would go on forever and the run's end,
        which waits for its background tasks, would hang."""
        rollout = pool is self.pool
        client: RolloutClientLike | TeacherClientLike = self.rollout[url] if rollout else self.teacher[url]
        told_stale = False
        while url in pool.out_of_rotation():
            await asyncio.sleep(self.probe_seconds)
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_SECONDS):
                    health = await client.health()
            except Exception:  # refused, no answer, or 503 while its engine loads (never a cancellation)
                continue
            if url not in pool.out_of_rotation():
                return
            version = self.version()
            if rollout and health.version < version:
                if not told_stale:
                    log.info(
                        "%s answers again but serves weight version %d, not %d: back in rotation after the next sync",
                        url,
                        health.version,
                        version,
                    )
                    told_stale = True
                continue
            pool.restore(url)
            log.info("%s answers /health again: back in rotation", url)
