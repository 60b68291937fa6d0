"""Live rollout scaling, the I/O-free parts: the driver's membership bookkeeping, the endpoint
pool's drain, a server's place in a re-formed weight-sync group, and `kubedistill run`'s
following of the job file. The whole path runs in test_e2e_scaling.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k8s_offline import read_manifest
from kubedistill.api import DistillationJob
from kubedistill.api.progress import TrainerProgress
from kubedistill.api.roleconfig import JobConfig, weight_sync_world_size
from kubedistill.api.validate import load_job
from kubedistill.runtime.driver.membership import RolloutMembership
from kubedistill.runtime.driver.routing import EndpointPool
from kubedistill.runtime.entrypoints.local import free_port, local_processes, rollout_process
from kubedistill.runtime.entrypoints.local_scaling import RolloutScaler
from kubedistill.runtime.servers.rollout import group_address
from kubedistill.runtime.wire.protocol import WeightsGroupRequest

ROOT = Path(__file__).resolve().parent.parent
A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


def test_membership_admits_after_health_and_sync_and_drains_before_letting_go() -> None:
    m = RolloutMembership([A])
    assert m.update([A, B]) == ([B], [])
    assert m.held() == [A, B] and m.serving() == [A]
    assert m.update([A, B]) == ([], [])  # already joining: not admitted twice
    assert m.healthy(B) and m.ready == [B]
    m.joined([B])
    assert m.members == [A, B] and m.serving() == [A, B] and m.added == 1
    assert m.update([A]) == ([], [B])
    assert m.serving() == [A] and m.held() == [A, B]  # held while draining: its pod must stay
    assert m.update([A]) == ([], [])  # draining once
    m.drained(B)
    assert m.held() == [A] and m.removed == 1


def test_membership_forgets_a_server_unwanted_before_it_joined() -> None:
    m = RolloutMembership([A])
    m.update([A, B, C])
    assert m.healthy(B)
    m.update([A])
    assert m.held() == [A] and not m.wanted(B) and not m.wanted(C)
    assert not m.healthy(C)  # its health check came back after the scale-down: ignored
    # Taken into a sync just before the scale-down: it joins, then drains at the next update.
    m.update([A, B])
    m.healthy(B)
    ready = list(m.ready)
    m.update([A])
    m.joined(ready)
    assert m.update([A]) == ([], [B])
    with pytest.raises(ValueError, match="at least one rollout server"):
        m.update([])


def test_pool_drains_an_endpoint_before_removing_it() -> None:
    pool = EndpointPool("rollout", [A])
    busy = pool.acquire()
    pool.add(B)
    assert pool.acquire() == B  # the new one has nothing in flight
    pool.drain(A)
    assert {pool.acquire() for _ in range(3)} == {B}  # no new request goes to A
    with pytest.raises(ValueError, match="only once drained"):
        pool.remove(A)
    pool.release(busy)
    pool.remove(A)
    assert pool.urls == [B]
    with pytest.raises(ValueError, match="last endpoint"):
        pool.drain(B)
    with pytest.raises(ValueError, match="already an endpoint"):
        pool.add(B)


def test_a_server_takes_the_rank_the_trainer_gives_it(tmp_path: Path) -> None:
    job = DistillationJob.model_validate(read_manifest(ROOT / "examples" / "multi-teacher-6gpu.yaml"))
    config, _ = local_processes(job, tmp_path / "config.json")
    tp = config.spec.rollout.inference.tensor_parallel_size
    # From the spec (no placement): replica 1 of 2.
    addr = group_address(config, 1, "e0")
    assert (addr.rank, addr.world_size) == (1 + tp, weight_sync_world_size(config.spec))
    # After a scale-down to replica 1 alone, the trainer numbers it first in a two-member group.
    placed = group_address(config, 1, "e1", WeightsGroupRequest(epoch="e1", rank=1, world_size=1 + tp))
    assert (placed.rank, placed.world_size, placed.epoch) == (1, 1 + tp, "e1")
    assert weight_sync_world_size(config.spec, 3) == 1 + 3 * tp


def _scaler(tmp_path: Path, clock: list[float]) -> tuple[RolloutScaler, Path, list[str]]:
    job_file = tmp_path / "job.yaml"
    job_file.write_text((ROOT / "examples" / "quickstart-cpu.yaml").read_text())
    job = load_job(job_file)
    config_path = tmp_path / "config.json"
    config, procs = local_processes(job, config_path)
    config.dump(config_path)
    template = next(p for p in procs if p.name == "rollout-0")
    template.env["GPU_SHARE_SETTING"] = "x"  # fit_gpus' additions carry over to new replicas
    said: list[str] = []
    scaler = RolloutScaler(
        job_path=job_file,
        spec=job.spec,
        config=config,
        config_path=config_path,
        template=template,
        new_process=lambda cfg, i, taken: rollout_process(cfg, config_path, i, free_port(taken)),
        load=lambda p: load_job(p).spec,
        log=said.append,
        clock=lambda: clock[0],
    )
    return scaler, job_file, said


def _edit(job_file: Path, **rollout: object) -> None:
    import os

    doc = yaml.safe_load(job_file.read_text())
    doc["spec"]["rollout"].update(rollout)
    job_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    st = job_file.stat()
    os.utime(job_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a distinct mtime


def test_local_run_follows_the_job_files_rollout_replicas(tmp_path: Path) -> None:
    clock = [0.0]
    scaler, job_file, said = _scaler(tmp_path, clock)
    assert scaler.poll() == []  # unchanged file
    first = JobConfig.load(scaler.config_path).endpoints.rollout
    _edit(job_file, replicas=3)
    new = scaler.poll()
    assert [p.name for p in new] == ["rollout-1", "rollout-2"]
    assert all(
        p.env["GPU_SHARE_SETTING"] == "x" and p.env["KUBEDISTILL_REPLICA"] == str(i + 1) for i, p in enumerate(new)
    )
    on_disk = JobConfig.load(scaler.config_path)
    assert on_disk.spec.rollout.replicas == 3
    assert on_disk.endpoints.rollout == [*first, *(f"http://127.0.0.1:{p.port}" for p in new)]
    assert len({p.port for p in new} | {int(u.rsplit(":", 1)[1]) for u in first}) == 3

    # Down to 1: the config drops replicas 2 and 1 at once; their processes wait for the drain.
    _edit(job_file, replicas=1)
    assert scaler.poll() == []
    assert JobConfig.load(scaler.config_path).endpoints.rollout == first
    two, three = on_disk.endpoints.rollout[1:]
    held = TrainerProgress(rollout_servers=[*first, two, three])
    assert scaler.due(held) == [] and scaler.due(None) == []
    assert scaler.due(TrainerProgress(rollout_servers=[*first, two])) == ["rollout-2"]
    assert scaler.due(TrainerProgress(rollout_servers=None)) == []  # an older trainer: wait for the deadline
    clock[0] += scaler.config.spec.weight_sync.timeout_seconds + 1
    assert scaler.due(None) == ["rollout-1"]
    assert [(e["stopped"], e["drained"]) for e in scaler.events if "stopped" in e] == [
        ("rollout-2", True),
        ("rollout-1", False),
    ]


def test_local_run_takes_only_replicas_and_refuses_a_bad_edit(tmp_path: Path) -> None:
    scaler, job_file, said = _scaler(tmp_path, [0.0])
    _edit(job_file, replicas=0)
    assert scaler.poll() == []
    assert "does not validate" in said[-1] and "replicas" in said[-1]
    _edit(job_file, replicas=2, sampling={"temperature": 0.5})
    (p,) = scaler.poll()
    assert "changed fields other than spec.rollout.replicas" in said[-2]
    assert JobConfig.load(scaler.config_path).spec.rollout.sampling.temperature != 0.5
    # Ray could not place it: the config goes back to one server.
    scaler.unplaced(p)
    assert len(JobConfig.load(scaler.config_path).endpoints.rollout) == 1
    assert "could not place rollout-1" in said[-1]
