"""The order of a rollout server's group switches (runtime/servers/weight_group.py), against a
recording engine: a switch waits for the sync on the old group, releases the old group before
joining the new one, and switches run one at a time with the newest epoch winning."""

from __future__ import annotations

import asyncio

from kubedistill.runtime.servers.weight_group import WeightGroupMembership
from kubedistill.runtime.weight_sync.group import GroupAddress


class RecordingEngine:
    """Only the membership calls of an Engine. A join waits in its rendezvous until `rendezvous`
    is set, which a test holds back to act while one is in progress (set from the start unless
    told otherwise); `in_rendezvous` is set once a join is waiting there. A join fails with
    `join_error` while it is set."""

    def __init__(self, rendezvous_open: bool = True) -> None:
        self.calls: list[str] = []
        self.weight_group_state = "none"
        self.delta_base = None
        self.rendezvous = asyncio.Event()
        if rendezvous_open:
            self.rendezvous.set()
        self.in_rendezvous = asyncio.Event()
        self.join_error: Exception | None = None

    def weight_dtype(self) -> str | None:
        return "bfloat16"

    def receives_in_place(self) -> bool:
        return False

    def serves_at_load(self) -> bool:
        return False

    def abort_weight_group(self) -> None:
        self.calls.append("abort")

    async def leave_weight_group(self) -> None:
        self.calls.append("leave")
        self.weight_group_state = "none"

    async def join_weight_group(self, addr: GroupAddress) -> None:
        if self.join_error is not None:
            self.weight_group_state = "failed"
            raise self.join_error
        self.calls.append(f"join {addr.epoch}")
        self.weight_group_state = "joining"
        self.in_rendezvous.set()
        await self.rendezvous.wait()
        self.calls.append(f"joined {addr.epoch}")
        self.weight_group_state = "ready"


def _membership(engine: RecordingEngine, sync: dict) -> WeightGroupMembership:
    return WeightGroupMembership(
        engine, lambda epoch: GroupAddress("127.0.0.1", 1, 1, 2, "gloo", 5, epoch), lambda: sync.get("task")
    )


async def test_switch_waits_for_the_old_sync_then_leaves_then_joins() -> None:
    engine, sync = RecordingEngine(), {}
    m = _membership(engine, sync)

    async def old_sync() -> None:
        await asyncio.sleep(0.1)
        engine.calls.append("old sync ended")

    sync["task"] = asyncio.create_task(old_sync())
    m.switch("e1")
    assert m.status().state == "joining" and m.status().epoch == "e1"
    await m.wait_switched(5)
    assert engine.calls == ["abort", "old sync ended", "leave", "join e1", "joined e1"]
    assert m.status().model_dump() == {
        "epoch": "e1",
        "state": "ready",
        "error": None,
        "dtype": "bfloat16",
        "in_place": False,
        "delta_base": None,
        "served_at_load": False,
    }
    m.switch("e1")  # the trainer retrying its request: nothing to do
    assert not m.switching and m.switches == 1


async def test_a_newer_epoch_supersedes_one_still_joining() -> None:
    engine = RecordingEngine(rendezvous_open=False)
    m = _membership(engine, {})
    m.switch("e1")
    await asyncio.wait_for(engine.in_rendezvous.wait(), 5)  # e1 is in its rendezvous
    m.switch("e2")
    m.switch("e3")
    engine.rendezvous.set()  # the trainer's side arrives: e1's join completes
    await m.wait_switched(5)
    # e1's join completes first (one switch at a time), e2 never starts, e3 releases e1's group
    assert [c for c in engine.calls if c != "abort"] == [
        "leave",
        "join e1",
        "joined e1",
        "leave",
        "join e3",
        "joined e3",
    ]
    assert m.status().epoch == "e3" and m.status().state == "ready"


async def test_a_failed_join_is_reported_and_the_same_epoch_can_retry() -> None:
    engine = RecordingEngine()
    engine.join_error = TimeoutError("rendezvous timed out")
    m = _membership(engine, {})
    m.switch("e1")
    await m.wait_switched(5)
    assert m.status().model_dump() == {
        "epoch": "e1",
        "state": "failed",
        "error": "TimeoutError: rendezvous timed out",
        "dtype": "bfloat16",
        "in_place": False,
        "delta_base": None,
        "served_at_load": False,
    }
    engine.join_error = None
    m.switch("e1")
    await m.wait_switched(5)
    assert m.status().state == "ready" and m.status().error is None
