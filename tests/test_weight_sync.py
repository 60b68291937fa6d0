"""Weight sync without servers: the manifest's bucket layout and its checks, and a real two-rank gloo
broadcast (sender and receiver threads in one process) that must arrive bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch

from kubedistill.api.spec import Device, SyncBackend
from kubedistill.runtime.weight_sync.group import GroupAddress, WeightSyncGroup, resolve_backend
from kubedistill.runtime.weight_sync.manifest import bucket_layout, check_against, check_layout, tensor_checksum
from kubedistill.runtime.weight_sync.sender import build_manifest
from kubedistill.runtime.weight_sync.transfer import TransferStats, receive, send
from kubedistill.runtime.wire.protocol import Manifest, TensorMeta
from server_fixtures import free_port

torch.set_num_threads(1)


def metas(*specs: tuple[str, str, list[int]]) -> list[TensorMeta]:
    return [TensorMeta(name=n, dtype=d, shape=s) for n, d, s in specs]


def test_layout_fills_buckets_in_order_and_groups_dtypes() -> None:
    m = bucket_layout(
        metas(("a", "float32", [4]), ("b", "bfloat16", [8]), ("c", "float32", [4]), ("d", "float32", [4])),
        bucket_bytes=32,
    )
    # a and c share the first fp32 bucket (32 bytes); d opens a second; b has its own dtype.
    layout = [(b.dtype, [(m.tensors[e.index].name, e.offset) for e in b.entries]) for b in m.buckets]
    assert layout == [("float32", [("a", 0), ("c", 4)]), ("float32", [("d", 0)]), ("bfloat16", [("b", 0)])]
    assert m.total_bytes == 3 * 16 + 16
    check_layout(m)


def test_layout_sends_large_tensors_alone() -> None:
    m = bucket_layout(
        metas(("a", "float32", [2]), ("big", "float32", [8]), ("b", "float32", [2])), bucket_bytes=1024, direct_bytes=32
    )
    assert [[m.tensors[e.index].name for e in b.entries] for b in m.buckets] == [["big"], ["a", "b"]]


def test_layout_gives_an_oversized_tensor_its_own_bucket() -> None:
    m = bucket_layout(
        metas(("small", "float32", [2]), ("big", "float32", [100]), ("tail", "float32", [2])), bucket_bytes=64
    )
    assert [[e.index for e in b.entries] for b in m.buckets] == [[0], [1], [2]]
    assert m.buckets[1].numel == 100


def test_layout_errors_name_the_problem() -> None:
    m = bucket_layout(metas(("a", "float32", [4]), ("b", "float32", [4])), bucket_bytes=1024)
    bad = m.model_copy(deep=True)
    bad.buckets[0].entries[1].offset = 3
    with pytest.raises(ValueError, match="b at offset 3, expected 4"):
        check_layout(bad)
    with pytest.raises(ValueError, match="cannot be synced"):
        bucket_layout(metas(("x", "complex64", [2])), 16)


def test_check_against_reports_unknown_missing_and_shape() -> None:
    m = bucket_layout(metas(("a", "float32", [4]), ("extra", "float32", [1])), bucket_bytes=1024)
    with pytest.raises(ValueError, match=r"manifest mismatch: unknown tensors extra; missing tensors b"):
        check_against(m, {"a": [4], "b": [2]})
    with pytest.raises(ValueError, match=r"a has shape \[4\], the engine's is \[2, 2\]"):
        check_against(bucket_layout(metas(("a", "float32", [4])), 64), {"a": [2, 2]})
    check_against(bucket_layout(metas(("a", "float32", [2, 2])), 64), {"a": [2, 2]})


def test_check_against_lets_the_engine_keep_frozen_weights() -> None:
    """A frozen vision tower is left out of the sync; only what lies under a frozen prefix may be."""
    m = bucket_layout(metas(("model.language_model.w", "float32", [4])), bucket_bytes=1024)
    expected = {"model.language_model.w": [4], "model.visual.blocks.0.w": [2], "lm_head.weight": [3]}
    m.frozen = ["model.visual."]
    with pytest.raises(ValueError, match=r"missing tensors lm_head.weight$"):
        check_against(m, expected)
    check_against(m, {k: v for k, v in expected.items() if k != "lm_head.weight"})


def test_backend_follows_device() -> None:
    assert resolve_backend(SyncBackend.auto, Device.cpu) == "gloo"
    assert resolve_backend(SyncBackend.auto, Device.cuda) == "nccl"
    assert resolve_backend(SyncBackend.gloo, Device.cuda) == "gloo"
    assert resolve_backend(SyncBackend.nccl, Device.cuda) == "nccl"
    with pytest.raises(ValueError, match="nccl needs device cuda"):
        resolve_backend(SyncBackend.nccl, Device.cpu)


def test_gloo_broadcast_is_bit_exact_across_buckets_and_dtypes() -> None:
    g = torch.Generator().manual_seed(0)
    named = [
        ("w1", torch.randn(33, 17, generator=g)),
        ("n1", torch.randn(17, generator=g).to(torch.bfloat16)),
        ("w2", torch.randn(64, 65, generator=g)),
        ("n2", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("w3", torch.randn(3, generator=g).double()),
    ]
    manifest = build_manifest(named, bucket_bytes=4096)
    assert len(manifest.buckets) >= 4
    assert [len(b.entries) for b in manifest.buckets if manifest.tensors[b.entries[0].index].name == "w2"] == [1]
    port = free_port()
    got: dict[str, torch.Tensor] = {}
    landing = torch.zeros(64, 65)  # the receiving engine's own parameter for w2
    errors: list[BaseException] = []

    def receiver() -> None:
        try:
            group = WeightSyncGroup(GroupAddress("127.0.0.1", port, 1, 2, "gloo", 60))
            # The views die with their bucket: keep copies, as an engine's load would.
            receive(
                group,
                Manifest.model_validate_json(manifest.model_dump_json()),
                lambda batch: got.update({n: t.clone() for n, t in batch}),
                destination=lambda name: landing if name == "w2" else None,
            )
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=receiver)
    t.start()
    sender = WeightSyncGroup(GroupAddress("127.0.0.1", port, 0, 2, "gloo", 60))
    stats = send(sender, manifest, [x for _, x in named])
    t.join(60)
    assert not errors, errors
    assert stats.bytes == manifest.total_bytes
    assert "w2" not in got  # landed directly, never handed to consume
    got["w2"] = landing
    for name, x in named:
        assert got[name].dtype == x.dtype and got[name].shape == x.shape
        assert tensor_checksum(got[name]) == tensor_checksum(x), name


def test_nccl_group_takes_the_members_gpu_and_the_configured_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU member does, with ProcessGroupNCCL recorded (this torch build has none): the
    communicator is made on the GPU the caller named, from whatever thread, and with
    weightSync.timeoutSeconds rather than torch's 10-minute default."""
    import datetime

    import torch.distributed as dist

    made: dict[str, object] = {}

    class RecordedNCCL:
        class Options:
            _timeout: datetime.timedelta | None = None

        def __init__(self, store: object, rank: int, size: int, options: RecordedNCCL.Options) -> None:
            made.update(rank=rank, size=size, timeout=options._timeout)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordedNCCL, raising=False)
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(WeightSyncGroup, "barrier", lambda self: None)  # would need a real GPU
    addr = GroupAddress("127.0.0.1", 0, 1, 2, "nccl", 42, "e1", device="cuda:3")
    group = WeightSyncGroup(addr, store=dist.HashStore())
    assert made == {"rank": 1, "size": 2, "timeout": datetime.timedelta(seconds=42)}
    assert group.device == torch.device("cuda", 3) and current == [torch.device("cuda", 3)]


