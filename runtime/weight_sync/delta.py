"""Sparse delta weight syncs (spec.weightSync.delta): send only the elements that changed since
the version every receiver holds, exactly.

Exactness: the sender keeps a copy of what it last sent, in the dtype the engines keep (the wire
dtype), and compares the new weights with it bit for bit after the same cast a full sync makes.
A changed element travels with its new bits; an unchanged one is, bit for bit, what the receiver
already holds. So a receiver that patches its base ends with the very tensors a full sync of the
same version would have given it: the hf engine patches its parameters in place; a vLLM worker
patches its copy of the last tensors it loaded (unfused, HF names) and feeds them to the loader,
which fuses qkv/gate_up as for a full sync.

Per tensor the sender counts the changes first (one XOR of the bits and a count), then picks the
cheapest encoding (bytes on the wire, pure: `choose`): nothing (unchanged), `index` (16-bit offsets
within blocks of 65536 elements plus each block's count, and the values: 2 bytes a change more),
`mask` (one bit per element, and the values) or the whole tensor; a tensor whose changed fraction
exceeds densityThreshold goes whole. Positions are computed only for index and mask; a tensor whose
sample (16-64 runs of 64 elements) shows it would go whole even at a low estimate of its density
(`whole_by_sample`) goes whole uncounted. auto allows
`index` only (`sparse_encodings`) and a threshold of at most 1/16 (its default): past 1/16 changed,
where a mask would win on bytes, the receiver's per-element unpack and scatter and the sender's
positions cost more than the bytes saved (measured on CPU), so such a tensor goes whole, for no
more than a full sync costs. The comparison runs
where the trainer's weights are (a GPU's memory on GPU); the copy stays in host memory, pinned
when it comes from a GPU (`to_host`), so the copies between the two overlap the host's work.
The pieces are ordinary tensors of the manifest, so bucketing, double buffering and
in-place receives work as for a full sync.

Anything that breaks the chain makes the next sync a full one that restarts it (`plan`): a server
that holds another base (joined, replaced, rejoined, or failed a load), a new sender (a trainer
restart or a resume from a checkpoint), a failed or aborted sync (the sender drops its copy).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, TypeVar

import torch

from kubedistill.api.spec import DeltaMode, DeltaSyncSpec
from kubedistill.runtime.weight_sync.transfer import torch_dtype
from kubedistill.runtime.wire.dtypes import numel
from kubedistill.runtime.wire.protocol import DeltaBase, Manifest, TensorMeta

INDEX, BLOCKS, MASK, VALUES = "#index", "#blocks", "#mask", "#values"
BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS
"""Positions travel as 16-bit offsets within blocks of this many elements, with each block's
count of changes (int32): 2 bytes a change instead of 4 or 8."""
Encoding = Literal["none", "index", "mask", "whole"]
Plan = Literal["full", "keep", "delta"]
"""full: a plain full sync, nothing kept; keep: a full sync that (re)starts the chain, both sides
keep a copy; delta: the changed elements only."""

T = TypeVar("T")
log = logging.getLogger("kubedistill.weight_sync")

MAX_BACKOFF = 64
"""auto: the most full syncs sent before trying a delta again after deltas did not pay."""


def new_chain() -> str:
    return f"{time.time_ns():x}-{os.getpid()}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its size (so -0.0 != 0.0 and a NaN equals itself)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


SPARSE: tuple[Encoding, ...] = ("index", "mask")


def sparse_encodings(mode: DeltaMode) -> tuple[Encoding, ...]:
    """The partial encodings a mode may use: auto only `index`, whose work is per change (with
    auto's threshold, at most 1/16, a tensor a mask would suit goes whole: no slower than a full
    sync); always both."""
    return ("index",) if mode is DeltaMode.auto else SPARSE


def choose(n: int, k: int, value_bytes: int, threshold: float, sparse: Sequence[Encoding] = SPARSE) -> Encoding:
    """The cheapest way to send k changed elements of n: the whole tensor past `threshold` (a
    changed fraction), else the fewest bytes among `sparse` and the whole tensor."""
    if k == 0:
        return "none"
    if k > threshold * n:
        return "whole"
    costs: dict[Encoding, int] = {
        "index": 4 * math.ceil(n / BLOCK) + k * (2 + value_bytes),
        "mask": math.ceil(n / 8) + k * value_bytes,
        "whole": n * value_bytes,
    }
    return min((e for e in costs if e in sparse or e == "whole"), key=lambda e: costs[e])


SAMPLE_RUN, SAMPLE_STRIDE, SAMPLE_RUNS = 64, 4096, (16, 64)
"""The density sample: 16 to 64 runs of 64 elements (whole cache lines), evenly spaced at least
4096 apart, at most 4096 elements a tensor whatever its size. A count, not a fraction of the
tensor, so its cost does not grow with the model (docs/design.md, "Smaller measurements")."""


SAMPLE_BATCH = 32
"""Tensors sampled together, with one cast, compare and count: on CPU each torch call has a
fixed cost, paid once a batch rather than once a tensor (docs/design.md, "Delta weight syncs").
Few enough that a trainer's gathered tensors are not all held at once."""


