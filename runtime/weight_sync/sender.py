"""Trainer side of a weight sync: `WeightSender(spec, endpoints).sync(version, weights)`.

Construction (re)forms the group under a fresh epoch: rank 0 opens the group's TCP store, tells
every rollout server `POST /weights/group {epoch, rank, world_size}` (retrying while a server is
still starting), and returns once every rollout worker has joined. The servers are `members`
(endpoints.rollout unless given): `set_members` changes them while the job scales, and the next
sync re-forms the group around the new set, numbering the servers in list order. Servers that
were in an older group (this trainer's predecessor, before a gang restart) leave it first, so
a restarted trainer reaches the same long-lived rollout servers. A sync POSTs /weights/begin
(version + manifest + epoch) to every rollout server, broadcasts the buckets, then all-reduces a
failure count so it returns only once every engine has loaded the weights (or raises naming how many failed).

With spec.weightSync.delta always or auto (off by default), a sync that every server can take as
a delta sends only the changed elements (runtime/weight_sync/delta.py: the plan, the copy kept of what was sent, the
encodings); the weights are then drawn and compared before /weights/begin, as the manifest's
pieces depend on them. Any other sync is full, and restarts the chain when it keeps a copy.

The weights are a list of (name, tensor), or a WeightSource (the trainer): its manifest comes
from metadata, and its full tensors are drawn one bucket at a time while the buckets go out, so
rank 0 never holds a gathered copy of the whole model; it starts gathering only once the group
is known to be formed, so the other trainer ranks do not wait in an all-gather meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import torch

from kubedistill.api.roleconfig import Endpoints, weight_sync_rank, weight_sync_world_size
from kubedistill.api.spec import DeltaMode, DistillationJobSpec
from kubedistill.runtime.weight_sync.delta import (
    SAMPLE_BATCH,
    Backoff,
    DeltaStats,
    Plan,
    SentCopy,
    drawn,
    host_copy,
    new_chain,
    plan,
    sparse_encodings,
)
from kubedistill.runtime.weight_sync.group import (
    GroupAddress,
    WeightSyncGroup,
    local_cuda_device,
    open_store,
    resolve_backend,
)
from kubedistill.runtime.weight_sync.manifest import bucket_layout
from kubedistill.runtime.weight_sync.times import SyncTimes
from kubedistill.runtime.weight_sync.transfer import TransferStats, send, torch_dtype
from kubedistill.runtime.wire.dtypes import dtype_name, numel
from kubedistill.runtime.wire.http import REQUEST_ERRORS, TRANSPORT_ERRORS, BlockingClient, ServerError, call, fetch
from kubedistill.runtime.wire.protocol import (
    DeltaBase,
    LoraAdapter,
    Manifest,
    ManifestDelta,
    TensorMeta,
    VersionResponse,
    WeightsBeginRequest,
    WeightsGroupRequest,
    WeightsGroupResponse,
)

if TYPE_CHECKING:
    from kubedistill.runtime.metrics import RoleMetrics

T = TypeVar("T")

RETRY_STATUSES = (502, 503, 504)
"""Answers to POST /weights/group that mean "not yet" (a server still loading its engine, or a
proxy in front of one starting): the join is sent again until weightSync.timeoutSeconds."""


class WeightSyncError(RuntimeError):
    pass


@runtime_checkable
class WeightSource(Protocol):
    """Weights too big to gather at once (the trainer's FSDP shards)."""

    def weight_metas(self) -> list[TensorMeta]:
        """Name, dtype and full shape of each tensor, in the order named_full_weights yields
        them; no collective."""
        ...

    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensors, each materialised when reached (a collective: exhaust it)."""
        ...

    def frozen_prefixes(self) -> list[str]:
        """Name prefixes of weights left out because they never change (receivers keep theirs)."""
        ...

    def lora_adapter(self) -> LoraAdapter | None:
        """Set when the tensors are a LoRA adapter's (then they travel as the trainer holds
        them, not in the engines' dtype: they are small, and the merge wants them exact)."""
        ...


DIRECT_BYTES = 1 << 20
"""Tensors of at least 1 MiB travel in buckets of their own, without packing copies, when every
server receives them in place (direct_bytes)."""


def build_manifest(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int, direct_bytes: int | None = DIRECT_BYTES
) -> Manifest:
    return layout([tensor_meta(n, t) for n, t in named], bucket_bytes, direct_bytes)


def tensor_meta(name: str, t: torch.Tensor) -> TensorMeta:
    """A tensor's manifest entry; a DTensor's shape is its full shape, so shards describe the
    tensor they gather into."""
    return TensorMeta(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape))