def test_member_devices_and_ranks() -> None:
    from kubedistill.runtime.weight_sync.group import local_cuda_device, member_device, sync_rank

    assert member_device("gloo", None) == torch.device("cpu")
    assert member_device("nccl", "cuda:1") == torch.device("cuda", 1)
    for bad in (None, "cpu", "cuda"):
        with pytest.raises(ValueError, match="needs its own CUDA device"):
            member_device("nccl", bad)
    assert local_cuda_device({"LOCAL_RANK": "2"}) == "cuda:2" and local_cuda_device({}) == "cuda:0"
    # Each tensor-parallel worker of a server takes its own rank; unknown is an error under TP.
    assert [sync_rank(3, tp, 2) for tp in (0, 1)] == [3, 4]
    assert sync_rank(3, None, 1) == 3
    with pytest.raises(RuntimeError, match="tensor-parallel rank"):
        sync_rank(3, None, 2)


def _gloo_round_trip(
    manifest: Manifest, tensors: Callable[[WeightSyncGroup], Iterable[torch.Tensor]]
) -> tuple[TransferStats, dict[str, torch.Tensor]]:
    """send() from a 2-member gloo group to a receiver thread; (send's stats, what arrived)."""
    port = free_port()
    got: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def receiver() -> None:
        try:
            group = WeightSyncGroup(GroupAddress("127.0.0.1", port, 1, 2, "gloo", 60))
            receive(group, manifest, lambda batch: got.update({n: t.clone() for n, t in batch}))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=receiver)
    t.start()
    sender = WeightSyncGroup(GroupAddress("127.0.0.1", port, 0, 2, "gloo", 60))
    stats = send(sender, manifest, tensors(sender))
    t.join(60)
    assert not errors, errors
    return stats, got


