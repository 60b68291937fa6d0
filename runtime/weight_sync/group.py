"""The weight-sync process group: trainer rank 0 + every rollout worker, formed on a standalone
TCP store at the trainer (endpoints.master_addr:weight_sync_port), so it never touches the
trainer gang's default group nor vLLM's own. NCCL on GPU, gloo on CPU, the same calls."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class GroupAddress:
    host: str
    port: int
    rank: int
    world_size: int
    backend: str  # "nccl" | "gloo"
    timeout_seconds: float = 600.0


def resolve_backend(backend: str, device: str) -> str:
    """spec.weightSync.backend auto -> nccl on cuda, gloo on cpu."""
    if backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ValueError("weightSync.backend nccl needs device cuda; use gloo or auto on cpu")
    return backend


class WeightSyncGroup:
    """A process group over a standalone store. Rank 0 hosts the store (the trainer)."""

    def __init__(self, addr: GroupAddress):
        import torch.distributed as dist

        self.addr = addr
        timeout = timedelta(seconds=addr.timeout_seconds)
        self.store = dist.TCPStore(
            addr.host, addr.port, addr.world_size, is_master=addr.rank == 0, timeout=timeout,
            wait_for_workers=False,
        )
        store = dist.PrefixStore("kubedistill-weight-sync", self.store)
        if addr.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(store, addr.rank, addr.world_size)
        elif addr.backend == "gloo":
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(store, addr.rank, addr.world_size, timeout)
        else:
            raise ValueError(f"weight-sync backend {addr.backend!r}: allowed nccl, gloo")
        # Rendezvous now, so a missing member is found at start-up rather than at the first sync.
        self.barrier()

    @property
    def rank(self) -> int:
        return self.addr.rank

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start a broadcast; returns the Work (call .wait())."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([tensor], opts)

    def all_reduce_sum(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def barrier(self) -> None:
        self.all_reduce_sum(0)