def layout(metas: list[TensorMeta], bucket_bytes: int, direct_bytes: int | None = DIRECT_BYTES) -> Manifest:
    return bucket_layout(metas, bucket_bytes, direct_bytes=min(direct_bytes, bucket_bytes) if direct_bytes else None)


def new_epoch() -> str:
    """A group id no earlier trainer used: start time (ns) and pid, so also unique across the
    restarts of one pod and across pods."""
    return f"{time.time_ns():x}-{os.getpid()}"


@dataclass
class _Outgoing:
    """One sync's manifest and tensors, and what it keeps for the next delta once it succeeds."""

    manifest: Manifest
    tensors: Iterable[torch.Tensor]
    how: Plan
    keep: DeltaBase
    copy: SentCopy | None
    """The copy the delta was taken against (updated in place by the delta)."""
    kept: dict[str, torch.Tensor]
    """Filled while a `keep` sync's tensors go out: the copy of what was sent."""
    delta: DeltaStats


class WeightSender:
    def __init__(
        self,
        spec: DistillationJobSpec,
        endpoints: Endpoints,
        metrics: RoleMetrics | None = None,
        bind_host: str | None = None,
        epoch: str | None = None,
        members: list[str] | None = None,
    ):
        self.spec = spec
        self.endpoints = endpoints
        self.members: list[str] = list(endpoints.rollout if members is None else members)
        """Base URLs of the rollout servers in the group, in rank order."""
        self.metrics = metrics
        self.timeout = float(spec.weight_sync.timeout_seconds)
        backend = resolve_backend(spec.weight_sync.backend, spec.device)
        addr = GroupAddress(
            host=bind_host or endpoints.master_addr,
            port=endpoints.weight_sync_port,
            rank=0,
            world_size=weight_sync_world_size(spec, len(self.members)),
            backend=backend,
            timeout_seconds=self.timeout,
            epoch=epoch or new_epoch(),
            device=local_cuda_device(os.environ) if backend == "nccl" else None,
        )
        self.epoch = addr.epoch
        self._addr = addr
        self.reforms = 0
        """Times the group was re-formed because a rollout server had left it (e.g. replaced)."""
        self.direct_bytes: int | None = None
        """Tensors of at least this size travel alone (every server receives them in place), or
        None: every tensor is packed. Learnt from GET /weights/group before each sync."""
        self.wire_dtype: str | None = None
        """The dtype floating weights travel in: what every rollout engine keeps them in (None:
        as the trainer holds them). Learnt from GET /weights/group before each sync."""
        # The runtime's HTTP stack on a loop of its own: the sender blocks on the trainer thread,
        # while the driver's loop, on another thread, must go on serving generations. One client
        # for the sender's life, so its connections are reused from sync to sync.
        self._http = BlockingClient(timeout=self.timeout, name="weight-sender-http")
        store = open_store(addr)  # listening before any server is told to join
        self._tell_servers_to_join()
        self.group = WeightSyncGroup(addr, store=store)
        self._formed = list(self.members)
        self.last_stats: TransferStats | None = None
        self._copy: SentCopy | None = None
        """What every member holds after the last sync, while delta syncs are on (delta.py)."""
        self._bases: list[DeltaBase | None] = []
        """The delta base each member reported before this sync (GET /weights/group)."""
        self._served_at_load: set[str] = set()
        """Members that serve a loaded version before the sync's closing all-reduce (GET
        /weights/group before the sync): no GET /version?at_least after it."""
        self._backoff = Backoff()
        self.last_delta = DeltaStats()
        """The last sync's plan, density and bytes a full sync would have sent."""

    def set_members(self, urls: list[str]) -> None:
        """The rollout servers the next sync goes to. The group is re-formed around them by that
        sync, not here: a server added is healthy but may still be loading, and one removed may
        already be gone. Call it between syncs (the driver does, on the trainer thread)."""
        if len(set(urls)) != len(urls) or not urls:
            raise ValueError(f"weight-sync members must be distinct and at least one: {urls}")
        self.members = list(urls)

    def _tell_servers_to_join(self) -> None:
        """POST /weights/group to every rollout server, retrying while it is unreachable or
        still loading its engine (until weightSync.timeoutSeconds)."""
        world = self._addr.world_size
        deadline = time.monotonic() + self.timeout

        async def tell(index: int, url: str) -> None:
            body = WeightsGroupRequest(epoch=self.epoch, rank=weight_sync_rank(self.spec, index), world_size=world)
            last = ""
            while True:
                try:
                    await fetch(self._http.session, "POST", _at(url, "/weights/group"), body, ok=(200, 202), timeout=30)
                    return
                except ServerError as e:
                    if e.status not in RETRY_STATUSES:
                        raise WeightSyncError(f"{url}/weights/group answered {e.status}: {e.message}") from e
                    last = f"{e.status} {e.message}"
                except TRANSPORT_ERRORS as e:
                    last = repr(e)
                if time.monotonic() > deadline:
                    raise WeightSyncError(
                        f"{url}/weights/group: no answer within weightSync.timeoutSeconds "
                        f"({self.timeout:.0f} s); last: {last}"
                    )
                await asyncio.sleep(0.5)

        self._http.run(_each(tell(i, url) for i, url in enumerate(self.members)))

    def close(self) -> None:
        """Release the group and its store (the servers leave it when told to join the next)."""
        self.group.close()
        self._http.close()

    def ensure_group(self) -> None:
        """Re-form the group under a new epoch if the members changed (set_members) or a rollout
        server is not in it (a replaced rollout pod starts outside any group): then every server
        switches, and the sync goes on without a trainer restart. One GET /weights/group per
        server."""

        async def member(url: str) -> tuple[bool, WeightsGroupResponse | None]:
            """(in this group and ready, its answer)."""
            try:
                doc = await call(
                    self._http.session, "GET", _at(url, "/weights/group"), WeightsGroupResponse, timeout=30
                )
            except REQUEST_ERRORS:
                return False, None  # not in the group as far as this sync can tell: re-form it
            return doc.epoch == self.epoch and doc.state == "ready", doc

        answers = self._http.run(_each(member(url) for url in self.members))
        self.wire_dtype = wire_dtype(doc.dtype if doc is not None else None for _, doc in answers)
        self.direct_bytes = direct_bytes(doc.in_place if doc is not None else False for _, doc in answers)
        self._bases = [doc.delta_base if doc is not None else None for _, doc in answers]
        self._served_at_load = {url for url, (_, doc) in zip(self.members, answers) if doc and doc.served_at_load}
        if self.members == self._formed and all(ok for ok, _ in answers):
            return
        self.group.close()
        self._addr = replace(
            self._addr, epoch=new_epoch(), world_size=weight_sync_world_size(self.spec, len(self.members))
        )
        self.epoch = self._addr.epoch
        store = open_store(self._addr)
        self._tell_servers_to_join()
        self.group = WeightSyncGroup(self._addr, store=store)
        self._formed = list(self.members)
        self.reforms += 1

    def sync(
        self,
        version: int,
        weights: WeightSource | Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int | None = None,
    ) -> TransferStats:
        t0 = time.perf_counter()
        self.ensure_group()
        out = self._outgoing(version, weights, bucket_bytes or self.spec.weight_sync.bucket_mb * 1024 * 1024)
        refusals = self._begin(WeightsBeginRequest(version=version, manifest=out.manifest, group_epoch=self.epoch))
        t_begun = time.perf_counter()
        stats = send(self.group, out.manifest, out.tensors)
        t_sent = time.perf_counter()
        failed = self.group.all_reduce_sum(0)
        t_loaded = time.perf_counter()
        stats.seconds = t_loaded - t0
        stats.plan, stats.density = out.how, out.delta.density
        self.last_stats, self.last_delta = stats, out.delta
        self._observe(version, stats, out.delta)
        if refusals:
            raise WeightSyncError("; ".join(refusals))
        if failed:
            raise WeightSyncError(f"{failed} rollout worker(s) failed to load weight version {version}")
        stats.served = self._await_served(version)
        stats.times = SyncTimes(
            pause=t_begun - t0, transfer=t_sent - t_begun, load=t_loaded - t_sent, resume=time.perf_counter() - t_loaded
        )
        if out.how == "delta":
            assert out.copy is not None
            out.copy.base = out.keep
            self._copy = out.copy
        elif out.how == "keep":
            self._copy = SentCopy(out.keep.chain, version, out.kept)
        self._backoff.observe(out.how, stats.seconds)
        return stats

    def _outgoing(
        self, version: int, weights: WeightSource | Iterable[tuple[str, torch.Tensor]], budget: int
    ) -> _Outgoing:
        """The sync's manifest and its tensors in manifest order: a delta against the kept copy,
        or the full weights (drawn lazily, only once every server began the sync)."""
        draw: Callable[[], Iterable[tuple[str, torch.Tensor]]]
        adapter: LoraAdapter | None = None
        frozen: list[str] = []
        if isinstance(weights, WeightSource):
            metas = weights.weight_metas()
            adapter = weights.lora_adapter()
            frozen = weights.frozen_prefixes()
            draw = weights.named_full_weights
        else:
            named = list(weights)
            metas = [tensor_meta(n, t) for n, t in named]
            draw = named.__iter__
        if adapter is None:
            metas = [as_wire_dtype(m, self.wire_dtype) for m in metas]
        setting = self.spec.weight_sync.delta
        held = self._copy.base if self._copy is not None and self._copy.fits(metas) else None
        how = plan(setting, held, self._bases, self.wire_dtype, bool(adapter), self._backoff)
        copy, self._copy = self._copy, None  # kept again only once this sync has succeeded
        sparse = sparse_encodings(setting.mode)
        probe_seconds = 0.0
        if how == "delta" and setting.mode is DeltaMode.auto:
            assert copy is not None
            t0 = time.perf_counter()
            pairs = iter(draw())
            first = list(itertools.islice(pairs, SAMPLE_BATCH))
            dense = copy.dense_start(metas[: len(first)], first, setting.threshold, sparse)
            probe_seconds = time.perf_counter() - t0
            if dense:
                how = "keep"
            draw = functools.partial(itertools.chain, first, pairs)  # drawn once: the first batch, then on
        keep = DeltaBase(chain=copy.base.chain if how == "delta" and copy else new_chain(), version=version)
        kept: dict[str, torch.Tensor] = {}
        tensors: Iterable[torch.Tensor]
        if how == "delta":
            assert copy is not None
            pieces, parts, delta = copy.delta(metas, draw(), setting.threshold, sparse)
            delta.encode_seconds += probe_seconds
            manifest = layout(pieces, budget, self.direct_bytes)
            manifest.delta = ManifestDelta(keep=keep, base=copy.base, targets=metas)
            tensors = _on_device(manifest, zip((p.name for p in pieces), drawn(parts)), self.group.device)
        else:
            manifest = layout(metas, budget, self.direct_bytes)
            delta = DeltaStats(plan=how, elements=sum(numel(m.shape) for m in metas), full_bytes=manifest.total_bytes)
            delta.changed = delta.elements
            delta.encode_seconds = probe_seconds
            if how == "keep":
                manifest.delta = ManifestDelta(keep=keep)
            into = kept if how == "keep" else None
            tensors = _later(lambda: _on_device(manifest, draw(), self.group.device, into))
        manifest.lora = adapter
        manifest.frozen = frozen
        # Only a delta needs the old copy; any other sync lets it go before its own tensors are
        # drawn, so a keep never holds two copies at once (pinned blocks stay in PyTorch's cache).
        return _Outgoing(manifest, tensors, how, keep, copy if how == "delta" else None, kept, delta)

    def _begin(self, body: WeightsBeginRequest) -> list[str]:
        """POST /weights/begin to every member; returns the refusals (409: the server discards
        the broadcast but still takes part, so the group stays in step). Any other failure
        leaves the group unable to continue."""

        async def begin(url: str) -> str | None:
            try:
                await fetch(self._http.session, "POST", _at(url, "/weights/begin"), body)
            except ServerError as e:
                if e.status == 409:
                    return f"{url}: {e.message}"
                raise WeightSyncError(
                    f"{url}/weights/begin answered {e.status} ({e.message}); the server is not "
                    "in the weight-sync collective, so the group cannot continue"
                ) from e
            except TRANSPORT_ERRORS as e:
                raise WeightSyncError(
                    f"{url}/weights/begin did not reach the server ({e!r}); the group cannot continue"
                ) from e
            return None

        answers = self._http.run(_each(begin(url) for url in self.members))
        return [r for r in answers if r is not None]

    def _observe(self, version: int, stats: TransferStats, delta: DeltaStats) -> None:
        if self.metrics is not None:
            self.metrics["weight_sync_seconds"].observe(stats.seconds)
            self.metrics["weight_sync_bytes"].inc(stats.bytes)
            self.metrics["weight_sync_full_bytes"].inc(delta.full_bytes)
            self.metrics["weight_sync_density"].set(delta.density)
            self.metrics["weight_version"].set(version)

    def _await_served(self, version: int) -> dict[str, int]:
        """Every engine has loaded the weights once the failure all-reduce completes, but a
        server bumps the version it serves (and tags new tokens with) only when its engine's
        load call returns, a moment later: wait for that as well, so generation requested after
        sync() returns is tagged with the new version. One GET /version?at_least per server,
        which the server answers once its load has ended; none to a server that serves the new
        version before the all-reduce (`served_at_load`: the hf engine): a round trip through
        two event loops busy with the generation resuming."""
        waiting = [url for url in self.members if url not in self._served_at_load]
        deadline = time.monotonic() + self.timeout

        async def served(url: str) -> int:
            while True:
                try:
                    now: int | None = (
                        await call(self._http.session, "GET", _at(url, f"/version?at_least={version}"), VersionResponse)
                    ).version
                except ServerError:
                    now = None
                except TRANSPORT_ERRORS as e:
                    raise WeightSyncError(f"{url} loaded weight version {version}, then did not answer: {e!r}") from e
                if now is not None and now >= version:
                    return now
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"{url} loaded weight version {version} but still serves {now}")
                await asyncio.sleep(0.005)

        answers = self._http.run(_each(served(url) for url in waiting)) if waiting else []
        return {**{url: version for url in self.members}, **dict(zip(waiting, answers))}