def test_send_draws_a_lazy_source_bucket_by_bucket() -> None:
    """A trainer's weights come from a generator that all-gathers each tensor when reached: send
    must hold only the tensors of the buckets around the one on the wire, never the whole model."""
    import gc
    import weakref

    g = torch.Generator().manual_seed(1)
    shapes = [(256, 256), (8,), (256, 256), (8,), *[(256, 256)] * 8, (8,), (256, 256)]
    named = [(f"t{i}", torch.randn(*s, generator=g)) for i, s in enumerate(shapes)]
    manifest = build_manifest(named, bucket_bytes=1 << 20, direct_bytes=1 << 18)  # 256 KiB tensors go alone
    alive: set[int] = set()
    most = 0

    def gathered() -> Iterator[torch.Tensor]:
        nonlocal most
        for i, (_, x) in enumerate(named):
            full = x.clone()  # what an all-gather would materialise
            alive.add(i)
            weakref.finalize(full, alive.discard, i)
            gc.collect()
            most = max(most, len(alive))
            yield full

    _, got = _gloo_round_trip(manifest, lambda sender: gathered())
    assert {n: tensor_checksum(x) for n, x in named} == {n: tensor_checksum(x) for n, x in got.items()}
    # Ten large tensors each go alone (drawn, sent, dropped); the three small ones wait in the
    # bucket that closes last. Materialising the list first would hold all 13.
    assert most <= 5, most


def test_send_refuses_a_source_that_does_not_match_its_manifest() -> None:
    import types

    named = [(f"t{i}", torch.ones(4)) for i in range(3)]
    manifest = build_manifest(named, bucket_bytes=1 << 20)

    class Recorded:
        device = torch.device("cpu")

        def broadcast(self, tensor: torch.Tensor) -> object:
            return types.SimpleNamespace(wait=lambda: None)

    with pytest.raises(ValueError, match="the weights ended after 2 tensors; the manifest has 3"):
        send(Recorded(), manifest, (x for _, x in named[:2]))
    with pytest.raises(ValueError, match="more tensors than the manifest's 3"):
        send(Recorded(), manifest, (x for _, x in [*named, ("extra", torch.ones(4))]))
    with pytest.raises(ValueError, match="shape \\[5\\], the manifest says \\[4\\]"):
        send(Recorded(), manifest, iter([torch.ones(5), torch.ones(4), torch.ones(4)]))


