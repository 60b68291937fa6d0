"""Bucketed, double-buffered broadcast of an ordered set of tensors over a WeightSyncGroup.

Sender: pack bucket i+1 into the spare buffer while bucket i is on the wire. Receiver: post the
receive of bucket i+1 before unpacking/loading bucket i. Each received bucket gets a fresh buffer
because engines (vLLM's layerwise reload) may hold the tensors until a whole layer is complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kubedistill.runtime.weight_sync.group import WeightSyncGroup
from kubedistill.runtime.weight_sync.times import SyncTimes
from kubedistill.runtime.wire.dtypes import numel
from kubedistill.runtime.wire.protocol import Bucket, Manifest

_Sending = tuple[Any, torch.Tensor | None, str, torch.Tensor | None]
"""A broadcast in flight: its Work, the buffer it reads (None: the caller's own tensor), its dtype,
and the caller's tensor it reads (kept alive until the broadcast is done)."""
_Receiving = tuple[Any, torch.Tensor | None]
"""A receive in flight: its Work and the fresh buffer it fills (None: the engine's own tensor)."""


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


@dataclass
class TransferStats:
    bytes: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    """Time blocked on the transport (receiver: waiting for buckets)."""
    consume_seconds: float = 0.0
    """Time spent unpacking/loading (receiver) or packing (sender)."""
    extra: dict[str, float] = field(default_factory=dict)
    times: SyncTimes = field(default_factory=SyncTimes)
    """A whole sync's segments on the trainer (WeightSender.sync fills it)."""
    plan: str = "full"
    """How the sync travelled (delta.Plan: full, keep or delta; WeightSender.sync fills it)."""
    density: float = 1.0
    """The fraction of the weights' elements that changed (1.0 for a full sync)."""
    served: dict[str, int] = field(default_factory=dict)
    """The version each member serves once the sync returned, as the sender knows it (its
    GET /version?at_least answer, or the synced version from a server that serves it at load)."""


class _InOrder:
    """The tensors of a manifest, drawn from an iterator in manifest order as buckets need them.

    A tensor is held only from when it is drawn (its own bucket's turn, or an earlier tensor's
    bucket coming later in the manifest) until its bucket is sent, so a lazy source (the
    trainer's all-gathers) never has the whole model materialised at once."""

    def __init__(self, manifest: Manifest, tensors: Iterable[torch.Tensor]):
        self.manifest = manifest
        self._source: Iterator[torch.Tensor] = iter(tensors)
        self._held: dict[int, torch.Tensor] = {}
        self._drawn = 0

    def take(self, index: int) -> torch.Tensor:
        """Tensor `index`, drawing from the source up to it; the caller owns it from now on."""
        while self._drawn <= index:
            try:
                t = next(self._source)
            except StopIteration:
                raise ValueError(
                    f"the weights ended after {self._drawn} tensors; the manifest has {len(self.manifest.tensors)}"
                ) from None
            meta = self.manifest.tensors[self._drawn]
            if list(t.shape) != meta.shape:
                raise ValueError(f"tensor {meta.name!r}: shape {list(t.shape)}, the manifest says {meta.shape}")
            self._held[self._drawn] = t.detach()
            self._drawn += 1
        return self._held.pop(index)

    def finish(self) -> None:
        """The source must end with the manifest: a trainer's collective needs it exhausted."""
        if next(self._source, None) is not None:
            raise ValueError(f"the weights hold more tensors than the manifest's {len(self.manifest.tensors)}")


def _pack(bucket: Bucket, manifest: Manifest, tensors: _InOrder, out: torch.Tensor) -> None:
    for e in bucket.entries:
        t = tensors.take(e.index)
        n = numel(manifest.tensors[e.index].shape)
        out[e.offset : e.offset + n].copy_(t.reshape(-1))


def send(group: WeightSyncGroup, manifest: Manifest, tensors: Iterable[torch.Tensor]) -> TransferStats:
    """Broadcast `tensors` (ordered like manifest.tensors; a lazy iterator is drawn from only as
    buckets need it) from rank 0, two buffers per dtype."""
    stats = TransferStats()
    t0 = time.perf_counter()
    spare: dict[str, list[torch.Tensor]] = {}
    pending: _Sending | None = None
    source = _InOrder(manifest, tensors)

    def retire(p: _Sending | None) -> None:
        # Wait for the previous broadcast; its buffer (if one of ours) becomes free for reuse.
        if p is not None:
            work, old, dtype, _ = p
            work.wait()
            if old is not None:
                spare[dtype].append(old)

    for bucket in manifest.buckets:
        single = source.take(bucket.entries[0].index) if len(bucket.entries) == 1 else None
        if (
            single is not None
            and single.is_contiguous()
            and dtype_name_of(single) == bucket.dtype
            and single.device == group.device
        ):
            flat = single.reshape(-1)  # a view: sent straight from the caller's tensor
            retire(pending)
            pending = (group.broadcast(flat), None, bucket.dtype, single)
            stats.bytes += flat.numel() * flat.element_size()
            continue
        pool = spare.setdefault(bucket.dtype, [])
        cap = max(b.numel for b in manifest.buckets if b.dtype == bucket.dtype)
        buf = pool.pop() if pool else torch.empty(cap, dtype=torch_dtype(bucket.dtype), device=group.device)
        view = buf[: bucket.numel]
        tp = time.perf_counter()
        if single is not None:
            view.copy_(single.reshape(-1))
        else:
            _pack(bucket, manifest, source, view)
        stats.consume_seconds += time.perf_counter() - tp
        retire(pending)
        pending = (group.broadcast(view), buf, bucket.dtype, None)
        stats.bytes += view.numel() * view.element_size()
    source.finish()
    if pending is not None:
        pending[0].wait()
    if group.device.type == "cuda":
        torch.cuda.synchronize()
    stats.seconds = time.perf_counter() - t0
    return stats


def close_receive(
    group: WeightSyncGroup, stats: TransferStats, errors: list[str], load: bool, extra_load_seconds: float = 0.0
) -> dict[str, float]:
    """A receiver's end of a sync: the failure all-reduce the sender waits on (1 from a receiver
    that refused or failed to load, so the group stays in step either way), then the first error
    raised, else the receive's numbers (what /weights/last reports)."""
    failed = group.all_reduce_sum(1 if (errors or not load) else 0)
    if errors:
        raise RuntimeError(errors[0])
    return {
        "bytes": stats.bytes,
        "transport_wait_seconds": stats.wait_seconds,
        "load_seconds": stats.consume_seconds + extra_load_seconds,
        "group_failures": failed,
    }


def dtype_name_of(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def receive(
    group: WeightSyncGroup,
    manifest: Manifest,
    consume: Callable[[list[tuple[str, torch.Tensor]]], None],
    destination: Callable[[str], torch.Tensor | None] | None = None,
) -> TransferStats:
    """Receive every bucket and hand its (name, tensor) views to `consume`, in manifest order.
    For a single-tensor bucket, `destination(name)` may return the engine's own tensor: if it is
    contiguous with the right dtype and size, the broadcast lands in it directly and `consume`
    is not called for it."""
    stats = TransferStats()
    t0 = time.perf_counter()

    def post(bucket: Bucket) -> _Receiving:
        if destination is not None and len(bucket.entries) == 1:
            meta = manifest.tensors[bucket.entries[0].index]
            dest = destination(meta.name)
            if (
                dest is not None
                and dest.is_contiguous()
                and dest.numel() == bucket.numel
                and dtype_name_of(dest) == bucket.dtype
                and dest.device == group.device
            ):
                return group.broadcast(dest.view(-1)), None
        buf = torch.empty(bucket.numel, dtype=torch_dtype(bucket.dtype), device=group.device)
        return group.broadcast(buf), buf

    posted = [post(b) for b in manifest.buckets[:1]]
    for i, bucket in enumerate(manifest.buckets):
        work, buf = posted.pop()
        tw = time.perf_counter()
        work.wait()
        stats.wait_seconds += time.perf_counter() - tw
        posted.extend(post(b) for b in manifest.buckets[i + 1 : i + 2])
        if buf is None:  # landed in the engine's tensor
            stats.bytes += bucket.numel * torch.empty(0, dtype=torch_dtype(bucket.dtype)).element_size()
            continue
        named = []
        for e in bucket.entries:
            meta = manifest.tensors[e.index]
            named.append((meta.name, buf[e.offset : e.offset + numel(meta.shape)].view(meta.shape)))
        tc = time.perf_counter()
        consume(named)
        stats.consume_seconds += time.perf_counter() - tc
        stats.bytes += buf.numel() * buf.element_size()
    stats.seconds = time.perf_counter() - t0
    return stats