DENSE_START = 0.9
"""auto: a delta whose first sample batch would go whole for at least this share of its elements
is sent as a keep instead (`SentCopy.dense_start`)."""


def sample_runs(n: int) -> int:
    """How many runs a tensor of n elements is sampled in; 0 below 16 runs' spacing (counting is
    cheap there)."""
    least, most = SAMPLE_RUNS
    runs = min(most, n // SAMPLE_STRIDE)
    return runs if runs >= least else 0


def sample(t: torch.Tensor) -> torch.Tensor | None:
    """A view of a contiguous tensor's sampled elements, one run a row; None if too small."""
    runs = sample_runs(t.numel())
    if not runs:
        return None
    return t.as_strided((runs, SAMPLE_RUN), (t.numel() // runs, 1), t.storage_offset())


def sample_hits(items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.dtype]]) -> list[list[int]]:
    """For each (new, old, dtype): the changed elements in each run of their samples, `new` cast
    to `dtype` and compared bit for bit with `old`; [] for a tensor too small to sample or not
    contiguous. Tensors alike (dtypes, device) share one cast, compare and count."""
    hits: list[list[int]] = [[] for _ in items]
    alike: dict[tuple[torch.dtype, torch.device, torch.dtype], list[int]] = {}
    for i, (t, old, dtype) in enumerate(items):
        if sample_runs(t.numel()) and t.is_contiguous() and old.is_contiguous() and old.dtype == dtype:
            alike.setdefault((t.dtype, t.device, dtype), []).append(i)
    for (_, device, dtype), members in alike.items():
        new = torch.cat([sample(items[i][0]) for i in members]).to(dtype)
        old = torch.cat([sample(items[i][1]) for i in members]).to(device)
        counts = torch.count_nonzero(_bits(new) != _bits(old), dim=1)
        for i, part in zip(members, counts.split([sample_runs(items[i][0].numel()) for i in members])):
            hits[i] = part.tolist()
    return hits


def whole_by_sample(
    n: int, run_hits: Sequence[int], value_bytes: int, threshold: float, sparse: Sequence[Encoding] = SPARSE
) -> bool:
    """Whether a tensor of n elements goes whole without counting, from the changed elements
    in each run of its sample: `choose` says so at a low estimate of its density, the sampled
    density less two standard errors over the runs. Runs, not elements, are the independent
    draws: changes cluster (an embedding's rows of tokens that were not in the batch barely
    move), and a tensor an index would suit must not go whole on a few runs that hit them."""
    runs, total = len(run_hits), sum(run_hits)
    if runs < 2 or not total:
        return False
    mean = total / runs  # changed elements a run
    spread = math.sqrt(max(0.0, sum(h * h for h in run_hits) - total * mean) / (runs - 1))
    low = (mean - 2 * spread / math.sqrt(runs)) / SAMPLE_RUN
    return low > 0 and choose(n, int(n * low), value_bytes, threshold, sparse) == "whole"


class Scratch:
    """Flat work buffers reused from tensor to tensor and sync to sync: on CPU a fresh buffer of
    many MB costs its page faults, more than the pass itself (docs/design.md, "Delta weight
    syncs")."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, role: str, dtype: torch.dtype, device: torch.device, n: int) -> torch.Tensor:
        """A flat buffer of n elements, valid until the next `get` of the same role."""
        key = (role, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Flat bool -> uint8, 8 elements a byte, least significant bit first."""
    n = mask.numel()
    flags = mask.view(torch.uint8)
    if n % 8 or flags.storage_offset() % 8:
        flags = torch.cat([flags, flags.new_zeros(-n % 8)])
    # Each int64 holds 8 flags (0/1 bytes, little-endian: flag i at bit 8i); three shift-ors
    # gather them into the low byte (flag i at bit i), with no carries or overflow.
    w = flags.view(torch.int64)
    w = w | (w >> 7)
    w = w | (w >> 14)
    w = w | (w >> 28)
    return (w & 0xFF).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_bits undone: each byte's bits spread back to one 0/1 byte each, the shifts reversed."""
    w = packed.to(torch.int64)
    w = (w | (w << 28)) & 0x0000000F0000000F
    w = (w | (w << 14)) & 0x0003000300030003
    w = (w | (w << 7)) & 0x0101010101010101
    return w.view(torch.uint8)[:n].view(torch.bool)


Piece: TypeAlias = torch.Tensor | Callable[[], torch.Tensor]
"""A piece to send, or how to make it when the transfer draws it (`drawn`)."""


def drawn(pieces: Iterable[Piece]) -> Iterator[torch.Tensor]:
    """The pieces as tensors, each deferred one made only as it is drawn."""
    for p in pieces:
        yield p() if callable(p) else p


@dataclass
class Encoded:
    """One tensor's delta: its encoding, the changed count, the pieces to send, and the flat
    positions and values that turn the old tensor into the new one (None: unchanged or whole)."""

    kind: Encoding
    changed: int
    pieces: list[tuple[str, Piece]]
    positions: torch.Tensor | None = None
    values: torch.Tensor | None = None


def encode(
    name: str,
    new: torch.Tensor,
    old: torch.Tensor,
    threshold: float,
    sparse: Sequence[Encoding] = SPARSE,
    scratch: Scratch | None = None,
) -> Encoded:
    """The delta from `old` to `new` (same dtype, device and size). Counts the changed elements
    first (the bits' XOR: cheaper than a bool compare on CPU), and finds their positions only
    for an index or mask encoding."""
    scratch = scratch or Scratch()
    a, b = _bits(new.reshape(-1)), _bits(old.reshape(-1))
    n = a.numel()
    diff = torch.bitwise_xor(a, b, out=scratch.get("xor", a.dtype, a.device, n))
    k = int(torch.count_nonzero(diff))
    kind = choose(n, k, new.element_size(), threshold, sparse)
    if kind == "none":
        return Encoded(kind, k, [])
    if kind == "whole":
        return Encoded(kind, k, [(name, new)])
    idx = diff.nonzero().view(-1)
    values = new.reshape(-1).index_select(0, idx)
    if kind == "mask":
        mask = torch.ne(diff, 0, out=scratch.get("mask", torch.bool, a.device, n))
        return Encoded(kind, k, [(name + MASK, pack_bits(mask)), (name + VALUES, values)], idx, values)
    # Shifts and masks: an int64 division or remainder costs several times more on CPU.
    counts = torch.bincount(idx >> BLOCK_BITS, minlength=math.ceil(n / BLOCK)).to(torch.int32)
    # As the bytes of int16s (32768.. wrap to negative, undone on arrival): neither gloo nor NCCL
    # broadcasts int16.
    offsets = (idx & (BLOCK - 1)).to(torch.int16).view(torch.uint8)
    pieces = [(name + BLOCKS, counts), (name + INDEX, offsets), (name + VALUES, values)]
    return Encoded(kind, k, pieces, idx, values)


def block_positions(counts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Flat int64 positions from per-block counts and in-block offsets (int16s as bytes)."""
    blocks = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts.long())
    return blocks * BLOCK + (offsets.view(torch.int16).long() & (BLOCK - 1))


@dataclass
class DeltaStats:
    """What one sync sent, against a full sync of the same weights."""

    plan: Plan = "full"
    changed: int = 0
    elements: int = 0
    full_bytes: int = 0
    encodings: dict[str, int] = field(default_factory=dict)
    encode_seconds: float = 0.0

    @property
    def density(self) -> float:
        return self.changed / self.elements if self.elements else 1.0


class SentCopy:
    """What every receiver of the group holds, bit for bit: the sender's copy of the last sync
    (host memory, pinned from a GPU, the engines' dtype: one more model's worth of RAM on the
    trainer's rank 0)."""

    def __init__(self, chain: str, version: int, tensors: dict[str, torch.Tensor]):
        self.base = DeltaBase(chain=chain, version=version)
        self.tensors = tensors
        self.scratch = Scratch()
        """Work buffers of the compare pass: up to the largest tensor's size in the wire dtype,
        its bits' integers and a bool each."""

    def fits(self, metas: Sequence[TensorMeta]) -> bool:
        """Whether the copy holds exactly these tensors (names, dtypes, shapes), so a delta can
        be taken against it (else the sync goes full, and the receivers refuse it as they would)."""
        return len(metas) == len(self.tensors) and all(
            (t := self.tensors.get(m.name)) is not None and _dtype(t) == m.dtype and list(t.shape) == m.shape
            for m in metas
        )

    def dense_start(
        self,
        metas: Sequence[TensorMeta],
        pairs: Sequence[tuple[str, torch.Tensor]],
        threshold: float,
        sparse: Sequence[Encoding] = SPARSE,
    ) -> bool:
        """Whether a sync's first tensors (one sample batch, with their metas) would go whole on
        their samples for DENSE_START of their elements or more. auto then sends the sync as a
        keep (a full sync that restarts the chain): the rest of a trainer that moved every weight
        goes whole too, and a delta of whole tensors costs a full sync plus its compare pass and
        the receivers' patching (docs/design.md, "Delta weight syncs")."""
        items = self._against_copy(list(zip(metas, pairs, strict=True)))
        elements = sum(old.numel() for _, old, _ in items)
        whole = sum(
            old.numel()
            for (_, old, _), hits in zip(items, sample_hits(items))
            if whole_by_sample(old.numel(), hits, old.element_size(), threshold, sparse)
        )
        return bool(elements > 0 and whole >= DENSE_START * elements)

    def delta(
        self,
        metas: Sequence[TensorMeta],
        pairs: Iterable[tuple[str, torch.Tensor]],
        threshold: float,
        sparse: Sequence[Encoding] = SPARSE,
    ) -> tuple[list[TensorMeta], list[Piece], DeltaStats]:
        """The pieces of a delta from this copy to `pairs` (cast to the metas' dtypes), updating
        the copy in place to the new weights (drop it if the sync then fails). A whole tensor
        travels as the updated copy itself (on CPU), which the next delta alone rewrites; one
        that goes whole on its sample and sits beside the copy (host memory) is cast into the copy
        only when drawn (`drawn`), during the transfer as a full sync casts, so a delta of mostly
        whole tensors costs what a full sync does."""
        stats = DeltaStats(plan="delta")
        t0 = time.perf_counter()
        pieces: list[TensorMeta] = []
        tensors: list[Piece] = []
        for batch in _batched(zip(metas, pairs, strict=True), SAMPLE_BATCH):
            drawn_now = self._against_copy(batch)
            for (_, (name, _)), (t, old, dtype), hits in zip(batch, drawn_now, sample_hits(drawn_now)):
                enc = self._encode(name, t, old, dtype, hits, threshold, sparse)
                stats.changed += enc.changed
                stats.elements += old.numel()
                stats.full_bytes += old.numel() * old.element_size()
                stats.encodings[enc.kind] = stats.encodings.get(enc.kind, 0) + 1
                for pname, piece in enc.pieces:
                    shaped = old if callable(piece) else piece  # a deferred whole tensor comes as the copy
                    pieces.append(TensorMeta(name=pname, dtype=_dtype(shaped), shape=list(shaped.shape)))
                    tensors.append(piece)
        stats.encode_seconds = time.perf_counter() - t0
        return pieces, tensors, stats

    def _against_copy(
        self, batch: Sequence[tuple[TensorMeta, tuple[str, torch.Tensor]]]
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.dtype]]:
        """(new, its copy, the wire dtype) for each (meta, (name, tensor)), each name checked
        against its meta."""
        for meta, (name, _) in batch:
            if name != meta.name:
                raise ValueError(f"weight {name!r} where the manifest has {meta.name!r}")
        return [(t.detach(), self.tensors[name], torch_dtype(meta.dtype)) for meta, (name, t) in batch]

    def _encode(
        self,
        name: str,
        t: torch.Tensor,
        old: torch.Tensor,
        dtype: torch.dtype,
        hits: list[int],
        threshold: float,
        sparse: Sequence[Encoding],
    ) -> Encoded:
        """One tensor's delta against its copy, the copy updated (or to be, as drawn)."""
        if whole_by_sample(old.numel(), hits, old.element_size(), threshold, sparse):
            # Mostly changed: no full compare, no positions; `changed` is the sample's estimate.
            # On the copy's device the cast waits for the transfer; from a GPU it is done now,
            # in GPU memory (deferring would hold the gathered float32 tensors until sent).
            whole: Piece = functools.partial(_whole, t, old) if t.device == old.device else _whole(t, old)
            return Encoded("whole", old.numel() * sum(hits) // (len(hits) * SAMPLE_RUN), [(name, whole)])
        # Compared where the weights are (a GPU's memory is the fastest place for this
        # pass); only the host copy's changed elements are written back.
        new = _cast(t, dtype, self.scratch)
        enc = encode(name, new, old.to(new.device, non_blocking=True), threshold, sparse, self.scratch)
        if enc.kind == "whole":
            old.copy_(new)
            enc.pieces = [(name, old if old.device == new.device else new.clone())]  # new: scratch
        elif enc.positions is not None and enc.values is not None:
            old.view(-1).index_copy_(0, enc.positions.cpu(), enc.values.cpu())
        return enc


def _batched(items: Iterable[T], n: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _whole(t: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The copy set to `t` (cast as a full sync casts it), and the tensor to send: the copy itself
    where `t` is (no scratch, no second pass), else `t` cast where it is."""
    if t.device == old.device:
        return old.copy_(t)
    new = t.to(old.dtype)
    old.copy_(new)
    return new


def _cast(t: torch.Tensor, dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
    """`t` in `dtype`, contiguous: itself when it already is, else cast into a scratch buffer."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return scratch.get("new", dtype, t.device, t.numel()).view(t.shape).copy_(t)


def host_copy(source: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """What a sync that starts a chain keeps of a tensor it sends: the sent tensor itself where
    the cast to the wire dtype made it new in host memory (a CPU trainer: nothing else holds it,
    and a fresh copy would cost its page faults: docs/design.md, "Smaller measurements"), else
    a copy in host memory (`to_host`: the sent tensor is the trainer's own, or in GPU memory)."""
    if (
        sent is not source
        and sent.device.type == "cpu"
        and sent.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    ):
        return sent.detach()
    return to_host(sent)


def pin_host_copies(device: torch.device) -> bool:
    """Whether the host copy of a tensor on `device` is pinned (page-locked): only from a CUDA
    device, whose copies to and from pinned memory go by DMA at the bus's speed, without a
    staging copy, and with non_blocking=True overlap the host's work (the compare pass streams
    the copy to the GPU; a vLLM worker's delta load reads it). From the CPU nothing crosses a
    bus, and pinning there needs an accelerator anyway."""
    return bool(device.type == "cuda")


_pin_failed = False


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` in host memory, pinned when `t` is on a CUDA device
    (`pin_host_copies`); pageable where pinning is refused (no pinned allocator, or the host
    will not lock that much memory), logged once."""
    global _pin_failed
    t = t.detach()
    if pin_host_copies(t.device) and not _pin_failed:
        try:
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError as e:
            _pin_failed = True
            log.warning("delta sync: host copies stay pageable, pinning failed: %s", e)
        else:
            return pinned.copy_(t)
    return t.to("cpu", copy=True, memory_format=torch.contiguous_format)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class Backoff:
    """auto mode's memory of whether deltas paid: the last full and delta sync seconds, and how
    many full syncs to send before trying a delta again."""

    full_seconds: float | None = None
    delta_seconds: float | None = None
    skip: int = 0
    """Full syncs still to send before the next delta attempt."""
    losses: int = 0
    """Delta attempts in a row that were slower than a full sync."""

    def observe(self, plan: Plan, seconds: float) -> None:
        if plan == "delta":
            self.delta_seconds = seconds
            if self.full_seconds is not None and seconds > self.full_seconds:
                self.losses += 1
                self.skip = min(2**self.losses, MAX_BACKOFF)
            else:
                self.losses = 0
        else:
            self.full_seconds = seconds
            self.skip = max(0, self.skip - 1)


def plan(
    spec: DeltaSyncSpec,
    held: DeltaBase | None,
    bases: Sequence[DeltaBase | None],
    wire_dtype: str | None,
    lora: bool,
    backoff: Backoff,
) -> Plan:
    """How the next sync travels. `held`: the sender's copy's base (None: it keeps none);
    `bases`: what each receiver holds. A delta needs every receiver on the sender's base; a
    delta is pointless for LoRA adapters (their own path) and unsafe when the servers keep
    different dtypes (no single copy matches them all)."""
    if spec.mode is DeltaMode.never or lora or wire_dtype is None:
        return "full"
    if spec.mode is DeltaMode.auto and backoff.skip > 1:
        return "full"  # deltas did not pay lately; the last full sync before a retry keeps a copy
    if held is not None and bases and all(b == held for b in bases):
        return "delta"
    return "keep"


def check_delta(manifest: Manifest, expected: Mapping[str, Sequence[int]], held: DeltaBase | None) -> None:
    """A delta manifest must patch the base this engine holds, and its pieces must name its
    targets with consistent sizes (ValueError, one line, otherwise)."""
    delta = manifest.delta
    assert delta is not None and delta.base is not None
    if held != delta.base:
        have = "no delta base" if held is None else f"base {held.chain}@{held.version}"
        raise ValueError(
            f"delta base mismatch: the sync patches {delta.base.chain}@{delta.base.version}, this engine holds {have}"
        )
    targets = {t.name: t for t in delta.targets}
    for p in manifest.tensors:
        name, _, kind = p.name.partition("#")
        t = targets.get(name)
        if t is None or (not kind and (p.shape != t.shape or p.dtype != t.dtype)):
            raise ValueError(f"delta piece {p.name!r} does not match a target tensor")
        n = numel(t.shape)
        if kind == MASK[1:] and p.shape != [math.ceil(n / 8)]:
            raise ValueError(f"delta piece {p.name!r}: a mask of {n} elements has {math.ceil(n / 8)} bytes")
        if kind and kind not in (INDEX[1:], BLOCKS[1:], MASK[1:], VALUES[1:]):
            raise ValueError(f"delta piece {p.name!r}: unknown kind {kind!r}")


Patch = tuple[str, torch.Tensor | None, torch.Tensor]
"""(target, positions: flat int64 indices or a flat bool mask, None for a whole tensor, values)."""


class Assembler:
    """A receiver's side: pieces arrive bucket by bucket (a target's pieces may travel in
    different buckets, one per dtype); `add` returns each target's patch once it is complete.
    The pieces it holds are views of their buckets, which receive() never reuses."""

    def __init__(self, targets: Sequence[TensorMeta]):
        self.numel = {t.name: numel(t.shape) for t in targets}
        self._pieces: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, t: torch.Tensor) -> list[Patch]:
        target, _, kind = name.partition("#")
        if not kind:
            return [(target, None, t)]
        got = self._pieces.setdefault(target, {})
        got[kind] = t
        if VALUES[1:] not in got:
            return []
        if MASK[1:] in got:
            positions = unpack_bits(got[MASK[1:]], self.numel[target])
        elif INDEX[1:] in got and BLOCKS[1:] in got:
            positions = block_positions(got[BLOCKS[1:]], got[INDEX[1:]])
        else:
            return []
        del self._pieces[target]
        return [(target, positions, got[VALUES[1:]])]

    def check_done(self) -> None:
        left = sorted(self._pieces)
        if left:
            raise ValueError(f"delta pieces of {left[:3]} arrived incomplete")


def apply(dest: torch.Tensor, positions: torch.Tensor | None, values: torch.Tensor) -> None:
    """Patch `dest` in place (contiguous): a whole tensor is copied (unless it was received into
    `dest` itself)."""
    if positions is None:
        if values.data_ptr() != dest.data_ptr():
            dest.copy_(values.view(dest.shape))
        return
    flat = dest.view(-1)
    if positions.dtype == torch.bool:
        flat[positions.to(dest.device)] = values.to(dest.device)
    else:
        flat.index_copy_(0, positions.to(dest.device), values.to(dest.device))
