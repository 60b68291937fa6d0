"""The batcher: whole groups per step, mini-batch split, TrainBatch conversion, refusals."""

from __future__ import annotations

import pytest

from batch_lists import to_lists
from kubedistill.api.losses import CONTRACTS
from kubedistill.api.spec import LossMode
from kubedistill.runtime.driver.batcher import BatchRequirements, assemble, to_train_batch
from kubedistill.runtime.driver.samples import SampleGroup


class Out:
    def __init__(self, ids, version):
        self.token_ids, self.logprobs = list(ids), [-0.25 * (i + 1) for i in range(len(ids))]
        self.versions, self.finish_reason = [version] * len(ids), "stop"
        self.topk_ids = None


def scored_group(gid: int, n: int = 2, version: int = 0, top_k: int = 2) -> SampleGroup:
    g = SampleGroup.for_prompt(gid, [1, 2, 3], n, max_tokens=4, data_source="arith", ground_truth="5")
    for s in g.samples:
        s.continuation()
        s.extend(Out([5, 2][: 1 + s.index % 2], version))
        t = len(s.response_ids)
        s.teacher = "arith"
        s.signals["teacher_logprobs"] = [-0.1] * t
        s.signals["teacher_topk_ids"] = [[5, 6][:top_k]] * t
        s.signals["teacher_topk_logprobs"] = [[-0.1, -2.0][:top_k]] * t
        s.reward = float(s.index)
    return g


FORWARD = CONTRACTS[LossMode.forward_kl_top_k]
REQ = BatchRequirements(group_size=2, mini_batch_size=4, require_batches=2, contract=FORWARD, top_k=2, rewards=True)


def test_step_is_split_into_whole_group_minibatches() -> None:
    groups = [scored_group(g, version=v) for g, v in ((10, 3), (11, 4), (12, 4), (13, 4))]
    step = assemble(groups, REQ, trainer_version=4)
    assert [[s.group_id for s in mb] for mb in step.minibatches] == [[10, 10, 11, 11], [12, 12, 13, 13]]
    assert step.staleness() == [1, 1, 0, 0, 0, 0, 0, 0]
    batches = [to_lists(b) for b in step.train_batches(REQ)]
    assert [len(b.token_ids) for b in batches] == [4, 4]
    b = batches[0]
    assert b.token_ids[:2] == [[1, 2, 3, 5], [1, 2, 3, 5, 2]]
    assert b.prompt_lens == [3, 3, 3, 3]
    assert b.rollout_logprobs[1] == [-0.25, -0.5]
    assert b.group_ids == [10, 10, 11, 11] and b.rewards == [0.0, 1.0, 0.0, 1.0]
    assert b.weight_versions == [3, 3, 4, 4]
    assert b.signals["teacher_topk_ids"][1] == [[5, 6], [5, 6]]


def test_what_the_loss_needs_is_checked() -> None:
    with pytest.raises(ValueError, match="needs requireBatches x miniBatchSize = 8 samples, got 4"):
        assemble([scored_group(1), scored_group(2)], REQ, 0)
    unscored = scored_group(3)
    del unscored.samples[1].signals["teacher_logprobs"]
    step = assemble([scored_group(1), scored_group(2), unscored, scored_group(4)], REQ, 0)
    with pytest.raises(ValueError, match=r"sample 3-1 .*teacher log-probs for None of 2"):
        step.train_batches(REQ)
    no_reward = scored_group(5)
    no_reward.samples[0].reward = None
    with pytest.raises(ValueError, match="no task reward"):
        to_train_batch(no_reward.samples, REQ)
    with pytest.raises(ValueError, match="3 samples, rollout.sampling.samplesPerPrompt is 2"):
        assemble([scored_group(6, n=3)], REQ, 0)
    wide = scored_group(7)
    wide.samples[0].signals["teacher_topk_ids"] = [[1, 2, 3]]
    with pytest.raises(ValueError, match="top-k row 0 has 3 ids"):
        to_train_batch(wide.samples, REQ)


def test_distillation_only_batches_carry_no_rewards_and_small_vocab_topk_is_fine() -> None:
    req = BatchRequirements(group_size=2, mini_batch_size=2, contract=FORWARD, top_k=4, rewards=False)
    g = scored_group(1, top_k=2)  # rows of 2 < topK 4: a vocabulary smaller than k
    g.samples[0].reward = None
    b = to_lists(to_train_batch(g.samples, req))
    assert b.rewards is None and b.group_ids is None and "teacher_topk_ids" in b.signals
    rl_only = BatchRequirements(group_size=2, mini_batch_size=2, contract=None, rewards=True)
    g2 = scored_group(2)
    g2.samples[0].signals.clear()
    b2 = to_lists(to_train_batch(g2.samples, rl_only))
    assert b2.signals == {} and b2.rewards == [0.0, 1.0]


def test_requirements_from_the_example_specs() -> None:
    from pathlib import Path

    from kubedistill.api.validate import load_job

    root = Path(__file__).resolve().parent.parent
    quick = BatchRequirements.from_spec(load_job(root / "examples/quickstart-cpu.yaml").spec)
    # miniBatchSize 64 samples = 64 groups of n=1
    assert (quick.group_size, quick.step_samples, quick.contract, quick.top_k, quick.rewards) == (
        1,
        64,
        FORWARD,
        16,
        False,
    )
    multi = BatchRequirements.from_spec(load_job(root / "examples/multi-teacher-6gpu.yaml").spec)
    assert (multi.group_size, multi.step_samples, multi.contract.top_k, multi.rewards) == (4, 16, None, True)


def test_arrays_are_made_once_as_a_group_enters_the_buffer_and_dropped_when_it_changes() -> None:
    from kubedistill.runtime.driver.batcher import prepare

    g = scored_group(1)
    prepare(g, REQ)
    s = g.samples[1]
    made = s.arrays
    assert made is not None and made.signals["teacher_topk_ids"].tolist() == [[5, 6], [5, 6]]
    b = to_train_batch(g.samples, REQ)
    assert b.parts[1] is made  # a step only concatenates what the buffer already holds
    s.clear_scores()
    assert s.arrays is None  # rescored or restarted samples are packed again
    unfinished = scored_group(2)
    unfinished.samples[0].finish_reason = None
    prepare(unfinished, REQ)  # left for to_train_batch to refuse with the whole story
    assert unfinished.samples[0].arrays is None and unfinished.samples[1].arrays is not None