def test_buckets_close_at_decoder_layer_boundaries() -> None:
    """Small tensors (norms) no longer wait in one bucket until the end of the model: every
    bucket holds one layer's tensors, and a layer's buckets all come before the next layer's."""
    from kubedistill.runtime.weight_sync.manifest import layer_of

    names = ["model.embed_tokens.weight"]
    for layer in range(3):
        p = f"model.layers.{layer}."
        names += [p + "input_layernorm.weight", p + "self_attn.q_proj.weight", p + "mlp.down_proj.weight"]
        names += [p + "post_attention_layernorm.weight"]
    names += ["model.norm.weight"]
    metas = [TensorMeta(name=n, dtype="float32", shape=[8] if "norm" in n else [512, 512]) for n in names]
    manifest = bucket_layout(metas, bucket_bytes=1 << 24, direct_bytes=1 << 20)
    check_layout(manifest)
    # Segments of consecutive tensors in one layer (the embedding and the final norm are two).
    segment = [0]
    for prev, name in zip(names, names[1:]):
        segment.append(segment[-1] + (layer_of(name) != layer_of(prev)))
    per_bucket = [{segment[e.index] for e in b.entries} for b in manifest.buckets]
    assert all(len(s) == 1 for s in per_bucket)
    order = [min(s) for s in per_bucket]
    assert order == sorted(order)
    # The three norms of a layer travel together as soon as the layer ends, not at the end.
    assert [len(b.entries) for b in manifest.buckets if len(b.entries) > 1] == [2, 2, 2]


def test_weights_travel_in_the_dtype_the_servers_keep() -> None:
    """Servers that keep bfloat16 weights get bfloat16 on the wire (half the bytes of the
    trainer's float32 masters), rounded once on the trainer exactly as their own copy would."""
    from kubedistill.runtime.weight_sync.sender import _on_device, as_wire_dtype, layout, tensor_meta, wire_dtype

    assert wire_dtype(["bfloat16", "bfloat16"]) == "bfloat16"
    assert wire_dtype(["bfloat16", "float32"]) is None  # servers differ: as the trainer holds them
    assert wire_dtype(["bfloat16", None]) is None  # one has not said (still loading)
    assert wire_dtype(["int8"]) is None

    g = torch.Generator().manual_seed(2)
    named = [("w", torch.randn(64, 64, generator=g)), ("steps", torch.arange(5)), ("n", torch.randn(7, generator=g))]
    metas = [as_wire_dtype(tensor_meta(n, t), "bfloat16") for n, t in named]
    assert [m.dtype for m in metas] == ["bfloat16", "int64", "bfloat16"]  # integers keep theirs
    manifest = layout(metas, bucket_bytes=1 << 20)
    stats, got = _gloo_round_trip(manifest, lambda sender: _on_device(manifest, iter(named), sender.device))
    assert stats.bytes == 64 * 64 * 2 + 5 * 8 + 7 * 2
    for name, x in named:
        expected = x.to(torch.bfloat16) if x.is_floating_point() else x
        assert tensor_checksum(got[name]) == tensor_checksum(expected), name


def test_large_tensors_travel_alone_only_where_every_server_receives_in_place() -> None:
    """The hf engine receives a one-tensor bucket straight into its parameter; vLLM loads every
    bucket through a loader call. Large tensors go alone only when every server is of the first
    kind; otherwise they are packed into buckets of bucketMB (a few loader calls per layer)."""
    from kubedistill.runtime.weight_sync.sender import DIRECT_BYTES, direct_bytes, layout

    assert direct_bytes([True, True]) == DIRECT_BYTES
    assert direct_bytes([True, False]) is None  # one vLLM server among hf ones
    assert direct_bytes([False]) is None
    layer = [TensorMeta(name=f"model.layers.0.{n}.weight", dtype="bfloat16", shape=[1024, 1024]) for n in "qkvo"]
    alone = layout(layer, bucket_bytes=16 << 20, direct_bytes=direct_bytes([True]))
    packed = layout(layer, bucket_bytes=16 << 20, direct_bytes=direct_bytes([False]))
    assert [len(b.entries) for b in alone.buckets] == [1, 1, 1, 1]
    assert [len(b.entries) for b in packed.buckets] == [4]  # 8 MiB in one 16 MiB bucket
    check_layout(packed)


