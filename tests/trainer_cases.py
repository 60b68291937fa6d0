"""Shared builders for the trainer and checkpoint tests (specs, batches) and the multi-rank worker
run as a subprocess by tests/test_trainer_dist.py and tests/test_checkpoint.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.entrypoints.roles import finish_process
from kubedistill.runtime.wire.batch import BatchParts, TrainBatch
from ports import free_port

HERE = Path(__file__).resolve().parent


def make_spec(student: Path, ckpt: Path, **overrides: Any) -> DistillationJobSpec:
    doc: dict[str, Any] = {
        "device": "cpu",
        "student": {"model": str(student)},
        "teachers": [{"name": "t", "model": str(student)}],
        "data": {"train": ["unused.jsonl"]},
        "trainer": {"mixedPrecision": "float32", "optim": {"lr": 1e-3}, "microBatchTokens": 40, "totalSteps": 10},
        "algorithm": {"distillation": {"lossMode": "forwardKLTopK", "topK": 3}},
        "checkpoint": {"path": str(ckpt), "everySteps": 1},
    }
    for dotted, value in overrides.items():
        node = doc
        keys = dotted.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return DistillationJobSpec.model_validate(doc)


def make_parts(seed: int = 0, n: int = 5, vocab: int = 16, k: int = 3) -> BatchParts:
    """make_batch as the trainer takes it."""
    return make_batch(seed, n, vocab, k).to_parts()


def make_batch(seed: int = 0, n: int = 5, vocab: int = 16, k: int = 3) -> TrainBatch:
    """Samples of uneven lengths with every field the losses may use."""
    g = torch.Generator().manual_seed(seed)
    ids, prompts = [], []
    for i in range(n):
        length = 6 + (i * 5) % 11
        ids.append([1] + torch.randint(4, vocab, (length - 1,), generator=g).tolist())
        prompts.append(2 + i % 3)
    resp = [len(t) - p for t, p in zip(ids, prompts)]

    def lps(r: int) -> list[float]:
        return (-torch.rand(r, generator=g) * 3).tolist()

    topk_ids = [[torch.randperm(vocab - 4, generator=g)[:k].add(4).tolist() for _ in range(r)] for r in resp]
    topk_lp = [[sorted((-torch.rand(k, generator=g) * 4).tolist(), reverse=True) for _ in range(r)] for r in resp]
    return TrainBatch(
        token_ids=ids,
        prompt_lens=prompts,
        rollout_logprobs=[lps(r) for r in resp],
        signals={
            "teacher_logprobs": [lps(r) for r in resp],
            "teacher_topk_ids": topk_ids,
            "teacher_topk_logprobs": topk_lp,
        },
        rewards=[float(i % 2) for i in range(n)],
        group_ids=[i // 2 for i in range(n)],
        weight_versions=[0] * n,
    )


def run_ranks(world: int, spec_json: str, tmp: Path, scenario: str) -> dict:
    spec_file, out = tmp / f"spec-{scenario}-{world}.json", tmp / f"out-{scenario}-{world}.pt"
    spec_file.write_text(spec_json)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "trainer_cases.py"),
                str(r),
                str(world),
                str(port),
                str(spec_file),
                str(out),
                scenario,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
    return torch.load(out, weights_only=False)


def saved_batch_path(out: str | Path) -> Path:
    """Where the "saved_batch" scenario reads its batch (torch.save of a TrainBatch)."""
    return Path(out).with_name(Path(out).stem + "-batch.pt")


def worker(rank: int, world: int, port: int, spec_json: str, out: str, scenario: str) -> None:
    """One trainer rank. Rank 0 drives `scenario` and writes results to `out` (torch.save)."""
    import torch.distributed as dist

    from kubedistill.runtime.trainer import Trainer
    from kubedistill.runtime.trainer.distributed import leave_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    spec = DistillationJobSpec.model_validate_json(spec_json)
    trainer = Trainer(spec)
    if rank != 0:
        trainer.follow()
    else:
        # What the run really did (a flag the model ignored would make a comparison vacuous).
        result: dict[str, Any] = {
            "checkpointing": bool(getattr(trainer.model.hf_model(), "is_gradient_checkpointing", False))
        }
        if scenario == "step_resume":
            result["stats"] = trainer.step(make_parts())
            result["weights"] = {n: t.clone() for n, t in trainer.named_full_weights()}
            trainer.save_checkpoint(1, 7, {"cursor": 11})
            trainer.step(make_parts(seed=2))
            result["after_two"] = {n: t.clone() for n, t in trainer.named_full_weights()}
            resumed = trainer.resume()
            result["resumed"] = (resumed.step, resumed.weight_version, resumed.driver_state, trainer.step_count)
            trainer.step(make_parts(seed=2))
            result["replayed"] = {n: t.clone() for n, t in trainer.named_full_weights()}
        elif scenario == "saved_batch":
            # A batch the test saved beside `out` (e.g. image samples, tests/test_trainer_vl.py).
            result["stats"] = trainer.step(torch.load(saved_batch_path(out), weights_only=False).to_parts())
            result["weights"] = {n: t.clone() for n, t in trainer.named_full_weights()}
        elif scenario == "exit":
            # One step, then the end of every rank as the product ends it (tests/test_trainer_dist.py).
            result["stats"] = trainer.step(make_parts())
        elif scenario == "proximal":
            # Two mini-batches in one step: the proximal pass runs its forwards on every rank.
            result["stats"] = trainer.train([make_parts(), make_parts(seed=1)])
            result["weights"] = {n: t.clone() for n, t in trainer.named_full_weights()}
        trainer.close()
        torch.save(result, out)
    leave_process_group()


if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    worker(rank, world, port, Path(sys.argv[4]).read_text(), sys.argv[5], sys.argv[6])
    # A rank ends as `kubedistill role trainer` ends one (runtime/entrypoints/roles.py).
    finish_process(0)
