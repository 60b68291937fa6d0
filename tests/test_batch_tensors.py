"""Batches as tensors: the tensor form of a TrainBatch, its micro-batches sliced without Python
loops over tokens, against the list path it replaced (tests/list_collate.py), and its broadcast
to every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batch_lists import to_lists
from kubedistill.api.losses import CONTRACTS, TEACHER_TOP_K
from kubedistill.api.spec import LossMode
from kubedistill.runtime.trainer import Trainer
from kubedistill.runtime.trainer import losses as L
from kubedistill.runtime.trainer.microbatch import MicroBatch, collate, micro_batches
from kubedistill.runtime.wire.batch import BatchBuffers, TensorBatch, TrainBatch
from list_collate import list_collate
from ports import free_port
from trainer_cases import make_batch, make_spec

HERE = Path(__file__).resolve().parent
CONTRACT = CONTRACTS[LossMode.forward_kl_top_k]
torch.set_num_threads(1)


def ragged_batch() -> TrainBatch:
    """make_batch with top-k rows shorter than k: a whole sample of width 2 (a small vocabulary)
    and single short rows inside a full-width sample."""
    b = make_batch(n=6)
    ids, lps = b.signals["teacher_topk_ids"], b.signals["teacher_topk_logprobs"]
    ids[1], lps[1] = [row[:2] for row in ids[1]], [row[:2] for row in lps[1]]
    ids[3][0], lps[3][0] = ids[3][0][:1], lps[3][0][:1]
    ids[4][-1], lps[4][-1] = ids[4][-1][:2], lps[4][-1][:2]
    b.weight_versions = [0, 1, 0, 2, 1, 0]
    b.trainer_version = 2
    return b


def test_tensor_form_round_trips_the_lists() -> None:
    b = ragged_batch()
    b.validate()
    parts = b.to_parts()
    parts.validate(CONTRACT)
    t = parts.to_tensors()
    assert t.token_ids.dtype == torch.int64 and t.rollout_logprobs.dtype == torch.float32
    assert t.signals["teacher_topk_ids"].shape == (sum(t.response_lens), 3)
    assert set(t.widths) == {"teacher_topk_ids", "teacher_topk_logprobs"}
    back = to_lists(t)
    assert back.token_ids == b.token_ids and back.prompt_lens == b.prompt_lens
    assert back.signals["teacher_topk_ids"] == b.signals["teacher_topk_ids"]
    for got, want in zip(back.signals["teacher_topk_logprobs"], b.signals["teacher_topk_logprobs"]):
        assert [torch.tensor(r, dtype=torch.float32).tolist() for r in want] == got
    assert make_batch().to_tensors().widths == {}  # every row has k entries: no widths travel
    # Laid out in another order: the same samples, moved whole.
    order = [5, 3, 1, 0, 2, 4]
    moved = to_lists(parts.to_tensors(order))
    assert moved.token_ids == [b.token_ids[i] for i in order]
    assert moved.signals["teacher_topk_ids"] == [b.signals["teacher_topk_ids"][i] for i in order]
    assert moved.weight_versions == [b.weight_versions[i] for i in order]
    assert moved.rewards == [b.rewards[i] for i in order] and moved.group_ids == [b.group_ids[i] for i in order]


def test_rows_as_the_wire_brings_them_are_kept_until_the_layout() -> None:
    # A teacher's rows arrive as int32 / float32 arrays (runtime/wire/rows.py): the sample keeps
    # them without a copy, and the layout widens the ids into the batch's int64 tensor.
    import numpy as np

    from kubedistill.runtime.wire.rows import Rows

    b = make_batch(n=3)
    want = b.to_tensors()
    wire = {
        name: [Rows.of(rows, "int32" if name == "teacher_topk_ids" else "float32").array() for rows in b.signals[name]]
        for name in ("teacher_topk_ids", "teacher_topk_logprobs")
    }
    b.signals.update(wire)
    parts = b.to_parts()
    parts.validate(CONTRACT)
    assert all(p.signals["teacher_topk_ids"] is wire["teacher_topk_ids"][i] for i, p in enumerate(parts.parts))
    assert parts.parts[0].signals["teacher_topk_logprobs"].dtype == np.float32
    got = parts.to_tensors()
    for name in wire:
        assert got.signals[name].dtype == want.signals[name].dtype
        assert torch.equal(got.signals[name], want.signals[name])


def test_batch_validation_checks_samples_not_tokens() -> None:
    parts = make_batch().to_parts()
    parts.parts[1].rollout_logprobs = parts.parts[1].rollout_logprobs[:-1]
    with pytest.raises(ValueError, match=r"TrainBatch.rollout_logprobs\[1\]: has \d+ entries, expected \d+ response"):
        parts.validate()
    parts = make_batch().to_parts()
    parts.parts[0].prompt_len = 99
    with pytest.raises(ValueError, match=r"TrainBatch.prompt_lens\[0\]: 99 must be >= 1"):
        parts.validate()
    parts = make_batch().to_parts()
    del parts.parts[2].signals["teacher_topk_ids"]
    with pytest.raises(ValueError, match=r"TrainBatch.signals\['teacher_topk_ids'\]: lossMode forwardKLTopK needs"):
        parts.validate(CONTRACT)
    # A top-k row with no id, or fewer log-probs than ids, in the list form as in the arrays.
    for ids, lps in (([], []), ([5, 6], [-0.1])):
        b = make_batch()
        b.signals["teacher_topk_ids"][2][1], b.signals["teacher_topk_logprobs"][2][1] = ids, lps
        with pytest.raises(ValueError, match=r"TrainBatch.signals\['teacher_topk_ids'\]\[2\]: needs >= 1 id and as"):
            b.validate(CONTRACT)


def _same_micro_batch(a: MicroBatch, b: MicroBatch) -> None:
    for name, value in a.__dict__.items():
        other = getattr(b, name)
        if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
            assert value is not None and other is not None, name
            assert value.dtype == other.dtype and torch.equal(value, other), name
        elif name == "signals":
            assert value.keys() == other.keys()
            for k in value:
                assert torch.equal(value[k], other[k]), k
        else:
            assert value == other, name


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_tensor_path_gives_the_list_paths_losses_and_gradients(
    tiny_models: dict[str, Path], tmp_path: Path, pack: bool
) -> None:
    """On a fixed batch (ragged top-k rows, rewards, lags), every micro-batch of the tensor path
    holds the list path's tensors, and gives the same losses and the same accumulated gradients."""
    spec = make_spec(
        tiny_models["student"],
        tmp_path / "c",
        **{
            "trainer.microBatchTokens": 24,
            "algorithm.distillation.useTaskRewards": True,
            "rollout.sampling.samplesPerPrompt": 2,
        },
    )
    trainer = Trainer(spec)
    try:
        batch = ragged_batch()
        tensors = batch.to_tensors()
        resp = [batch.response_len(i) for i in range(len(batch))]
        lengths = [len(t) for t in batch.token_ids]
        weights = L.token_weights(resp, spec.algorithm.loss_aggregation.value)
        adv = L.group_advantages(torch.tensor(batch.rewards), batch.group_ids)
        plan = micro_batches(list(range(len(batch))), lengths, spec.trainer.micro_batch_tokens, pack=pack)
        assert len(plan) > 1 and (not pack or any(len(row) > 1 for m in plan for row in m))
        # The tensor path twice: samples in batch order (each micro-batch gathered), and laid out
        # in plan order as rank 0 sends them (each micro-batch a contiguous slice).
        order = [i for m in plan for row in m for i in row]
        at = {i: j for j, i in enumerate(order)}
        laid_out = batch.to_parts().to_tensors(order)
        grads, losses = [], []
        for path in ("lists", "tensors", "laid out"):
            trainer.model.zero_grad(set_to_none=True)
            per_mb = []
            for j, rows in enumerate(plan):
                filler = j == len(plan) - 1  # a filler too: zero weights, same tensors otherwise
                if path == "lists":
                    w = list(torch.split(weights, resp))
                    mb = list_collate(batch, rows, w, adv, trainer.pad_id, filler, top_k=TEACHER_TOP_K)
                elif path == "tensors":
                    mb = collate(tensors, rows, weights, adv, trainer.pad_id, filler, top_k=TEACHER_TOP_K)
                else:
                    moved = [[at[i] for i in row] for row in rows]
                    w_moved = torch.cat([torch.split(weights, resp)[i] for i in order])
                    mb = collate(laid_out, moved, w_moved, adv[order], trainer.pad_id, filler, top_k=TEACHER_TOP_K)
                    assert all(t._base is not None for t in (mb.behaviour_logprobs, mb.topk_ids))  # views
                logprobs, topk_lp = trainer.model(
                    mb.input_ids, mb.gather_index, mb.targets, mb.topk_ids, mb.position_ids
                )
                out = L.per_token_losses(
                    spec.algorithm,
                    logprobs=logprobs,
                    behaviour_logprobs=mb.behaviour_logprobs,
                    teacher_logprobs=mb.signals.get("teacher_logprobs"),
                    student_topk_logprobs=topk_lp,
                    teacher_topk_logprobs=mb.topk_logprobs,
                    topk_valid=mb.topk_valid,
                    task_advantages=mb.task_advantages,
                    segments=mb.segments,
                )
                (out["total"] * mb.weights).sum().backward()
                per_mb.append((mb, out["total"].detach().clone()))
            losses.append(per_mb)
            grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        assert any(mb.topk_valid is not None for mb, _ in losses[1])  # the masks were exercised
        for other in (1, 2):
            for (mb_list, loss_list), (mb_tensor, loss_tensor) in zip(losses[0], losses[other]):
                _same_micro_batch(mb_list, mb_tensor)
                assert torch.equal(loss_list, loss_tensor)
            assert grads[0].keys() == grads[other].keys() and grads[0]
            for name in grads[0]:
                assert torch.equal(grads[0][name], grads[other][name]), name
    finally:
        trainer.close()