FLOATING = ("float32", "float16", "bfloat16")


def direct_bytes(in_place: Iterable[bool]) -> int | None:
    """Large tensors travel in buckets of their own only when every server receives such a bucket
    straight into its parameter (no packing or unpacking copy on either side); an engine that
    loads each bucket through a loader call (vLLM) gets them packed into buckets of bucketMB, a
    few calls per layer rather than one per tensor, as vLLM's own NCCL weight transfer packs."""
    return DIRECT_BYTES if all(in_place) else None


def wire_dtype(served: Iterable[str | None]) -> str | None:
    """The dtype floating weights travel in: the one every rollout engine keeps them in, so the
    bytes are the fewest and each receiver's copy is exact (the cast rounds once, on the
    trainer, as the receiver's own copy would). None, as the trainer holds them, when the
    servers differ or one does not say."""
    kinds = set(served)
    if len(kinds) != 1:
        return None
    (only,) = kinds
    return only if only in FLOATING else None


def as_wire_dtype(meta: TensorMeta, dtype: str | None) -> TensorMeta:
    if dtype is None or meta.dtype not in FLOATING or meta.dtype == dtype:
        return meta
    return meta.model_copy(update={"dtype": dtype})


def _on_device(
    manifest: Manifest,
    pairs: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
    keep: dict[str, torch.Tensor] | None = None,
) -> Iterator[torch.Tensor]:
    """The tensors in manifest order, on the group's device and in the manifest's dtype, each
    checked against its name; `keep` gets each one's host copy (a sync that starts a chain)."""
    for i, (name, t) in enumerate(pairs):
        meta = manifest.tensors[i] if i < len(manifest.tensors) else None
        if meta is None or name != meta.name:
            raise WeightSyncError(f"weight {i} is {name!r}; the manifest says {meta.name if meta else None!r}")
        sent = t.to(device=device, dtype=torch_dtype(meta.dtype))
        if keep is not None:
            keep[name] = host_copy(t, sent)
        yield sent


def _later(make: Callable[[], Iterable[T]]) -> Iterator[T]:
    """`make()`'s items, made only once iterated (the weights are drawn after /weights/begin)."""
    yield from make()


def _at(url: str, path: str) -> str:
    return url.rstrip("/") + path


async def _each(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """One request per server, concurrently: their results in order. The first failure cancels
    the others (a join still retrying, say) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
