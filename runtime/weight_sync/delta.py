"""Sparse delta weight syncs (spec.weightSync.delta): send only the elements that changed since
the version every receiver holds, exactly.

Exactness: the sender keeps a copy of what it last sent, in the dtype the engines keep (the wire
dtype), and compares the new weights with it bit for bit after the same cast a full sync makes.
A changed element travels with its new bits; an unchanged one is, bit for bit, what the receiver
already holds. So a receiver that patches its base ends with the very tensors a full sync of the
same version would have given it: the hf engine patches its parameters in place; a vLLM worker
patches its copy of the last tensors it loaded (unfused, HF names) and feeds them to the loader,
which fuses qkv/gate_up as for a full sync.

Per tensor the sender picks the cheapest encoding (bytes on the wire, pure: `choose`): nothing
(unchanged), `index` (flat positions + values: 4 or 8 bytes a change more), `mask` (one bit per
element + values) or the whole tensor; a tensor whose changed fraction exceeds densityThreshold
goes whole. The pieces are ordinary tensors of the manifest, so bucketing, double buffering and
in-place receives work as for a full sync.

Anything that breaks the chain makes the next sync a full one that restarts it (`plan`): a server
that holds another base (joined, replaced, rejoined, or failed a load), a new sender (a trainer
restart or a resume from a checkpoint), a failed or aborted sync (the sender drops its copy).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kubedistill.api.spec import DeltaMode, DeltaSyncSpec
from kubedistill.runtime.wire.dtypes import numel
from kubedistill.runtime.wire.protocol import DeltaBase, Manifest, TensorMeta

INDEX, MASK, VALUES = "#index", "#mask", "#values"
Encoding = Literal["none", "index", "mask", "whole"]
Plan = Literal["full", "keep", "delta"]
"""full: a plain full sync, nothing kept; keep: a full sync that (re)starts the chain, both sides
keep a copy; delta: the changed elements only."""

MAX_BACKOFF = 64
"""auto: the most full syncs sent before trying a delta again after deltas did not pay."""


def new_chain() -> str:
    return f"{time.time_ns():x}-{os.getpid()}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its size (so -0.0 != 0.0 and a NaN equals itself)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat bool: where the bits differ."""
    return (_bits(new.reshape(-1)) != _bits(old.reshape(-1))).view(-1)


def index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def choose(n: int, k: int, value_bytes: int, threshold: float) -> Encoding:
    """The cheapest way to send k changed elements of n: fewest bytes, the whole tensor past
    `threshold` (a changed fraction)."""
    if k == 0:
        return "none"
    if k > threshold * n:
        return "whole"
    costs: dict[Encoding, int] = {
        "index": k * (value_bytes + torch.empty(0, dtype=index_dtype(n)).element_size()),
        "mask": math.ceil(n / 8) + k * value_bytes,
        "whole": n * value_bytes,
    }
    return min(costs, key=lambda e: costs[e])


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Flat bool -> uint8, 8 elements a byte, least significant bit first."""
    n = mask.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    return (padded.view(-1, 8) << _SHIFTS.to(mask.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return ((packed.view(-1, 1) >> _SHIFTS.to(packed.device)) & 1).view(-1)[:n].bool()


def encode(
    name: str, new: torch.Tensor, old: torch.Tensor, threshold: float
) -> tuple[Encoding, int, list[tuple[str, torch.Tensor]]]:
    """(encoding, changed count, the pieces to send) for `new` against `old` (same dtype)."""
    mask = changed(new, old)
    k = int(mask.sum())
    kind = choose(mask.numel(), k, new.element_size(), threshold)
    flat = new.reshape(-1)
    if kind == "none":
        return kind, k, []
    if kind == "whole":
        return kind, k, [(name, new)]
    if kind == "index":
        idx = mask.nonzero().view(-1).to(index_dtype(mask.numel()))
        return kind, k, [(name + INDEX, idx), (name + VALUES, flat[idx.long()])]
    return kind, k, [(name + MASK, pack_bits(mask)), (name + VALUES, flat[mask])]


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
    (host memory, the engines' dtype: one more model's worth of RAM on the trainer's rank 0)."""

    def __init__(self, chain: str, version: int, tensors: dict[str, torch.Tensor]):
        self.base = DeltaBase(chain=chain, version=version)
        self.tensors = tensors

    def fits(self, metas: Sequence[TensorMeta]) -> bool:
        """Whether the copy holds exactly these tensors (names, dtypes, shapes), so a delta can
        be taken against it (else the sync goes full, and the receivers refuse it as they would)."""
        return len(metas) == len(self.tensors) and all(
            (t := self.tensors.get(m.name)) is not None and _dtype(t) == m.dtype and list(t.shape) == m.shape
            for m in metas
        )

    def delta(
        self, metas: Sequence[TensorMeta], pairs: Iterable[tuple[str, torch.Tensor]], threshold: float
    ) -> tuple[list[TensorMeta], list[torch.Tensor], DeltaStats]:
        """The pieces of a delta from this copy to `pairs` (cast to the metas' dtypes), updating
        the copy in place to the new weights (drop it if the sync then fails)."""
        from kubedistill.runtime.weight_sync.transfer import torch_dtype

        stats = DeltaStats(plan="delta")
        t0 = time.perf_counter()
        pieces: list[TensorMeta] = []
        tensors: list[torch.Tensor] = []
        for meta, (name, t) in zip(metas, pairs, strict=True):
            if name != meta.name:
                raise ValueError(f"weight {name!r} where the manifest has {meta.name!r}")
            old = self.tensors[name]
            new = t.detach().to(device=old.device, dtype=torch_dtype(meta.dtype))
            kind, k, out = encode(name, new, old, threshold)
            if k:
                old.copy_(new)
            stats.changed += k
            stats.elements += old.numel()
            stats.full_bytes += old.numel() * old.element_size()
            stats.encodings[kind] = stats.encodings.get(kind, 0) + 1
            for pname, piece in out:
                # A whole tensor is sent from the copy: it holds the new weights until the next sync.
                piece = old if pname == name else piece
                pieces.append(TensorMeta(name=pname, dtype=_dtype(piece), shape=list(piece.shape)))
                tensors.append(piece)
        stats.encode_seconds = time.perf_counter() - t0
        return pieces, tensors, stats


