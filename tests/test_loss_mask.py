"""A multi-turn trace's observation tokens (the environment's, not sampled by the student) carry no
loss in any loss mode: a train step is the same whatever the teacher's scores, the rollout's
log-probs and the top-k rows at those tokens, and different once they count."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from kubedistill.runtime.trainer import Trainer
from kubedistill.runtime.trainer import losses as L
from kubedistill.runtime.wire.batch import TrainBatch
from trainer_cases import make_batch, make_spec

torch.set_num_threads(1)

MODES: dict[str, dict[str, Any]] = {
    "k1": {"algorithm.distillation": {"lossMode": "k1", "usePolicyGradient": True}},
    "k3-sequence-is": {
        "algorithm.distillation": {"lossMode": "k3"},
        "algorithm.offPolicy": {"importance": {"level": "sequence", "mode": "truncate"}},
    },
    "forwardKLTopK": {"algorithm.distillation": {"lossMode": "forwardKLTopK", "topK": 3}},
    "reverseKLTopK": {"algorithm.distillation": {"lossMode": "reverseKLTopK", "topK": 3}},
    "k3-policy-gradient": {"algorithm.distillation": {"lossMode": "k3", "usePolicyGradient": True}},
    "grpo": {
        "algorithm.distillation": {"enabled": False, "useTaskRewards": True},
        "rollout.sampling.samplesPerPrompt": 2,
    },
}


def trace_batch() -> TrainBatch:
    """make_batch's samples as traces: in each response, tokens 2 and 3 (where it has them) are an
    observation; with the rollout's top-k rows and the teacher's log-probs at them, so that every
    loss mode finds its signals."""
    b = make_batch(seed=3)
    resp = [len(t) - p for t, p in zip(b.token_ids, b.prompt_lens)]
    g = torch.Generator().manual_seed(7)
    b.signals["rollout_topk_ids"] = [[[4 + (t + j) % 12 for j in range(3)] for t in range(r)] for r in resp]
    b.signals["teacher_logprobs_at_rollout_topk"] = [(-torch.rand(r, 3, generator=g) * 4).tolist() for r in resp]
    b.loss_masks = [[t not in (2, 3) for t in range(r)] for r in resp]
    return b


def scrambled(b: TrainBatch) -> TrainBatch:
    """The same batch with other values at every observation token, in every per-token field."""
    out = copy.deepcopy(b)
    g = torch.Generator().manual_seed(11)
    assert out.loss_masks is not None
    for i, mask in enumerate(out.loss_masks):
        for t, kept in enumerate(mask):
            if kept:
                continue
            out.rollout_logprobs[i][t] = -float(torch.rand(1, generator=g)) * 9
            out.signals["teacher_logprobs"][i][t] = -float(torch.rand(1, generator=g)) * 9
            for name in ("teacher_topk_logprobs", "teacher_logprobs_at_rollout_topk"):
                out.signals[name][i][t] = sorted((-torch.rand(3, generator=g) * 9).tolist(), reverse=True)
            out.signals["teacher_topk_ids"][i][t] = [13, 14, 15]
    return out


def stepped(spec_overrides: dict[str, Any], batch: TrainBatch, student: Path, ckpt: Path) -> dict[str, torch.Tensor]:
    t = Trainer(make_spec(student, ckpt, **spec_overrides))
    try:
        t.step(batch.to_parts())
        return {n: w.clone() for n, w in t.named_full_weights()}
    finally:
        t.close()


@pytest.mark.parametrize("mode", list(MODES))
def test_observation_tokens_carry_no_gradient(mode: str, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    overrides = MODES[mode]
    batch = trace_batch()
    masked = stepped(overrides, batch, tiny_models["student"], tmp_path / "a")
    other = stepped(overrides, scrambled(batch), tiny_models["student"], tmp_path / "b")
    for name in masked:
        assert torch.allclose(masked[name], other[name], atol=1e-7, rtol=0), name
    # Without the mask the same scrambled values change the step: the check above can fail.
    unmasked = scrambled(batch)
    unmasked.loss_masks = None
    counted = stepped(overrides, unmasked, tiny_models["student"], tmp_path / "c")
    assert any(not torch.allclose(masked[n], counted[n], atol=1e-7, rtol=0) for n in masked)


def test_means_are_over_the_student_tokens_only() -> None:
    mask = torch.tensor([True, False, True, True, False, False])
    tm = L.token_weights([3, 3], "tokenMean", mask)
    assert tm.tolist() == pytest.approx([1 / 3, 0, 1 / 3, 1 / 3, 0, 0])
    sm = L.token_weights([3, 3], "seqMeanTokenMean", mask)
    assert sm.tolist() == pytest.approx([1 / 4, 0, 1 / 4, 1 / 2, 0, 0])
    # A single-turn batch (no mask) is weighted as before.
    assert L.token_weights([2, 2], "tokenMean").tolist() == pytest.approx([0.25] * 4)


def test_a_single_turn_batch_carries_no_mask_tensor() -> None:
    b = make_batch()
    assert b.to_parts().header()["loss_mask"] is False and b.to_tensors().loss_mask is None
    t = trace_batch().to_tensors()
    assert t.loss_mask is not None and t.loss_mask.dtype == torch.bool
    assert int((~t.loss_mask).sum()) == 2 * len(t)
