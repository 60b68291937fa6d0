"""The weight-sync process group: trainer rank 0 + every rollout worker, formed on a standalone
TCP store at the trainer (endpoints.master_addr:weight_sync_port), so it never touches the
trainer gang's default group nor vLLM's own. NCCL on GPU, gloo on CPU, the same calls.

A group has an *epoch*: a fresh id the trainer picks each time it (re)forms the group (every
trainer start, so also after a gang restart). Every store key lives under the epoch's prefix, so
a member still joining an older group can never be paired with the members of a newer one."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from kubedistill.api.spec import Device, SyncBackend

log = logging.getLogger("kubedistill.weight_sync")

EPOCH_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class GroupAddress:
    host: str
    port: int
    rank: int
    world_size: int
    backend: str  # "nccl" | "gloo"
    timeout_seconds: float = 600.0
    epoch: str = "0"
    device: str | None = None
    """NCCL: this member's GPU, e.g. "cuda:1". Named by the caller because a group formed in a
    new thread would otherwise take that thread's current device, cuda:0 for every worker."""


def member_device(backend: str, device: str | None) -> torch.device:
    """The device a member's sync tensors live on: CPU for gloo, its own GPU for NCCL."""
    if backend == "gloo":
        return torch.device("cpu")
    if backend != "nccl":
        raise ValueError(f"weight-sync backend {backend!r}: allowed nccl, gloo")
    if device is None or torch.device(device).type != "cuda" or torch.device(device).index is None:
        raise ValueError(f"an NCCL weight-sync member needs its own CUDA device (cuda:N), got {device!r}")
    return torch.device(device)


def local_cuda_device(env: Mapping[str, str]) -> str:
    """The GPU of a process launched one per GPU (torchrun's LOCAL_RANK; 0 when alone)."""
    return f"cuda:{int(env.get('LOCAL_RANK', '0'))}"


def sync_rank(base_rank: int, tp_rank: int | None, tp_size: int) -> int:
    """A rollout worker's rank in the weight-sync group: its server's first rank plus its
    tensor-parallel rank. Unknown is only allowed without tensor parallelism: guessing 0 would
    give two workers the same rank."""
    if tp_rank is None:
        if tp_size > 1:
            raise RuntimeError(f"cannot tell this worker's tensor-parallel rank (TP {tp_size})")
        tp_rank = 0
    return base_rank + tp_rank


def nccl_options(timeout: timedelta) -> Any:
    """ProcessGroupNCCL's options with the configured timeout (weightSync.timeoutSeconds);
    without them NCCL keeps torch's 10-minute default."""
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return options


NCCL_ERROR_HANDLING_CLEAN_UP_ONLY = "2"
"""torch's ErrorHandlingMode CleanUpOnly (ProcessGroupNCCL.hpp): on a timeout or a remote error
the watchdog aborts the group's communicators and marks its work failed, and the process lives.
Without it torch 2.13 uses SkipCleanUp (3), which, like TearDown (1), rethrows in the watchdog
thread and takes the whole process down: for a rollout server, its vLLM engine. NoHandling (0)
would keep the process but leave the hung NCCL kernel on the GPU, blocking every later kernel
ordered after it."""

NCCL_ABORT_SECONDS = 10.0
"""How long an abort waits for ncclCommAbort, which can itself hang (torch keeps SkipCleanUp for
that case); past it the group is reported wedged and its process must be replaced."""


