"""A rollout server's membership of the trainer's weight-sync group, one epoch at a time.

The trainer (re)forms the group on every start — also after its gang was restarted while this
server kept running — and tells each rollout server `POST /weights/group {epoch}`. Switching to a
new epoch, in order, one switch at a time:

1. break a weight receive still blocked on the old group (its trainer is gone) and wait for that
   sync task to end, so no thread is inside the old group when it is released;
2. release the old group (communicators, sockets, store connection): a long-lived server that
   sees many trainer restarts holds one group at most;
3. join the new group (the trainer's rendezvous is waiting for every member).

A newer epoch arriving mid-switch supersedes the older one: the older switch ends at its next
step, and the newer one tears down whatever it left.

Step 1 is an abort, not a wait for a timeout: every wait on the group polls an abort flag (gloo's
own abort does not release a blocked collective), and on NCCL the communicators are aborted so
the GPU kernels still waiting for the dead trainer end too. If that abort cannot complete (a hung
ncclCommAbort, a transfer that does not return), the engine is wedged: the server exits with
EXIT_WEDGED, its pod fails and is replaced, and the trainer's next sync brings the new server into
its group."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from kubedistill.runtime.engines.base import Engine
from kubedistill.runtime.weight_sync.group import GroupAddress, GroupWedged
from kubedistill.runtime.wire.protocol import WeightsGroupResponse

log = logging.getLogger("kubedistill.rollout")

SYNC_DRAIN_SECONDS = 60.0
"""How long a switch waits for a sync on the old group to end before releasing the group anyway."""

EXIT_WEDGED = 70
"""The server's exit code when its engine is wedged in a broken weight-sync group (EX_SOFTWARE):
non-zero, so the operator replaces the pod (a failed server pod is recreated alone)."""


def exit_wedged(reason: str) -> None:
    """Leave at once: the engine holds GPU state only a new process frees, and a graceful
    shutdown would wait on the very worker that is stuck."""
    log.critical("the engine is wedged in a broken weight-sync group (%s); exiting so it is replaced", reason)
    logging.shutdown()
    os._exit(EXIT_WEDGED)


class WeightGroupMembership:
    def __init__(
        self,
        engine: Engine,
        address: Callable[[str], GroupAddress],
        current_sync: Callable[[], asyncio.Task[None] | None],
        on_wedged: Callable[[str], None] = exit_wedged,
    ):
        self.engine = engine
        self.on_wedged = on_wedged
        self.address = address
        self.current_sync = current_sync
        self.epoch: str | None = None
        self.error: str | None = None
        self.switches = 0
        """Completed joins (for /weights/group and tests)."""
        self._task: asyncio.Task[None] | None = None

    def status(self) -> WeightsGroupResponse:
        state = self.engine.weight_group_state
        if self.epoch is not None and self.switching:
            state = "joining"
        return WeightsGroupResponse(
            epoch=self.epoch,
            state=state,
            error=self.error,
            dtype=self.engine.weight_dtype(),
            in_place=self.engine.receives_in_place(),
            delta_base=self.engine.delta_base,
            served_at_load=self.engine.serves_at_load(),
        )

    @property
    def switching(self) -> bool:
        return self._task is not None and not self._task.done()

    def switch(self, epoch: str) -> None:
        """Start moving to group `epoch` (returns at once). Re-sending the current epoch while it
        is joining or formed is a no-op, so a trainer may retry its request."""
        if epoch == self.epoch and (self.switching or self.engine.weight_group_state == "ready"):
            return
        self.epoch, self.error = epoch, None
        previous = self._task
        self._task = asyncio.create_task(self._switch(epoch, previous))

    async def wait_switched(self, timeout: float) -> None:
        """Wait for a switch in progress (a sync may arrive a moment before this side of the
        rendezvous has returned)."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait_for(asyncio.shield(task), timeout)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        await self.engine.leave_weight_group()

    async def _switch(self, epoch: str, previous: asyncio.Task[None] | None) -> None:
        if previous is not None and not previous.done():
            self.engine.abort_weight_group()  # the previous switch may be waiting on a sync
            await asyncio.gather(previous, return_exceptions=True)
        if self.epoch != epoch:
            return
        self.engine.abort_weight_group()
        sync = self.current_sync()
        if sync is not None and not sync.done():
            try:
                await asyncio.wait_for(asyncio.shield(sync), SYNC_DRAIN_SECONDS)
            except TimeoutError:
                log.warning(
                    "a weight sync on the old group is still blocked after %.0f s; releasing the group",
                    SYNC_DRAIN_SECONDS,
                )
            except Exception:
                pass  # its failure is recorded by the sync task itself
        try:
            await self.engine.leave_weight_group()
        except GroupWedged as e:
            self.error = f"{type(e).__name__}: {e}"
            self.on_wedged(str(e))
            return
        if self.epoch != epoch:
            return
        log.info("joining weight-sync group epoch %s", epoch)
        try:
            await self.engine.join_weight_group(self.address(epoch))
        except Exception as e:  # reported by GET /weights/group and /health; /weights/begin refuses
            if self.epoch == epoch:
                self.error = f"{type(e).__name__}: {e}"
            log.error("joining weight-sync group epoch %s failed: %s", epoch, e)
            return
        self.switches += 1
        log.info("joined weight-sync group epoch %s", epoch)