def _sync_spec(bucket_mb: int, timeout_seconds: int) -> Any:
    from kubedistill.api.spec import DistillationJobSpec

    return DistillationJobSpec.model_validate(
        {
            "device": "cpu",
            "student": {"model": "/m"},
            "teachers": [{"name": "t", "model": "/t"}],
            "trainer": {"miniBatchSize": 4},
            "data": {"train": ["/d/t.parquet"]},
            "weightSync": {"bucketMB": bucket_mb, "timeoutSeconds": timeout_seconds},
        }
    )


@pytest.mark.parametrize(("bucket_mb", "buckets"), [(1, 4), (2, 2)])
def test_the_senders_buckets_and_timeout_are_the_specs(monkeypatch: pytest.MonkeyPatch, bucket_mb, buckets) -> None:
    """WeightSender, built from the spec as the trainer builds it (a group of the trainer alone):
    its sync packs buckets of weightSync.bucketMB, and its group and store wait
    weightSync.timeoutSeconds."""
    import datetime

    from kubedistill.api.roleconfig import Endpoints
    from kubedistill.runtime.weight_sync import sender as sender_module

    sent: list[Manifest] = []

    def recorded(group: Any, manifest: Manifest, tensors: Any) -> TransferStats:
        sent.append(manifest)
        return send(group, manifest, tensors)

    monkeypatch.setattr(sender_module, "send", recorded)
    endpoints = Endpoints(
        trainer="http://127.0.0.1:1", master_addr="127.0.0.1", weight_sync_port=free_port(), rollout=[], teachers={}
    )
    sender = sender_module.WeightSender(_sync_spec(bucket_mb, 7), endpoints, members=[])
    try:
        # Eight 0.5 MiB float32 tensors.
        stats = sender.sync(1, [(f"w{i}", torch.full((131072,), float(i))) for i in range(8)])
        assert stats.bytes == 8 * 131072 * 4
        assert [len(b.entries) for b in sent[0].buckets] == [8 // buckets] * buckets
        assert sender.group.pg.options._timeout == datetime.timedelta(seconds=7)
        assert sender.group.store.timeout == datetime.timedelta(seconds=7)
    finally:
        sender.close()


def test_a_rollout_server_gives_up_on_a_silent_trainer_after_timeout_seconds(tmp_path) -> None:
    """The rollout server's group address carries weightSync.timeoutSeconds: a member whose trainer
    opened the store but never joins fails after it (2 s here), not after torch's 10 minutes."""
    import time

    from kubedistill.api.roleconfig import Endpoints, JobConfig
    from kubedistill.runtime.servers.rollout import group_address
    from kubedistill.runtime.weight_sync.group import open_store

    port = free_port()
    endpoints = Endpoints(
        trainer="http://127.0.0.1:1", master_addr="127.0.0.1", weight_sync_port=port, rollout=["r"], teachers={}
    )
    addr = group_address(JobConfig(job="j", spec=_sync_spec(512, 2), endpoints=endpoints), 0)
    assert (addr.rank, addr.world_size) == (1, 2)
    trainer_store = open_store(GroupAddress("127.0.0.1", port, 0, 2, "gloo", 600, "0"))
    outcome: list[object] = []

    def join() -> None:
        t0 = time.monotonic()
        try:
            WeightSyncGroup(addr)
            outcome.append("joined")
        except Exception as e:  # the rendezvous times out
            outcome.append((type(e).__name__, time.monotonic() - t0))

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    thread.join(30)
    del trainer_store
    assert outcome and outcome[0] != "joined", "still waiting after 30 s: timeoutSeconds did not reach the group"
    assert outcome[0][1] < 20  # type: ignore[index]
