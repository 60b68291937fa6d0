"""Delta weight syncs without servers: encodings chosen by bytes, patches that land bit for bit
(signed zeros and NaNs included), the plan's fall-backs to a full sync, auto's back-off, and a
sender's copy that follows the weights it sent."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kubedistill.api.enums import AUTO_DENSITY_THRESHOLD
from kubedistill.api.spec import DeltaMode, DeltaSyncSpec, DistillationJobSpec
from kubedistill.runtime.weight_sync.delta import (
    MAX_BACKOFF,
    Assembler,
    Backoff,
    SentCopy,
    apply,
    check_delta,
    choose,
    drawn,
    encode,
    host_copy,
    pack_bits,
    pin_host_copies,
    plan,
    sample,
    sparse_encodings,
    to_host,
    unpack_bits,
    whole_by_sample,
)
from kubedistill.runtime.weight_sync.manifest import bucket_layout, tensor_checksum
from kubedistill.runtime.wire.protocol import DeltaBase, ManifestDelta, TensorMeta

torch.set_num_threads(1)


def test_encoding_is_the_fewest_bytes_and_whole_past_the_threshold() -> None:
    # bf16 values (2 bytes): index costs 4 bytes a change (+4 per 65536 elements), a mask n/8 + 2 a change.
    n = 1 << 20
    assert choose(n, 0, 2, 0.5) == "none"
    assert choose(n, n // 32, 2, 0.5) == "index"  # 4/32 < 1/8 + 2/32
    assert choose(n, n // 8, 2, 0.5) == "mask"  # 1/8 + 2/8 < 4/8
    assert choose(n, n // 2 + 1, 2, 0.5) == "whole"  # past the threshold
    assert choose(n, n // 2 + 1, 2, 1.0) == "mask"  # 1/8 + 1 < 2
    assert choose(n, n - 1, 2, 1.0) == "whole"  # a mask and nearly every value costs more
    assert choose(1000, 1, 4, 1.0) == "index" and choose(8, 1, 4, 1.0) == "mask"  # 4 + 6 > 1 + 4 bytes


def test_auto_sends_a_tensor_whole_where_a_mask_would_be_cheapest() -> None:
    # auto: index only, at its default threshold of 1/16: past it the mask wins on bytes, so the
    # tensor goes whole.
    n, auto, always = 1 << 20, sparse_encodings(DeltaMode.auto), sparse_encodings(DeltaMode.always)
    at = DeltaSyncSpec(mode=DeltaMode.auto).threshold
    assert auto == ("index",) and always == ("index", "mask")
    assert (at, DeltaSyncSpec(mode=DeltaMode.always).threshold) == (AUTO_DENSITY_THRESHOLD, 0.5) == (1 / 16, 0.5)
    assert choose(n, n // 32, 2, at, auto) == "index"
    assert choose(n, n // 8, 2, at, auto) == "whole"
    assert choose(n, n // 8, 2, 0.5, always) == "mask"
    assert choose(n, 0, 2, at, auto) == "none"


@pytest.mark.parametrize("value_bytes", [1, 2, 4])
def test_auto_honours_every_threshold_it_accepts(value_bytes: int) -> None:
    """In auto a tensor at or below densityThreshold goes as an index, above it whole, for every
    threshold auto accepts (up to 1/16: where a mask would beat the index by a few bytes, auto,
    which has no mask, still sends the index, not the whole tensor)."""
    n, auto = 1 << 20, sparse_encodings(DeltaMode.auto)
    for threshold in (0.001, 0.01, 0.03, 0.05, AUTO_DENSITY_THRESHOLD):
        at = int(threshold * n)
        spec = DeltaSyncSpec(mode=DeltaMode.auto, densityThreshold=threshold)
        assert choose(n, at, value_bytes, spec.threshold, auto) == "index", threshold
        assert choose(n, at + 1, value_bytes, spec.threshold, auto) == "whole", threshold
    with pytest.raises(ValueError, match="densityThreshold: must be at most 0.0625 with delta mode auto"):
        DistillationJobSpec.model_validate(
            {
                "student": {"model": "/m/s"},
                "teachers": [{"name": "t", "model": "/m/t"}],
                "trainer": {"miniBatchSize": 4},
                "data": {"train": ["/d/t.parquet"]},
                "weightSync": {"delta": {"mode": "auto", "densityThreshold": 0.1}},
            }
        )


def test_a_tensor_goes_whole_on_its_sample_only_when_clearly_dense() -> None:
    n, auto, always = 1 << 20, ("index",), ("index", "mask")
    flat = torch.arange(n)
    s = sample(flat)
    assert s is not None and s.shape == (64, 64) and s[1, 0] == n // 64 and s[0, -1] == 63  # runs of 64
    assert sample(flat[: 16 * 4096]).shape == (16, 64)  # at least 16 runs, 4096 apart
    assert sample(flat[: 16 * 4096 - 1]) is None  # small tensors are counted, not sampled
    # auto: a mask wins past 1/16 changed, so the low estimate must show past 1/16
    assert whole_by_sample(n, [8] * 64, 2, AUTO_DENSITY_THRESHOLD, auto)  # 1/8 in every run
    assert whole_by_sample(n, [5, 6] * 32, 2, AUTO_DENSITY_THRESHOLD, auto)  # 1/12 in every run: sure enough
    assert not whole_by_sample(n, [3, 5] * 32, 2, AUTO_DENSITY_THRESHOLD, auto)  # 1/16 on average: count it
    assert not whole_by_sample(n, [0] * 64, 2, AUTO_DENSITY_THRESHOLD, auto)
    # Clustered: 1/8 of the runs wholly changed is 1/8 on average, but the runs disagree.
    assert not whole_by_sample(n, [64] * 2 + [0] * 14, 2, AUTO_DENSITY_THRESHOLD, auto)
    assert whole_by_sample(n, [64] * 12 + [0] * 4, 2, AUTO_DENSITY_THRESHOLD, auto)
    # always: past the threshold, or where whole beats a mask
    assert whole_by_sample(n, [60] * 64, 2, 0.5, always)
    assert not whole_by_sample(n, [40] * 64, 2, 0.7, always)  # a mask: 1/8 + 5/8 * 2 < 2 bytes
    assert whole_by_sample(n, [64] * 64, 2, 1.0, always)  # a mask and every value cost more


def test_bits_pack_and_unpack() -> None:
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 1000):
        for mask in (torch.rand(n, generator=g) < 0.3, (torch.rand(n + 3, generator=g) < 0.7)[3:]):
            packed = pack_bits(mask)  # the second: a view at an unaligned offset
            assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
            assert [(int(packed[i // 8]) >> (i % 8)) & 1 for i in range(n)] == mask.int().tolist()
            assert torch.equal(unpack_bits(packed, n), mask)


@pytest.mark.parametrize(
    ("dtype", "fraction", "shape"),
    [
        (torch.bfloat16, 0.001, (64, 97)),
        (torch.bfloat16, 0.001, (400, 700)),  # 5 blocks of 65536, offsets past int16's range
        (torch.bfloat16, 0.1, (64, 97)),
        (torch.float32, 0.9, (64, 97)),
    ],
)
def test_a_patched_copy_is_bit_identical_to_the_new_tensor(dtype: torch.dtype, fraction: float, shape) -> None:
    g = torch.Generator().manual_seed(1)
    old = torch.randn(*shape, generator=g).to(dtype)
    old.view(-1)[:4] = torch.tensor([0.0, -0.0, float("nan"), 1.0]).to(dtype)
    new = old.clone()
    hit = torch.rand(old.shape, generator=g) < fraction
    new[hit] = (new[hit].float() + 1e-2).to(dtype)
    new.view(-1)[:4] = torch.tensor([-0.0, 0.0, float("nan"), 1.0]).to(dtype)  # sign flips; NaN stays
    enc = encode("w", new, old, threshold=0.5)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert enc.changed == int((new.view(bits) != old.view(bits)).sum()) >= 2  # signed zeros count, the NaN not
    assert enc.kind == {0.001: "index", 0.1: "mask", 0.9: "whole"}[fraction]
    pieces = enc.pieces
    receiver = old.clone()
    patches = Assembler([TensorMeta(name="w", dtype=str(dtype).removeprefix("torch."), shape=list(old.shape))])
    for name, piece in reversed(pieces):  # values may arrive before their positions (another bucket)
        for target, positions, values in patches.add(name, piece.clone()):
            assert target == "w"
            apply(receiver, positions, values)
    patches.check_done()
    assert tensor_checksum(receiver) == tensor_checksum(new)


def test_unchanged_tensors_send_nothing() -> None:
    t = torch.randn(10, 10)
    enc = encode("w", t.clone(), t, 0.5)
    assert (enc.kind, enc.changed, enc.pieces) == ("none", 0, [])


def test_the_senders_copy_follows_what_it_sent() -> None:
    g = torch.Generator().manual_seed(2)
    fp32 = {"a": torch.randn(100, 8, generator=g), "b": torch.randn(3000, generator=g)}
    metas = [TensorMeta(name=n, dtype="bfloat16", shape=list(t.shape)) for n, t in fp32.items()]
    copy = SentCopy("c1", 3, {n: t.to(torch.bfloat16) for n, t in fp32.items()})
    nxt = {n: t.clone() for n, t in fp32.items()}
    nxt["b"][:30] += 1.0  # a's change stays below half a bf16 ulp: nothing to send for it
    nxt["a"] += 1e-7
    pieces, parts, stats = copy.delta(metas, nxt.items(), threshold=0.5)
    tensors = list(drawn(parts))
    assert [p.name for p in pieces] == ["b#blocks", "b#index", "b#values"]
    assert [list(t.shape) for t in tensors] == [[1], [60], [30]]  # int16 offsets travel as bytes
    assert stats.changed == 30 and stats.elements == 3800 and stats.full_bytes == 3800 * 2
    assert stats.encodings == {"none": 1, "index": 1}
    for n, t in nxt.items():
        assert tensor_checksum(copy.tensors[n]) == tensor_checksum(t.to(torch.bfloat16))


def test_a_copy_kept_across_syncs_stays_exact_and_sends_whole_tensors_as_itself() -> None:
    # Three deltas in a row through the same copy (its work buffers reused), auto's encodings:
    # the dense tensors go whole (the large one on its sample, uncounted), as the updated copy
    # itself; the sparse one as indices.
    g = torch.Generator().manual_seed(3)
    w = {
        "dense": torch.randn(64, 64, generator=g),
        "large": torch.randn(256, 1024, generator=g),
        "sparse": torch.randn(300, 500, generator=g),
    }
    metas = [TensorMeta(name=n, dtype="bfloat16", shape=list(t.shape)) for n, t in w.items()]
    copy = SentCopy("c1", 0, {n: t.to(torch.bfloat16) for n, t in w.items()})
    receiver = {n: t.to(torch.bfloat16) for n, t in w.items()}
    for _ in range(3):
        w["dense"][torch.rand(64, 64, generator=g) < 0.25] *= 1.05  # a mask's range: whole under auto
        w["large"][torch.rand(256, 1024, generator=g) < 0.3] *= 1.05
        w["sparse"].view(-1)[torch.randint(0, 150_000, (1000,), generator=g)] += 0.5
        before = tensor_checksum(copy.tensors["large"])
        pieces, parts, stats = copy.delta(metas, w.items(), AUTO_DENSITY_THRESHOLD, sparse_encodings(DeltaMode.auto))
        assert stats.encodings == {"whole": 2, "index": 1}
        # The large tensor, whole on its sample, is cast into the copy only as the transfer draws it.
        assert sum(callable(p) for p in parts) == 1 and tensor_checksum(copy.tensors["large"]) == before
        tensors = list(drawn(parts))
        assert any(t is copy.tensors["dense"] for t in tensors) and any(t is copy.tensors["large"] for t in tensors)
        assert 0.27 < (stats.changed - 1000 - 0.25 * 4096) / (256 * 1024) < 0.33  # the sample's estimate
        patches = Assembler(metas)
        for meta, piece in zip(pieces, tensors, strict=True):
            for target, positions, values in patches.add(meta.name, piece.clone()):
                apply(receiver[target], positions, values)
        for n, t in w.items():
            exact = tensor_checksum(t.to(torch.bfloat16))
            assert tensor_checksum(copy.tensors[n]) == exact == tensor_checksum(receiver[n])


def test_auto_sends_a_keep_when_the_first_tensors_all_moved() -> None:
    # A trainer step that moved every element (lr 1e-4 in bf16) shows in the first sample batch:
    # the sync goes as a keep. One that moved a few rows (an embedding's), or a dense layer
    # beside a large sparse tensor, stays a delta.
    g = torch.Generator().manual_seed(5)
    w = {"embed": torch.randn(512, 1024, generator=g), "layer": torch.randn(256, 512, generator=g)}
    metas = [TensorMeta(name=n, dtype="bfloat16", shape=list(t.shape)) for n, t in w.items()]
    copy = SentCopy("c1", 0, {n: t.to(torch.bfloat16) for n, t in w.items()})
    auto = sparse_encodings(DeltaMode.auto)

    def moved(**scales: float) -> list[tuple[str, torch.Tensor]]:
        return [(n, t * (1 + scales.get(n, 0.0))) for n, t in w.items()]

    assert copy.dense_start(metas, moved(embed=0.05, layer=0.05), AUTO_DENSITY_THRESHOLD, auto)
    rows = {n: t.clone() for n, t in w.items()}
    rows["embed"][:40] *= 1.05  # 40 of 512 rows: clustered, an index's work
    rows["layer"] *= 1.05
    assert not copy.dense_start(metas, list(rows.items()), AUTO_DENSITY_THRESHOLD, auto)
    assert not copy.dense_start(metas, moved(), AUTO_DENSITY_THRESHOLD, auto)
    with pytest.raises(ValueError, match="where the manifest has"):
        copy.dense_start(metas, list(reversed(moved(embed=0.05))), AUTO_DENSITY_THRESHOLD, auto)


def test_a_chain_keeps_a_fresh_cast_itself_and_copies_anything_else() -> None:
    w = torch.randn(8, 8)
    cast = w.to(torch.bfloat16)
    assert host_copy(w, cast).data_ptr() == cast.data_ptr()  # new in host memory: kept as is
    same = w.to(torch.float32)  # no cast: the trainer's own tensor, which the next step changes
    kept = host_copy(w, same)
    assert same is w and kept.data_ptr() != w.data_ptr() and torch.equal(kept, w)
    view = w.view(-1)  # a view of the trainer's tensor is not new either
    assert host_copy(w, view).data_ptr() != w.data_ptr()


def test_host_copies_are_pinned_only_from_a_cuda_device() -> None:
    assert pin_host_copies(torch.device("cuda", 0)) and pin_host_copies(torch.device("cuda"))
    assert not pin_host_copies(torch.device("cpu")) and not pin_host_copies(torch.device("meta"))


def test_a_host_copy_from_the_cpu_is_a_plain_contiguous_copy() -> None:
    w = torch.randn(6, 4).t()  # not contiguous: the copy is, so a delta can patch it flat
    kept = to_host(w)
    assert kept.is_contiguous() and torch.equal(kept, w) and not kept.is_pinned()
    assert kept.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def test_a_host_copy_falls_back_to_pageable_memory_where_pinning_fails(monkeypatch, caplog) -> None:
    """The pinning call is made for a tensor the decision says to pin; where it fails (no pinned
    allocator in a CPU-only torch, or a host that will not lock that much memory: made to fail
    here on any torch) the copy is a plain one, and the failure is logged once."""
    from kubedistill.runtime.weight_sync import delta

    calls = []
    real_empty = torch.empty

    def refuse_pinned(*args, **kwargs):
        if kwargs.get("pin_memory"):
            calls.append(args)
            raise RuntimeError("cannot lock memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(delta.torch, "empty", refuse_pinned)
    monkeypatch.setattr(delta, "pin_host_copies", lambda device: True)
    monkeypatch.setattr(delta, "_pin_failed", False)
    w = torch.randn(5, 3, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="kubedistill.weight_sync"):
        kept, again = to_host(w), to_host(w)
    assert torch.equal(kept, w) and torch.equal(again, w) and not kept.is_pinned()
    assert kept.data_ptr() != w.data_ptr() and delta._pin_failed and len(calls) == 1
    assert len([r for r in caplog.records if "pinning failed" in r.getMessage()]) == 1


ON, AUTO, OFF = (DeltaSyncSpec(mode=m) for m in (DeltaMode.always, DeltaMode.auto, DeltaMode.never))
HELD = DeltaBase(chain="c1", version=7)


def test_delta_syncs_are_off_by_default() -> None:
    """never until a delta is measured faster than a full sync on a GPU: a default job's syncs
    are plain full ones, whose manifests ask no receiver to keep a copy (plan "full")."""
    default = DeltaSyncSpec()
    assert default.mode is DeltaMode.never
    assert plan(default, HELD, [HELD], "bfloat16", False, Backoff()) == "full"
    assert plan(default, None, [None], "bfloat16", False, Backoff()) == "full"


@pytest.mark.parametrize(
    ("spec", "held", "bases", "dtype", "lora", "expected"),
    [
        (ON, HELD, [HELD, HELD], "bfloat16", False, "delta"),
        (AUTO, HELD, [HELD, HELD], "bfloat16", False, "delta"),
        (OFF, HELD, [HELD, HELD], "bfloat16", False, "full"),
        # the trainer's first sync, or one after a restart or a resume from a checkpoint: no copy
        (ON, None, [None, None], "bfloat16", False, "keep"),
        (ON, None, [HELD, HELD], "bfloat16", False, "keep"),
        # a server joined (or was replaced, or failed its last load): it holds nothing
        (ON, HELD, [HELD, None], "bfloat16", False, "keep"),
        # a version gap: a server missed a version of the chain
        (ON, HELD, [HELD, DeltaBase(chain="c1", version=6)], "bfloat16", False, "keep"),
        # another sender's chain (a trainer restarted while the servers ran on)
        (ON, HELD, [DeltaBase(chain="c0", version=7)], "bfloat16", False, "keep"),
        (ON, HELD, [HELD], None, False, "full"),  # servers keep different dtypes: no single copy fits
        (ON, HELD, [HELD], "bfloat16", True, "full"),  # LoRA adapters have their own path
    ],
)
def test_plan_falls_back_to_a_full_sync_whenever_the_chain_breaks(spec, held, bases, dtype, lora, expected) -> None:
    assert plan(spec, held, bases, dtype, lora, Backoff()) == expected


def test_auto_backs_off_while_deltas_are_slower_than_full_syncs() -> None:
    b = Backoff()
    b.observe("keep", 1.0)
    assert plan(AUTO, HELD, [HELD], "bfloat16", False, b) == "delta"
    b.observe("delta", 1.2)  # slower than the full sync: 2 full syncs, the last one keeping a copy
    plans = []
    for _ in range(3):
        plans.append(plan(AUTO, None if plans[-1:] != ["keep"] else HELD, [HELD], "bfloat16", False, b))
        b.observe(plans[-1], 1.0)
    assert plans == ["full", "keep", "delta"]
    assert plan(ON, HELD, [HELD], "bfloat16", False, Backoff(skip=5)) == "delta"  # on ignores it
    for _ in range(10):
        b.observe("delta", 2.0)
    assert b.skip == MAX_BACKOFF
    b.observe("delta", 0.5)  # faster again: no back-off
    assert b.skip == MAX_BACKOFF and b.losses == 0


def test_a_receiver_refuses_a_delta_on_another_base_in_one_line() -> None:
    targets = [TensorMeta(name="w", dtype="bfloat16", shape=[4, 4])]
    pieces = [
        TensorMeta(name="w#index", dtype="int32", shape=[2]),
        TensorMeta(name="w#values", dtype="bfloat16", shape=[2]),
    ]
    manifest = bucket_layout(pieces, 1024)
    manifest.delta = ManifestDelta(keep=DeltaBase(chain="c1", version=8), base=HELD, targets=targets)
    check_delta(manifest, {"w": [4, 4]}, HELD)
    with pytest.raises(
        ValueError, match=r"^delta base mismatch: the sync patches c1@7, this engine holds no delta base$"
    ):
        check_delta(manifest, {"w": [4, 4]}, None)
    manifest.tensors[0].name = "v#index"
    with pytest.raises(ValueError, match="delta piece 'v#index' does not match a target tensor"):
        check_delta(manifest, {"w": [4, 4]}, HELD)