def nccl_group_env() -> dict[str, str]:
    """Environment a weight-sync ProcessGroupNCCL must be constructed under (torch reads these in
    its constructor, per group): a failed sync ends in an exception, never in a dead process."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": NCCL_ERROR_HANDLING_CLEAN_UP_ONLY}


_env_lock = threading.Lock()


@contextlib.contextmanager
def scoped_env(overrides: Mapping[str, str]) -> Iterator[None]:
    """`overrides` in os.environ for the duration only, so the process's other NCCL groups (vLLM's
    own, the trainer's FSDP group) keep the error handling they were made with."""
    with _env_lock:
        saved = {k: os.environ.get(k) for k in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class GroupAborted(RuntimeError):
    """A collective of this group was broken off by abort() (the group is unusable from then on)."""


class GroupWedged(RuntimeError):
    """An abort did not end what was blocked on the group (a hung ncclCommAbort or receive): only
    a new process frees the GPU state; the server exits so its pod is replaced."""


def resolve_backend(backend: SyncBackend, device: Device) -> str:
    """spec.weightSync.backend auto -> nccl on cuda, gloo on cpu."""
    if backend is SyncBackend.auto:
        return "nccl" if device is Device.cuda else "gloo"
    if backend is SyncBackend.nccl:
        if device is not Device.cuda:
            raise ValueError("weightSync.backend nccl needs device cuda; use gloo or auto on cpu")
        return "nccl"
    return "gloo"


def open_store(addr: GroupAddress) -> Any:
    """The group's TCP store: rank 0 hosts it (listening from this call on), the others connect."""
    import torch.distributed as dist

    return dist.TCPStore(
        addr.host,
        addr.port,
        addr.world_size,
        is_master=addr.rank == 0,
        timeout=timedelta(seconds=addr.timeout_seconds),
        wait_for_workers=False,
    )


class WeightSyncGroup:
    """A process group over a standalone store. Rank 0 hosts the store (the trainer); it may open
    the store first (`open_store`) and pass it in, so members can be told to join before the
    rendezvous blocks."""

    def __init__(self, addr: GroupAddress, store: Any | None = None):
        import torch.distributed as dist

        if not EPOCH_PATTERN.match(addr.epoch):
            raise ValueError(f"weight-sync group epoch {addr.epoch!r}: 1-64 characters of A-Z a-z 0-9 . _ - allowed")
        self.addr = addr
        self.device = member_device(addr.backend, addr.device)
        timeout = timedelta(seconds=addr.timeout_seconds)
        self.store = store if store is not None else open_store(addr)
        prefixed = dist.PrefixStore(f"kubedistill-weight-sync/{addr.epoch}", self.store)
        self._aborted = threading.Event()
        self._abandoned: list[Any] = []
        """Operations a wait gave up on at abort(), still running in gloo's threads."""
        self.wedged: str | None = None
        """Why an abort could not complete (see GroupWedged); None while the group is sound."""
        if addr.backend == "nccl":
            torch.cuda.set_device(self.device)  # this thread's current device: the communicator's GPU
            with scoped_env(nccl_group_env()):
                self.pg = dist.ProcessGroupNCCL(prefixed, addr.rank, addr.world_size, nccl_options(timeout))
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, addr.rank, addr.world_size, timeout)
        # Rendezvous now, so a missing member is found at start-up rather than at the first sync.
        self.barrier()

    @property
    def rank(self) -> int:
        return self.addr.rank

    @property
    def epoch(self) -> str:
        return self.addr.epoch

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        """Start a broadcast; returns it in flight (call .wait())."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return Pending(self, self._live().broadcast([tensor], opts))

    def all_reduce_sum(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        Pending(self, self._live().allreduce([t], opts)).wait()
        return int(t.item())

    def wait(self, work: Any) -> None:
        """Wait for `work` without ever blocking where abort() cannot reach: poll its completion
        (cheap: a CUDA event query or a flag) and give up as soon as the group is aborted. A plain
        Work.wait() on gloo blocks until the peer's socket closes or the group timeout, and gloo's
        own abort() does not release it; on NCCL the CPU would block in .item() instead."""
        delay = 0.0005
        while not work.is_completed():
            if self._aborted.wait(delay):
                self._abandoned.append(work)
                raise GroupAborted(f"weight-sync group epoch {self.addr.epoch} was aborted")
            delay = min(delay * 2, 0.01)
        work.wait()  # raises the collective's own error (timeout, remote failure)

    def barrier(self) -> None:
        self.all_reduce_sum(0)

    def _live(self) -> Any:
        if self.pg is None:
            raise RuntimeError(f"weight-sync group epoch {self.addr.epoch} is closed")
        if self._aborted.is_set():
            raise GroupAborted(f"weight-sync group epoch {self.addr.epoch} was aborted")
        return self.pg

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def abort(self, seconds: float = NCCL_ABORT_SECONDS) -> None:
        """Break the collectives blocked on this group, from any thread; the group is unusable
        afterwards. Every wait() in this group ends at once with GroupAborted. On NCCL the
        communicators are aborted too, which ends the GPU kernels still waiting for a peer (they
        would otherwise hold the stream, and the next kernels, forever). ncclCommAbort can itself
        hang, so it runs in its own thread, waited for `seconds`; past that the group is
        `wedged`. gloo has nothing to release: an abandoned gloo operation ends with its socket."""
        if self._aborted.is_set():
            return
        self._aborted.set()
        pg = self.pg
        if pg is None or self.addr.backend != "nccl":
            return

        def abort_communicators() -> None:
            try:
                pg.abort()
            except Exception as e:  # already broken: nothing left to abort
                log.warning("aborting weight-sync group epoch %s: %s", self.addr.epoch, e)

        t = threading.Thread(target=abort_communicators, name="kd-weight-sync-abort", daemon=True)
        t.start()
        t.join(seconds)
        if t.is_alive():
            self.wedged = f"ncclCommAbort of group epoch {self.addr.epoch} did not return in {seconds:.0f} s"
            log.error("%s", self.wedged)

    def close(self) -> None:
        """Release the communicators, sockets and the store connection (or, on rank 0, the store
        itself). Idempotent; the group is unusable afterwards."""
        pg, self.pg = self.pg, None
        abandoned, self._abandoned = self._abandoned, []
        self.store = None
        if pg is None:
            return
        if self.addr.backend == "nccl" and self._aborted.is_set():
            return  # its communicators are already aborted (or wedged in that abort)
        try:
            if self.addr.backend == "nccl" and hasattr(pg, "abort"):
                pg.abort()
            elif hasattr(pg, "shutdown"):
                pg.shutdown()
        except Exception as e:
            log.warning("closing weight-sync group epoch %s: %s", self.addr.epoch, e)
        if any(not w.is_completed() for w in abandoned):
            # A gloo group is destroyed only once its operations end, and one abandoned by
            # abort() ends only when the peer's socket closes or at the group timeout: let a
            # thread of its own wait for that rather than the caller.
            held = [pg]
            del pg
            threading.Thread(target=held.clear, name="kd-weight-sync-release", daemon=True).start()


class Pending:
    """A collective in flight on a WeightSyncGroup; wait() can be broken off by the group's abort()."""

    def __init__(self, group: WeightSyncGroup, work: Any):
        self.group, self.work = group, work

    def wait(self) -> None:
        self.group.wait(self.work)
