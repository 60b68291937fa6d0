from __future__ import annotations

from pathlib import Path

from k8s_offline import read_manifest
from kubedistill.api import DistillationJob
from kubedistill.api.roleconfig import (
    Endpoints,
    JobConfig,
    trainer_world_size,
    weight_sync_rank,
    weight_sync_world_size,
)

ROOT = Path(__file__).resolve().parent.parent


def test_job_config_round_trip(tmp_path: Path) -> None:
    job = DistillationJob.model_validate(read_manifest(ROOT / "examples/multi-teacher-6gpu.yaml"))
    cfg = JobConfig(
        job=job.metadata.name,
        spec=job.spec,
        endpoints=Endpoints(
            trainer="http://t:8000",
            master_addr="t",
            rollout=["http://r0:8000", "http://r1:8000"],
            teachers={"math": ["http://m0:8000"], "vision": ["http://v0:8000"]},
        ),
    )
    cfg.dump(tmp_path / "config.json")
    assert JobConfig.load(tmp_path / "config.json") == cfg
    # Two rollout replicas with TP 1 plus trainer rank 0; two trainer pods with one GPU each.
    assert weight_sync_world_size(job.spec) == 3
    assert [weight_sync_rank(job.spec, r) for r in (0, 1)] == [1, 2]
    assert trainer_world_size(job.spec) == 2


def test_torchrun_gives_each_local_rank_of_a_pod_its_own_global_rank(tmp_path: Path) -> None:
    """What a trainer pod with two GPUs runs (operator.render.torchrun_launcher), for real: both
    processes share the pod's replica index, and each must still find its own rank."""
    import json
    import os
    import subprocess
    import sys

    from kubedistill.operator.render import torchrun_launcher
    from kubedistill.runtime.entrypoints.local import free_port

    script = tmp_path / "who.py"
    script.write_text(
        "import json, os\n"
        "from kubedistill.api.roleconfig import Identity, Role, trainer_rank\n"
        "rank = trainer_rank(Identity.from_env(Role.trainer), os.environ)\n"
        "print(json.dumps([rank, int(os.environ['LOCAL_RANK']), int(os.environ['WORLD_SIZE'])]), flush=True)\n"
    )
    launcher = torchrun_launcher(
        nodes=1, per_node=2, node_rank=0, master_addr="127.0.0.1", master_port=free_port(set())
    )
    env = {**os.environ, "KUBEDISTILL_REPLICA": "0", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launcher[1:], str(script)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    seen = sorted(json.loads(line) for line in r.stdout.splitlines() if line.startswith("["))
    assert seen == [[0, 0, 2], [1, 1, 2]]


def test_trainer_rank_is_the_replica_without_torchrun() -> None:
    from kubedistill.api.roleconfig import Identity, Role, trainer_rank

    ident = Identity(role=Role.trainer, replica=3)
    assert trainer_rank(ident, {"RANK": "3"}) == 3
    assert trainer_rank(ident, {"RANK": "7", "LOCAL_RANK": "1"}) == 7