def keeping(
    pairs: Iterable[tuple[str, torch.Tensor]], into: dict[str, torch.Tensor], active: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the (already cast) weights of a full sync through, copying each to host memory when
    `active` (a sync that starts a chain)."""
    for name, t in pairs:
        if active:
            into[name] = t.detach().to("cpu", copy=True)
        yield name, t


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
    if spec.mode is DeltaMode.off or lora or wire_dtype is None:
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
        if kind and kind not in (INDEX[1:], MASK[1:], VALUES[1:]):
            raise ValueError(f"delta piece {p.name!r}: unknown kind {kind!r}")


Patch = tuple[str, torch.Tensor | None, torch.Tensor]
"""(target, positions: flat int64 indices or a flat bool mask, None for a whole tensor, values)."""


class Assembler:
    """A receiver's side: pieces arrive bucket by bucket (an index and its values may travel in
    different buckets, one per dtype); `add` returns each target's patch once it is complete.
    The pieces it holds are views of their buckets, which receive() never reuses."""

    def __init__(self, targets: Sequence[TensorMeta]):
        self.numel = {t.name: numel(t.shape) for t in targets}
        self._positions: dict[str, torch.Tensor] = {}
        self._values: dict[str, torch.Tensor] = {}

    def add(self, name: str, t: torch.Tensor) -> list[Patch]:
        target, _, kind = name.partition("#")
        if not kind:
            return [(target, None, t)]
        if kind == VALUES[1:]:
            self._values[target] = t
        elif kind == MASK[1:]:
            self._positions[target] = unpack_bits(t, self.numel[target])
        else:
            self._positions[target] = t.long()
        if target in self._positions and target in self._values:
            return [(target, self._positions.pop(target), self._values.pop(target))]
        return []

    def check_done(self) -> None:
        left = sorted(set(self._positions) | set(self._values))
        if left:
            raise ValueError(f"delta pieces without their pair: {left[:3]}")


def apply(dest: torch.Tensor, positions: torch.Tensor | None, values: torch.Tensor) -> None:
    """Patch `dest` in place (contiguous): a whole tensor is copied."""
    if positions is None:
        dest.copy_(values.view(dest.shape))
        return
    flat = dest.view(-1)
    if positions.dtype == torch.bool:
        flat[positions.to(dest.device)] = values.to(dest.device)
    else:
        flat.index_copy_(0, positions.to(dest.device), values.to(dest.device))