def broadcast_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank: rank 0 sends ragged_batch() as the trainer does (header, then tensors); every
    rank saves what it holds afterwards."""
    import torch.distributed as dist

    from kubedistill.api.spec import Device
    from kubedistill.runtime.trainer.distributed import Ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ranks = Ranks(Device.cpu)
    if rank == 0:
        parts = ragged_batch().to_parts()
        order, plan = [5, 3, 1, 0, 2, 4], [[[[0, 1]], [[2]]], [[[3], [4, 5]]]]
        header = parts.header(order, plan)
        ranks.broadcast_object(header)
        carved = BatchBuffers().take(header)
        full, filled = parts.layout(header, order, into=carved.tensors)
        ranks.broadcast_tensors(carved.sent(filled))
    else:
        header = ranks.broadcast_object(None)
        carved = BatchBuffers().take(header)
        full = carved.tensors
        ranks.broadcast_tensors(carved.received())
    batch = TensorBatch.from_wire(header, full)
    tensors = [t.clone() for t in batch.tensors()]  # off the shared arena, for torch.save
    torch.save({"header": header, "tensors": tensors, "plan": batch.plan}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_every_rank_receives_identical_tensors(tmp_path: Path) -> None:
    port, out = free_port(), tmp_path / "batch"
    env = {**os.environ, "PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), "2", str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
    sent, received = (torch.load(f"{out}.{r}", weights_only=False) for r in range(2))
    assert sent["header"] == received["header"] and received["plan"] == [[[[0, 1]], [[2]]], [[[3], [4, 5]]]]
    assert len(sent["tensors"]) == len(received["tensors"]) == 7  # ids, mu, 3 signals, 2 widths
    for a, b in zip(sent["tensors"], received["tensors"]):
        assert a.dtype == b.dtype and torch.equal(a, b)


if __name__ == "__main__":
    broadcast_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
