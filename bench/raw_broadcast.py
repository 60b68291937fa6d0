"""The weight-sync transport's limit, measured from the bench side: one raw broadcast of a flat
tensor and the closing all-reduce, in a group of the same size and backend as the rollout
servers' weight-sync group, whose other members are plain processes started here.

The rollout servers serve no route for this: a raw broadcast is a benchmark's baseline, not
something a job does, so the receivers are this module run as a script (`peer`), not the servers.

    peers = RawPeers(world_size=3, backend="gloo")
    seconds = peers.broadcast(512 * 2**20)
    peers.close()
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from kubedistill.runtime.weight_sync.group import GroupAddress, WeightSyncGroup, open_store

EPOCH = "raw-broadcast"
TIMEOUT_SECONDS = 600.0
WARM_BYTES = 1 << 20


def peer_device(backend: str, rank: int) -> str | None:
    """An NCCL member's own GPU (round-robin over the visible ones); gloo members need none."""
    return f"cuda:{rank % torch.cuda.device_count()}" if backend == "nccl" else None


class RawPeers:
    """`world_size - 1` peer processes in a group with this process as rank 0, over `host`:`port`."""

    def __init__(self, world_size: int, backend: str, host: str, port: int, device: str | None = None):
        if world_size < 2:
            raise ValueError(f"a raw broadcast needs at least one receiver (world size {world_size})")
        addr = GroupAddress(host, port, 0, world_size, backend, TIMEOUT_SECONDS, EPOCH, device)
        store = open_store(addr)  # listening before the peers start, as the sender does for servers
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, host, str(port), str(rank), str(world_size), backend],
            )
            for rank in range(1, world_size)
        ]
        try:
            self.group = WeightSyncGroup(addr, store=store)  # returns once every peer has joined
        except BaseException:
            self._stop()
            raise
        self.broadcast(WARM_BYTES)  # the first collective pays for connections and buffers

    def broadcast(self, nbytes: int) -> float:
        """Seconds of one raw broadcast of `nbytes` to every peer, closing all-reduce included.
        The size goes first, untimed, so each peer can allocate its buffer."""
        device = self.group.device
        self.group.broadcast(torch.tensor([nbytes], dtype=torch.int64, device=device)).wait()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        t0 = time.perf_counter()
        self.group.broadcast(buf).wait()
        self.group.all_reduce_sum(0)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Tell the peers to exit (a size of 0) and release the group."""
        try:
            self.group.broadcast(torch.zeros(1, dtype=torch.int64, device=self.group.device)).wait()
        finally:
            self.group.close()
            self._stop()

    def _stop(self) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def peer(host: str, port: int, rank: int, world_size: int, backend: str) -> None:
    """Receive raw broadcasts until a size of 0 arrives."""
    torch.set_num_threads(1)
    addr = GroupAddress(host, port, rank, world_size, backend, TIMEOUT_SECONDS, EPOCH, peer_device(backend, rank))
    group = WeightSyncGroup(addr)
    try:
        while True:
            size = torch.zeros(1, dtype=torch.int64, device=group.device)
            group.broadcast(size).wait()
            nbytes = int(size.item())
            if nbytes == 0:
                return
            group.broadcast(torch.empty(nbytes, dtype=torch.uint8, device=group.device)).wait()
            group.all_reduce_sum(0)
    finally:
        group.close()


if __name__ == "__main__":
    peer(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
