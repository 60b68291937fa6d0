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
