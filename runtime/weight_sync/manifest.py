"""The ordered manifest and its flat-bucket layout. Pure: the sender lays the buckets out, the
receiver checks the layout it is sent."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from kubedistill.runtime.wire.dtypes import dtype_name, dtype_size, numel
from kubedistill.runtime.wire.protocol import Bucket, BucketEntry, Manifest, TensorMeta

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def layer_of(name: str) -> str | None:
    """The decoder layer a weight belongs to ("model.layers.3.mlp..." -> "3"), if any."""
    m = _LAYER.search(name)
    return m.group(1) if m else None


def bucket_layout(tensors: Sequence[TensorMeta], bucket_bytes: int, direct_bytes: int | None = None) -> Manifest:
    """Pack tensors in order into flat buckets of at most `bucket_bytes` (a larger tensor gets a
    bucket of its own). A bucket holds one dtype; a dtype change closes the open bucket of that
    dtype only when it fills, so interleaved dtypes (e.g. fp32 norms between bf16 weights) still
    share buckets. Buckets are ordered by when they close, which is also when they can be sent.
    Tensors of at least `direct_bytes` get a bucket of their own: such a bucket is broadcast
    straight from the sender's tensor into the receiver's parameter where the engine allows it,
    with no packing or unpacking copy.

    Buckets close at decoder-layer boundaries: a receiver that reloads layer by layer (vLLM)
    completes each layer as its last bucket lands, instead of keeping every layer's partial
    weights until a bucket of small tensors (norms, biases) closes at the very end."""
    buckets: list[Bucket] = []
    open_: dict[str, tuple[list[BucketEntry], int]] = {}
    layer: str | None = None
    for i, t in enumerate(tensors):
        if i and layer_of(t.name) != layer:
            for dtype, (entries, used) in open_.items():
                if entries:
                    buckets.append(Bucket(dtype=dtype, numel=used, entries=entries))
            open_.clear()
        layer = layer_of(t.name)
        size = dtype_size(t.dtype)
        n = numel(t.shape)
        if n == 0:
            raise ValueError(f"tensor {t.name!r} is empty; nothing to sync")
        if direct_bytes is not None and n * size >= direct_bytes:
            buckets.append(Bucket(dtype=t.dtype, numel=n, entries=[BucketEntry(index=i, offset=0)]))
            continue
        entries, used = open_.get(t.dtype, ([], 0))
        if entries and (used + n) * size > bucket_bytes:
            buckets.append(Bucket(dtype=t.dtype, numel=used, entries=entries))
            entries, used = [], 0
        entries.append(BucketEntry(index=i, offset=used))
        open_[t.dtype] = (entries, used + n)
    for dtype, (entries, used) in open_.items():
        if entries:
            buckets.append(Bucket(dtype=dtype, numel=used, entries=entries))
    return Manifest(bucket_bytes=bucket_bytes, tensors=list(tensors), buckets=buckets)


def check_layout(manifest: Manifest) -> None:
    """Every tensor in exactly one bucket of its dtype, entries contiguous and in range."""
    seen: set[int] = set()
    for b, bucket in enumerate(manifest.buckets):
        dtype_size(bucket.dtype)
        end = 0
        for e in bucket.entries:
            if e.index >= len(manifest.tensors) or e.index in seen:
                raise ValueError(f"manifest bucket {b}: tensor index {e.index} is out of range or repeated")
            t = manifest.tensors[e.index]
            if t.dtype != bucket.dtype:
                raise ValueError(f"manifest bucket {b}: {t.name} is {t.dtype}, bucket is {bucket.dtype}")
            if e.offset != end:
                raise ValueError(f"manifest bucket {b}: {t.name} at offset {e.offset}, expected {end}")
            end += numel(t.shape)
            seen.add(e.index)
        if end != bucket.numel:
            raise ValueError(f"manifest bucket {b}: entries cover {end} elements, numel says {bucket.numel}")
    if len(seen) != len(manifest.tensors):
        raise ValueError("manifest: some tensors are in no bucket")


def check_against(manifest: Manifest, expected: Mapping[str, Sequence[int]]) -> None:
    """The manifest must name exactly the engine's tensors, with the same shapes, but for those
    under its frozen prefixes, which the engine keeps (a delta's: its targets)."""
    check_layout(manifest)
    delta = manifest.delta
    tensors = delta.targets if delta is not None and delta.base is not None else manifest.tensors
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError("manifest mismatch: a tensor name appears twice")
    unknown = [n for n in names if n not in expected]
    kept = tuple(manifest.frozen)
    missing = [n for n in expected if n not in set(names) and not (kept and n.startswith(kept))]
    if unknown or missing:
        raise ValueError(
            "manifest mismatch: "
            + "; ".join(
                part
                for part in (
                    f"unknown tensors {_few(unknown)}" if unknown else "",
                    f"missing tensors {_few(missing)}" if missing else "",
                )
                if part
            )
        )
    for t in tensors:
        if list(t.shape) != list(expected[t.name]):
            raise ValueError(
                f"manifest mismatch: {t.name} has shape {list(t.shape)}, the engine's is {list(expected[t.name])}"
            )


def _few(names: Iterable[str], k: int = 3) -> str:
    names = list(names)
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(names[:k]) + more


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes: equal checksums mean bit-for-bit equal."""
    import hashlib

    import torch

    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{dtype_name(t.dtype)}{list(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
