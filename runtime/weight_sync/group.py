"""The weight-sync process group: trainer rank 0 + every rollout worker, formed on a standalone
TCP store at the trainer (endpoints.master_addr:weight_sync_port), so it never touches the
trainer gang's default group nor vLLM's own. NCCL on GPU, gloo on CPU, the same calls.

A group has an *epoch*: a fresh id the trainer picks each time it (re)forms the group (every
trainer start, so also after a gang restart). Every store key lives under the epoch's prefix, so
a member still joining an older group can never be paired with the members of a newer one."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
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
        if addr.backend == "nccl":
            torch.cuda.set_device(self.device)  # this thread's current device: the communicator's GPU
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

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Start a broadcast; returns the Work (call .wait())."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._live().broadcast([tensor], opts)

    def all_reduce_sum(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._live().allreduce([t], opts).wait()
        return int(t.item())

    def barrier(self) -> None:
        self.all_reduce_sum(0)

    def _live(self) -> Any:
        if self.pg is None:
            raise RuntimeError(f"weight-sync group epoch {self.addr.epoch} is closed")
        return self.pg

    def abort(self) -> None:
        """Break collectives blocked on this group from another thread. NCCL's abort does (its
        communicators are torn down); gloo's does not, but a gloo collective fails by itself
        within moments when a peer process dies (its sockets close)."""
        pg = self.pg
        if pg is not None and self.addr.backend == "nccl" and hasattr(pg, "abort"):
            try:
                pg.abort()
            except Exception as e:  # already broken: nothing left to abort
                log.warning("aborting weight-sync group epoch %s: %s", self.addr.epoch, e)

    def close(self) -> None:
        """Release the communicators, sockets and the store connection (or, on rank 0, the store
        itself). Idempotent; the group is unusable afterwards."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                if self.addr.backend == "nccl" and hasattr(pg, "abort"):
                    pg.abort()
                elif hasattr(pg, "shutdown"):
                    pg.shutdown()
            except Exception as e:
                log.warning("closing weight-sync group epoch %s: %s", self.addr.epoch, e)
        self.store = None
