"""`kubedistill run`: the local process plan (the processes themselves are tested end to end
in the driver tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k8s_offline import read_manifest
from kubedistill.api import DistillationJob
from kubedistill.api.failures import GangDecision, GangOutcome, decide_gang_failure
from kubedistill.runtime.entrypoints.launch_ray import actor_lost
from kubedistill.runtime.entrypoints.local import (
    RAY_WORKER_PORTS,
    absolute_paths,
    ephemeral_ports,
    free_port,
    local_processes,
    run,
)
from kubedistill.runtime.entrypoints.supervisor import ActorLost, Exit, exit_text, gang_failures, gang_record
from kubedistill.runtime.entrypoints.zygote import forks_roles

ROOT = Path(__file__).resolve().parent.parent


def _job(name: str) -> DistillationJob:
    return DistillationJob.model_validate(read_manifest(ROOT / "examples" / name))


def test_plan_multi_teacher(tmp_path: Path) -> None:
    config, procs = local_processes(_job("multi-teacher-6gpu.yaml"), tmp_path / "config.json")
    names = sorted(p.name for p in procs)
    assert names == ["rollout-0", "rollout-1", "teacher-math-0", "teacher-vision-0", "trainer-0", "trainer-1"]
    ports = [p.port for p in procs]
    assert len(set(ports)) == len(ports)
    ep = config.endpoints
    assert ep.rollout == [f"http://127.0.0.1:{p.port}" for p in procs if p.name.startswith("rollout")]
    assert ep.teachers["math"] == [f"http://127.0.0.1:{p.port}" for p in procs if p.name == "teacher-math-0"]
    trainer1 = next(p for p in procs if p.name == "trainer-1")
    assert trainer1.env["RANK"] == "1" and trainer1.env["WORLD_SIZE"] == "2"
    assert trainer1.env["MASTER_PORT"] == str(ep.master_port)
    assert trainer1.argv[-6:] == ["--replica", "1", "--host", "127.0.0.1", "--port", str(trainer1.port)]
    assert next(p for p in procs if p.name == "teacher-vision-0").env["KUBEDISTILL_TEACHER"] == "vision"
    assert all(p.gpus == 1 for p in procs)


def test_ports_avoid_the_ephemeral_and_ray_worker_ranges(tmp_path: Path) -> None:
    """Role ports come from where neither outgoing connections nor Ray's workers take ports, and
    a port already bound (or already handed out) is skipped."""
    import random
    import socket

    _, procs = local_processes(_job("multi-teacher-6gpu.yaml"), tmp_path / "config.json")
    for p in procs:
        assert p.port not in ephemeral_ports() and p.port not in RAY_WORKER_PORTS, p
    rng = random.Random(7)
    first = free_port(set(), random.Random(7))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first))
        busy.listen()
        taken: set[int] = set()
        again = free_port(taken, rng)  # the same draw as `first`, which is now in use
        assert again != first and taken == {again}
        assert free_port(taken, random.Random(7)) not in (first, again)


def test_plan_cpu_threads_and_kv_cache(tmp_path: Path) -> None:
    raw = _job("quickstart-cpu.yaml").model_dump(by_alias=True, exclude_none=True, mode="json")
    raw["spec"]["rollout"]["inference"] = {"engine": "vllm", "kvCacheGiB": 1}
    _, procs = local_processes(DistillationJob.model_validate(raw), tmp_path / "config.json")
    by_name = {p.name: p for p in procs}
    assert by_name["rollout-0"].env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in by_name["teacher-arith-0"].env  # the hf engine's
    assert by_name["trainer-0"].env["OMP_NUM_THREADS"] == "1"
    assert all(p.gpus == 0 for p in procs)


def test_paths_become_absolute(tmp_path: Path) -> None:
    spec = absolute_paths(_job("quickstart-cpu.yaml").spec, tmp_path)
    assert spec.student.model == str(tmp_path / ".kubedistill/quickstart/student")
    assert spec.data.train == [str(tmp_path / ".kubedistill/quickstart/data/train.jsonl")]
    assert spec.checkpoint.path == str(tmp_path / ".kubedistill/quickstart/ckpt")


def test_run_refuses_an_invalid_job_with_its_problem_lines(tmp_path: Path) -> None:
    lines: list[str] = []
    bad = ROOT / "tests/manifests/broken/mini-batch-not-multiple-of-n.yaml"
    assert run(bad, workdir=tmp_path, log=lines.append) == 1
    assert lines == [
        f"{bad}: spec.trainer.miniBatchSize: must be a multiple of spec.rollout.sampling.samplesPerPrompt "
        "(whole prompt groups per step)"
    ]


def test_user_env_reaches_the_processes_role_over_job(tmp_path: Path) -> None:
    job = _job("quickstart-cpu.yaml")
    raw = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    raw["spec"]["env"] = [{"name": "FOO", "value": "job"}, {"name": "BAR", "value": "job"}]
    raw["spec"]["rollout"].setdefault("overrides", {})["env"] = [{"name": "FOO", "value": "rollout"}]
    _, procs = local_processes(DistillationJob.model_validate(raw), tmp_path / "config.json")
    by_name = {p.name: p for p in procs}
    assert by_name["rollout-0"].env["FOO"] == "rollout" and by_name["rollout-0"].env["BAR"] == "job"
    assert by_name["trainer-0"].env["FOO"] == "job"


def test_run_refuses_a_value_from_it_cannot_resolve(tmp_path: Path) -> None:
    raw = read_manifest(ROOT / "examples" / "quickstart-cpu.yaml")
    raw["spec"]["env"] = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    lines: list[str] = []
    assert run(path, workdir=tmp_path / "run", log=lines.append) == 1
    assert lines == [
        f"{path}: spec.env TOKEN: valueFrom (a Kubernetes reference) cannot be resolved by "
        "`kubedistill run`; give it a value for local runs"
    ]


def test_run_refuses_a_suspended_job_and_a_ray_address_without_ray(tmp_path: Path) -> None:
    raw = read_manifest(ROOT / "examples" / "quickstart-cpu.yaml")
    raw["spec"]["suspend"] = True
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    lines: list[str] = []
    assert run(path, workdir=tmp_path / "run", log=lines.append) == 1
    assert lines == [f"{path}: spec.suspend is true, so the job starts nothing; set it to false to run it"]
    lines.clear()
    assert run(path, address="ray://head:10001", launcher="processes", log=lines.append) == 1
    assert lines == ["kubedistill run: --address (or RAY_ADDRESS) names a Ray cluster; use it with --launcher ray"]


def test_ttl_after_finished_is_named_as_not_applying_locally(tmp_path: Path) -> None:
    from kubedistill.runtime.entrypoints.local import prepare

    lines: list[str] = []
    local = prepare(ROOT / "examples" / "one-gpu.yaml", tmp_path / "run", lines.append)  # ttl 86400
    assert local is not None and local.gang[0].env["KUBEDISTILL_HISTORY"] == str(tmp_path / "run" / "history.jsonl")
    assert lines == [
        "kubedistill run: spec.ttlSecondsAfterFinished applies in a cluster only; a local run keeps its directory"
    ]


def test_one_gpu_is_shared_by_trainer_rollout_and_teacher(tmp_path: Path) -> None:
    """examples/one-gpu.yaml asks for three GPUs; on a machine with one, the launcher places each role on a
    third of it, each vLLM server is held to 0.3 of its memory (the trainer keeps the rest), and
    the NCCL weight-sync members get distinct NCCL host ids (NCCL refuses two ranks on one GPU)."""
    from kubedistill.runtime.entrypoints.local import fit_gpus

    config, procs = local_processes(_job("one-gpu.yaml"), tmp_path / "config.json")
    assert sorted(p.gpus for p in procs) == [1, 1, 1]
    shared = fit_gpus(config, procs, available=1)
    assert {p.name: p.gpus for p in procs} == {"teacher-teacher-0": 0.33, "rollout-0": 0.33, "trainer-0": 0.33}
    assert shared.spec.rollout.inference.gpu_memory_utilization == 0.3
    assert shared.spec.teachers[0].inference.gpu_memory_utilization == 0.3
    assert config.spec.rollout.inference.gpu_memory_utilization == 0.85  # a new config, the old one kept
    host_ids = {p.env["NCCL_HOSTID"] for p in procs}
    assert len(host_ids) == 3 and all(p.env["NCCL_NET"] == "Socket" for p in procs)

    config, procs = local_processes(_job("one-gpu.yaml"), tmp_path / "config.json")
    assert fit_gpus(config, procs, available=3) is config  # they fit: nothing changes
    assert [p.gpus for p in procs] == [1, 1, 1] and not any("NCCL_HOSTID" in p.env for p in procs)


def test_roles_fork_from_a_zygote_only_as_plain_processes_without_gpus() -> None:
    assert forks_roles("processes", [])
    assert not forks_roles("processes", ["0"])  # with GPUs: fresh processes (zygote.py, CUDA)
    assert not forks_roles("ray", [])  # Ray starts its own workers


def test_gpu_sharing_rules() -> None:
    from kubedistill.api.roleconfig import Role
    from kubedistill.runtime.entrypoints.gpu_share import GpuDemand, share_gpus

    demands = [
        GpuDemand(name="rollout-0", role=Role.rollout, gpus=1),
        GpuDemand(name="rollout-1", role=Role.rollout, gpus=1),
        GpuDemand(name="trainer-0", role=Role.trainer, gpus=1),
        GpuDemand(name="cpu-helper", role=Role.teacher, gpus=0),
    ]
    two = share_gpus(demands, available=2, nccl=False)  # three GPU roles, two per GPU at most
    assert [two[n].num_gpus for n in ("rollout-0", "rollout-1", "trainer-0", "cpu-helper")] == [0.5, 0.5, 0.5, 0]
    assert two["rollout-0"].memory_utilization == 0.45 and two["trainer-0"].memory_utilization is None
    assert all(not s.env for s in two.values())  # gloo: no NCCL settings
    with pytest.raises(ValueError, match="has none"):
        share_gpus(demands, available=0, nccl=True)
    tp2 = [GpuDemand(name="rollout-0", role=Role.rollout, gpus=2), GpuDemand(name="t", role=Role.trainer, gpus=1)]
    with pytest.raises(ValueError, match="only single-GPU roles can share one, but rollout-0 asks for 2"):
        share_gpus(tp2, available=1, nccl=True)


# --- the trainer gang's failure policy, fed with process exits -------------------------------------

GANG = ["trainer-0", "trainer-1"]


def _decide(exits: dict[str, Exit], restarts: int = 0, disruptions: int = 0, limit: int = 2) -> GangDecision | None:
    return decide_gang_failure(
        gang_failures(GANG, exits), restarts=restarts, disruptions=disruptions, backoff_limit=limit
    )


def test_a_process_exit_is_the_jobs_own_failure_whatever_the_signal() -> None:
    import signal

    for code in (3, -signal.SIGKILL, -signal.SIGTERM):
        d = _decide({"trainer-0": None, "trainer-1": code}, restarts=1)
        assert d is not None and d.outcome is GangOutcome.restart and d.restarts == 2 and d.disruptions == 0
        assert d.cause.name == "trainer-1" and d.message.startswith(f"trainer process trainer-1 exited with {code}")
    d = _decide({"trainer-0": -signal.SIGKILL, "trainer-1": None})
    assert d is not None and d.message == (
        "trainer process trainer-0 exited with -9 (SIGKILL); restarting the trainer gang (1/2)"
    )
    record = gang_record(d, -9, 7, 12.5)
    assert record == {"process": "trainer-0", "exitCode": -9, "historyLines": 7, "seconds": 12.5, "message": d.message}


def test_a_lost_ray_actor_is_a_disruption_not_counted() -> None:
    lost = ActorLost("RayActorDied", "The actor is dead because its node has died.")
    d = _decide({"trainer-0": None, "trainer-1": lost}, restarts=2, limit=2)
    assert d is not None and d.outcome is GangOutcome.disrupted and (d.restarts, d.disruptions) == (2, 1)
    assert d.message.startswith("trainer process trainer-1 was taken away by the cluster (RayActorDied)")
    assert gang_record(d, lost, 3, 1.0) == {
        "process": "trainer-1",
        "reason": "RayActorDied",
        "detail": lost.detail,
        "historyLines": 3,
        "seconds": 1.0,
        "message": d.message,
    }


def test_the_backoff_limit_ends_the_run() -> None:
    d = _decide({"trainer-0": 1, "trainer-1": ActorLost("RayActorDied", "gone")}, restarts=2, limit=2)
    assert d is not None and d.outcome is GangOutcome.failed
    assert d.message == "trainer process trainer-0 exited with 1; backoffLimit 2 reached after 2 gang restarts"


def test_running_ranks_and_a_finished_gang_are_no_failure() -> None:
    assert gang_failures(GANG, {"trainer-0": None, "trainer-1": None}) == []
    assert gang_failures(GANG, {"trainer-0": None, "trainer-1": 0}) == []  # rank 0 closed the gang
    assert gang_failures(GANG, {"trainer-0": 0, "trainer-1": 3}) == []  # rank 0 succeeded: the job did


def test_actor_lost_reads_rays_error() -> None:
    exceptions = pytest.importorskip("ray.exceptions")
    from ray.core.generated.common_pb2 import ActorDiedErrorContext, NodeDeathInfo

    why = "The actor is dead because its node has died. Node Id: abc"
    context = ActorDiedErrorContext(class_name="RoleProcess", actor_id=b"\x01" * 16, pid=1, error_message=why)
    assert actor_lost(exceptions.ActorDiedError(context)) == ActorLost("RayActorDied", why)
    drained = NodeDeathInfo(reason=NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED)
    context = ActorDiedErrorContext(
        class_name="RoleProcess", actor_id=b"\x01" * 16, error_message=why, node_death_info=drained
    )
    assert actor_lost(exceptions.ActorDiedError(context)).reason == "NodePreempted"
    assert actor_lost(exceptions.ActorDiedError()).detail == "The actor died unexpectedly before finishing this task."
    assert exit_text(ActorLost("RayActorDied", why)) == f"lost its Ray actor (RayActorDied: {why})"


def test_servers_sharing_a_gpu_start_one_after_the_other_and_the_rest_at_once() -> None:
    from kubedistill.api.roleconfig import Role
    from kubedistill.runtime.entrypoints.gpu_share import Started, start_waves

    def plan(gpus: float) -> list[Started]:
        return [
            Started(name="teacher-math-0", role=Role.teacher, num_gpus=gpus),
            Started(name="rollout-0", role=Role.rollout, num_gpus=gpus),
            Started(name="rollout-1", role=Role.rollout, num_gpus=gpus),
            Started(name="trainer-0", role=Role.trainer, num_gpus=gpus),
        ]

    # CPU, or a GPU each: everything at once.
    assert start_waves(plan(0)) == [["teacher-math-0", "rollout-0", "rollout-1", "trainer-0"]]
    assert start_waves(plan(1)) == [["teacher-math-0", "rollout-0", "rollout-1", "trainer-0"]]
    # One GPU for all (a quarter each): the trainer with the first server, then each server alone.
    assert start_waves(plan(0.25)) == [["teacher-math-0", "trainer-0"], ["rollout-0"], ["rollout-1"]]
    # Environment servers first, on their own: the trainer starts once they answer /health.
    calc = [Started(name="env-calc-0", role=Role.environment, num_gpus=0)]
    assert start_waves(calc + plan(0)) == [["env-calc-0"], ["teacher-math-0", "rollout-0", "rollout-1", "trainer-0"]]
    assert start_waves(calc + plan(0.25)) == [
        ["env-calc-0"],
        ["teacher-math-0", "trainer-0"],
        ["rollout-0"],
        ["rollout-1"],
    ]
