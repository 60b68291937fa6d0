"""Single-rank trainer: log-probs, micro-batching, learning, metrics, full weights, HF export."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kubedistill.api.losses import TEACHER_TOP_K
from kubedistill.api.spec import Device, DType, OptimSpec
from kubedistill.runtime.metrics import RoleMetrics
from kubedistill.runtime.trainer import Trainer
from kubedistill.runtime.trainer.commands import Command, CommandChannel
from kubedistill.runtime.trainer.distributed import (
    compute_dtype,
    needs_control_group,
    needs_sharding,
    process_group_backend,
    rank_device,
)
from kubedistill.runtime.trainer.microbatch import collate, micro_batches, pack_rows, shard_samples
from kubedistill.runtime.trainer.model import packing_is_exact
from kubedistill.runtime.trainer.schedule import lr_factor
from kubedistill.runtime.trainer.stats import StepSums
from kubedistill.runtime.wire.batch import TrainBatch
from trainer_cases import make_batch, make_parts, make_spec

torch.set_num_threads(1)


@pytest.fixture
def trainer(tiny_models: dict[str, Path], tmp_path: Path):
    t = Trainer(make_spec(tiny_models["student"], tmp_path / "ckpt"))
    yield t
    t.close()


@pytest.mark.parametrize(
    "rows", [[[0], [1], [2], [3], [4]], [[0, 3], [2], [1, 4]], [[4, 0, 2, 1, 3]]], ids=["padded", "packed", "one-row"]
)
def test_log_probs_match_a_plain_hf_forward(trainer: Trainer, tiny_models: dict[str, Path], rows) -> None:
    """Each sample alone through the HF model gives the log-probs the trainer computes, whether
    samples are padded to rows of their own or packed end to end (no sample sees another)."""
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    idx = [i for row in rows for i in row]  # the order collate emits tokens in
    resp = [batch.response_len(i) for i in range(len(batch))]
    mb = collate(batch.to_tensors(), rows, torch.ones(sum(resp)), None, trainer.pad_id, top_k=TEACHER_TOP_K)
    assert (mb.position_ids is not None) == any(len(r) > 1 for r in rows)
    with torch.no_grad():
        got, got_topk = trainer.model(mb.input_ids, mb.gather_index, mb.targets, mb.topk_ids, mb.position_ids)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_models["student"]), dtype=torch.float32)
    want, want_topk = [], []
    with torch.no_grad():
        for i in idx:
            ids = torch.tensor([batch.token_ids[i]])
            lp = ref(ids).logits[0].log_softmax(-1)
            p = batch.prompt_lens[i]
            rows = lp[p - 1 : len(batch.token_ids[i]) - 1]
            want.append(rows.gather(-1, torch.tensor(batch.token_ids[i][p:]).unsqueeze(-1)).squeeze(-1))
            want_topk.append(rows.gather(-1, torch.tensor(batch.signals["teacher_topk_ids"][i])))
    assert torch.allclose(got, torch.cat(want), atol=1e-5)
    assert torch.allclose(got_topk, torch.cat(want_topk), atol=1e-5)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_micro_batch_split_does_not_change_the_step(tiny_models: dict[str, Path], tmp_path: Path, pack: bool) -> None:
    """Tiny micro-batches vs one micro-batch, padded or packed: the same loss, gradient and weights."""
    results = []
    for tokens, packed in ((16, False), (100000, pack)):
        t = Trainer(
            make_spec(
                tiny_models["student"],
                tmp_path / "c",
                **{
                    "trainer.microBatchTokens": tokens,
                    "trainer.packSequences": packed,
                    "algorithm.lossAggregation": "seqMeanTokenMean",
                },
            )
        )
        assert t.pack == packed
        try:
            stats = t.step(make_parts())
            results.append((stats, {n: w.clone() for n, w in t.named_full_weights()}))
        finally:
            t.close()
    (a, wa), (b, wb) = results
    assert a.loss_total == pytest.approx(b.loss_total, rel=1e-6)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-5), name


def test_steps_learn_and_report_metrics(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    metrics = RoleMetrics("job", "trainer", 0)
    # make_batch's behaviour log-probs are random, not the student's: without the importance
    # weights (which move with the student) the loss is the plain forwardKLTopK.
    spec = make_spec(
        tiny_models["student"],
        tmp_path / "c",
        **{"trainer.optim": {"lr": 3e-3, "warmupSteps": 2}, "algorithm.offPolicy.importance.mode": "none"},
    )
    t = Trainer(spec, metrics=metrics)
    try:
        batch = make_batch()
        stats = [t.step(batch.to_parts()) for _ in range(6)]
    finally:
        t.close()
    assert stats[-1].loss_total < 0.6 * stats[0].loss_total
    assert [s.step for s in stats] == [1, 2, 3, 4, 5, 6]
    assert stats[0].lr == pytest.approx(1.5e-3) and stats[1].lr == pytest.approx(3e-3)
    assert stats[0].tokens == sum(len(x) for x in batch.token_ids)
    assert stats[0].kl is not None and stats[0].tokens_per_second > 0
    reg = metrics.registry
    labels = {"job": "job", "role": "trainer", "replica": "0"}
    assert reg.get_sample_value("kubedistill_step", labels) == 6
    assert reg.get_sample_value("kubedistill_loss", {**labels, "kind": "total"}) == pytest.approx(stats[-1].loss_total)
    assert reg.get_sample_value("kubedistill_loss", {**labels, "kind": "distill"}) == pytest.approx(
        stats[-1].loss_distill
    )
    assert reg.get_sample_value("kubedistill_grad_norm", labels) == pytest.approx(stats[-1].grad_norm)
    assert reg.get_sample_value("kubedistill_learning_rate", labels) == pytest.approx(stats[-1].lr)
    assert reg.get_sample_value("kubedistill_kl_student_teacher", labels) == pytest.approx(stats[-1].kl)
    # The compute is part of the step; the driver charges the step's phases (runtime/driver/phases.py).
    assert all(0 < s.compute_seconds <= s.seconds for s in stats)
    assert reg.get_sample_value("kubedistill_step_seconds_count", {**labels, "phase": "train_compute"}) is None


def test_full_weights_have_hf_names_and_export_round_trips(
    trainer: Trainer, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer.step(make_parts())
    weights = list(trainer.named_full_weights())
    names = [n for n, _ in weights]
    on_disk = set(load_file(str(tiny_models["student"] / "model.safetensors")))
    assert set(names) == on_disk - {"lm_head.weight"}  # tied lm_head omitted
    assert names[0] == "model.embed_tokens.weight" and len(names) == len(set(names))
    out = trainer.export_hf(tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    state = exported.state_dict()
    for name, tensor in weights:
        assert torch.equal(state[name], tensor), name
    assert torch.equal(exported.lm_head.weight, exported.model.embed_tokens.weight)
    assert len(AutoTokenizer.from_pretrained(str(out))) == 16
    # Readable by other uids on a shared claim (a serving pod), not 0600 as safetensors writes it.
    assert {f.stat().st_mode & 0o777 for f in out.iterdir()} == {0o644}


def test_k1_policy_gradient_and_grpo_run(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    spec = make_spec(
        tiny_models["student"],
        tmp_path / "c",
        **{
            "algorithm.distillation": {
                "lossMode": "k1",
                "usePolicyGradient": True,
                "useTaskRewards": True,
                "coef": 0.5,
            },
            "rollout.sampling.samplesPerPrompt": 2,
            "trainer.miniBatchSize": 4,
        },
    )
    t = Trainer(spec)
    try:
        s = t.step(make_parts())
    finally:
        t.close()
    assert math.isfinite(s.loss_total) and s.loss_pg != 0.0
    assert s.loss_total == pytest.approx(s.loss_pg + 0.5 * s.loss_distill, rel=1e-6)


def test_advantage_chooses_the_task_reward_estimator(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    # make_batch's groups have rewards (0, 1): advantages ±0.5 centred, ±1 leave-one-out, ±0.5 /
    # std = ±0.707 with GRPO. On-policy the task term is -w A per token, so it scales with A.
    pg = {}
    for estimator in ("grpo", "rloo", "groupMean"):
        spec = make_spec(
            tiny_models["student"],
            tmp_path / estimator,
            **{
                "algorithm.distillation": {"lossMode": "k3", "useTaskRewards": True},
                "algorithm.advantage": estimator,
                "rollout.sampling.samplesPerPrompt": 2,
                "trainer.miniBatchSize": 4,
            },
        )
        t = Trainer(spec)
        try:
            pg[estimator] = t.step(make_parts()).loss_pg
        finally:
            t.close()
    assert pg["groupMean"] != 0.0
    assert pg["rloo"] == pytest.approx(2.0 * pg["groupMean"], rel=1e-5)
    assert pg["grpo"] == pytest.approx(math.sqrt(2.0) * pg["groupMean"], rel=1e-4)


def test_missing_teacher_signal_is_a_clear_error(trainer: Trainer) -> None:
    batch = make_batch()
    del batch.signals["teacher_topk_ids"], batch.signals["teacher_topk_logprobs"]
    with pytest.raises(ValueError, match=r"TrainBatch.signals\['teacher_topk_ids'\]: lossMode forwardKLTopK needs"):
        trainer.step(batch.to_parts())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: b.prompt_lens.pop(), r"TrainBatch.prompt_lens: has 4 entries, expected one per sample \(5\)"),
        (lambda b: b.prompt_lens.__setitem__(0, 99), r"TrainBatch.prompt_lens\[0\]: 99 must be >= 1"),
        (
            lambda b: b.rollout_logprobs[1].pop(),
            r"TrainBatch.rollout_logprobs\[1\]: has \d+ entries, expected \d+ response tokens",
        ),
        (lambda b: setattr(b, "group_ids", None), "rewards and group_ids must be given together"),
    ],
)
def test_batch_validation_names_the_field(change, message) -> None:
    batch = make_batch()
    change(batch)
    with pytest.raises(ValueError, match=message):
        batch.validate()


def test_plan_balances_ranks_and_bounds_micro_batches() -> None:
    lengths = [10, 3, 7, 7, 2, 9]
    shards = shard_samples(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 2
    mbs = micro_batches(list(range(6)), lengths, 16)
    assert all(len(row) == 1 for m in mbs for row in m)  # not packing: a row per sample
    assert sorted(i for m in mbs for row in m for i in row) == list(range(6))
    assert all(len(m) * max(lengths[row[0]] for row in m) <= 16 or len(m) == 1 for m in mbs)
    assert micro_batches([0], [50], 16) == [[[0]]]  # too long alone still runs


def test_packing_fills_rows_no_wider_than_the_longest_sample() -> None:
    lengths = [10, 3, 7, 7, 2, 9, 1]
    rows = pack_rows(list(range(7)), lengths, 10)
    assert sorted(i for r in rows for i in r) == list(range(7))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    assert len(rows) == 4  # 39 tokens: 10 | 9+1 | 7+3 | 7+2 (first fit, longest first)
    assert pack_rows([0, 1], [12, 3], 10) == [[0], [1]]  # longer than a row: a row of its own
    mbs = micro_batches(list(range(7)), lengths, 20, pack=True)
    assert sorted(i for m in mbs for row in m for i in row) == list(range(7))
    assert all(len(m) * max(sum(lengths[i] for i in row) for row in m) <= 20 for m in mbs)
    # Packing never costs more padded tokens than one row per sample.
    padded = sum(len(m) * max(lengths[row[0]] for row in m) for m in micro_batches(list(range(7)), lengths, 20))
    packed = sum(len(m) * max(sum(lengths[i] for i in row) for row in m) for m in mbs)
    assert packed == 40 < padded == 43  # rows 10,10 | 10,9 against 10,9 | 7,7 | 3,2,1


def test_packing_check_catches_a_model_that_lets_packed_samples_mix(trainer: Trainer) -> None:
    """A decoder that ignores position ids (so no block-causal mask) fails the start-up check."""
    assert packing_is_exact(trainer.model, trainer.device)
    decoder = trainer.model.lm.get_decoder()
    forward = decoder.forward
    decoder.forward = lambda *a, position_ids=None, **kw: forward(*a, **kw)
    try:
        assert not packing_is_exact(trainer.model, trainer.device)
    finally:
        decoder.forward = forward


@pytest.mark.parametrize("require_batches", [2, 4])
def test_lr_schedule_counts_train_steps_with_several_mini_batches(
    tiny_models: dict[str, Path], tmp_path: Path, require_batches: int
) -> None:
    spec = make_spec(
        tiny_models["student"],
        tmp_path / "c",
        **{
            "mode": "oneStepOff",
            "async": {"requireBatches": require_batches},
            "trainer.totalSteps": 6,
            "trainer.optim": {"lr": 1e-4, "warmupSteps": 2, "schedule": "cosine", "minLrRatio": 0.1},
        },
    )
    t = Trainer(spec)
    try:
        batch = make_batch(n=2)
        steps = [t.train([batch.to_parts()] * require_batches) for _ in range(6)]
    finally:
        t.close()
    cos = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(4)]
    expected = [0.5, 1.0, *cos]  # warm-up over 2 train steps, then cosine to step 6
    for updates, factor in zip(steps, expected):
        assert [u.lr for u in updates] == pytest.approx([1e-4 * factor] * require_batches)


def test_lr_schedule() -> None:
    o = OptimSpec(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, o, 12) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(7, o, 12) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(12, o, 12) == pytest.approx(0.1)
    lin = OptimSpec(lr=1.0, schedule="linear")
    assert lr_factor(5, lin, 10) == pytest.approx(0.5)
    assert lr_factor(5, OptimSpec(lr=1.0), 10) == 1.0


def test_short_top_k_rows_are_masked() -> None:
    batch = TrainBatch(
        token_ids=[[1, 5, 6, 7]],
        prompt_lens=[2],
        rollout_logprobs=[[-1.0, -1.0]],
        signals={"teacher_topk_ids": [[[5, 6], [7]]], "teacher_topk_logprobs": [[[-0.1, -2.0], [-0.01]]]},
    )
    batch.validate()
    mb = collate(batch.to_tensors(), [[0]], torch.ones(2), None, 0, top_k=TEACHER_TOP_K)
    assert mb.topk_ids.tolist() == [[5, 6], [7, 0]]
    assert mb.topk_valid.tolist() == [[True, True], [True, False]]
    assert mb.gather_index.tolist() == [1, 2] and mb.targets.tolist() == [6, 7]


def test_gpu_decisions() -> None:
    """What the trainer picks on cuda, checked without a GPU."""
    assert process_group_backend(Device.cuda) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(Device.cpu) == "gloo"
    assert needs_control_group("cpu:gloo,cuda:nccl") and needs_control_group("nccl")
    assert not needs_control_group("gloo")
    assert rank_device(Device.cuda, {"LOCAL_RANK": "3"}) == torch.device("cuda", 3)
    assert rank_device(Device.cuda, {}) == torch.device("cuda", 0)
    assert rank_device(Device.cpu, {"LOCAL_RANK": "3"}) == torch.device("cpu")
    assert compute_dtype(DType.auto, Device.cuda) is torch.bfloat16
    assert compute_dtype(DType.auto, Device.cpu) is torch.float32
    assert compute_dtype(DType.float16, Device.cuda) is torch.float16


def test_only_several_ranks_or_mixed_precision_need_fsdp() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert not needs_sharding(1, f32, {f32})
    assert needs_sharding(2, f32, {f32})
    assert needs_sharding(1, bf16, {f32})  # FSDP's mixed precision: bf16 compute, fp32 masters
    assert needs_sharding(1, f32, {f32, bf16})


def test_one_rank_learns_the_same_with_or_without_fsdp(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unsharded single-rank trainer takes the very steps FSDP2 on one rank takes."""
    import kubedistill.runtime.trainer.distributed as distributed

    results = []
    for sharded in (False, True):
        monkeypatch.setattr(distributed, "needs_sharding", lambda *_, answer=sharded: answer)
        t = Trainer(make_spec(tiny_models["student"], tmp_path / "c"))
        assert t.sharded == sharded
        try:
            stats = [t.step(make_parts(seed)) for seed in range(3)]
            results.append((stats, {n: w.detach().clone() for n, w in t.named_full_weights()}))
        finally:
            t.close()
    (plain, wp), (fsdp, wf) = results
    for a, b in zip(plain, fsdp):
        assert a.loss_total == pytest.approx(b.loss_total, rel=1e-6)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
    for name in wp:
        assert torch.allclose(wp[name], wf[name], atol=1e-6), name


def test_step_sums_add_by_name_and_reduce_over_ranks() -> None:
    batch = make_batch()
    resp = [batch.response_len(i) for i in range(len(batch))]
    rows = [[0], [1]]
    mb = collate(batch.to_tensors(), rows, torch.full((sum(resp),), 0.5), None, 0)
    n = mb.targets.numel()
    losses = {"total": torch.full((n,), 2.0), "distill": torch.ones(n), "pg": torch.zeros(n)}
    logprobs = torch.full((n,), -1.0)
    sums = StepSums()
    sums.add(mb, losses, logprobs, world=2, filler=False)
    assert sums.loss_total == pytest.approx(2.0 * 0.5 / 2 * n) and sums.loss_pg == 0.0
    assert sums.response_tokens == sums.kl_tokens == n
    assert sums.tokens == len(batch.token_ids[0]) + len(batch.token_ids[1])
    filler = collate(batch.to_tensors(), rows, torch.ones(sum(resp)), None, 0, filler=True)
    sums.add(filler, losses, logprobs, world=2, filler=True)  # zero weights, no tokens
    assert sums.loss_total == pytest.approx(0.5 * n) and sums.response_tokens == n

    def two_ranks(t: torch.Tensor) -> None:
        assert t.dtype == torch.float64
        t.mul_(2)

    total = sums.all_reduce(two_ranks)
    assert total.tokens == 2 * sums.tokens and total.kl_sum == 2 * sums.kl_sum
    assert total.kl == pytest.approx(sums.kl_sum / sums.kl_tokens)
    assert StepSums().kl is None


class _FakeRanks:
    """Rank 1 of 2, receiving `sent` from rank 0."""

    rank, world = 1, 2

    def __init__(self, sent: list) -> None:
        self.sent = sent

    def broadcast_object(self, obj=None):
        return self.sent.pop(0)


def test_followers_dispatch_commands_through_the_table() -> None:
    ran = []
    handlers = {c: (lambda payload, c=c: ran.append((c, payload))) for c in Command}
    sent = [(Command.step, "batch"), (Command.named_full_weights, None), (Command.close, None), (Command.step, 0)]
    CommandChannel(_FakeRanks(sent)).follow(handlers)
    assert ran == [(Command.step, "batch"), (Command.named_full_weights, None), (Command.close, None)]
    with pytest.raises(RuntimeError, match="unknown trainer command 'nope'"):
        CommandChannel(_FakeRanks([("nope", None)])).follow(handlers)
    with pytest.raises(ValueError, match="no handler for"):
        CommandChannel(_FakeRanks([])).follow({Command.close: ran.append})
    with pytest.raises(RuntimeError, match="Trainer.step is called on rank 0 only"):
        CommandChannel(_FakeRanks([])).broadcast(Command.step)


@pytest.mark.parametrize("proximal", ["recompute", "current"])
@pytest.mark.parametrize(
    "loss", [{"lossMode": "k1", "usePolicyGradient": True}, {"lossMode": "k3"}], ids=["k1+PG", "k3 direct"]
)
def test_proximal_pass_anchors_later_mini_batches_to_the_step_start(
    tiny_models: dict[str, Path], tmp_path: Path, proximal: str, loss: dict
) -> None:
    spec = make_spec(
        tiny_models["student"],
        tmp_path / "c",
        **{
            "algorithm.distillation": loss,
            "algorithm.offPolicy": {"proximal": proximal},
            "trainer.optim": {"lr": 1e-2},
        },
    )
    t = Trainer(spec)
    try:
        batch = make_batch()
        # Behaviour log-probs = the trainer's own at the start, at lag 0 (as a rollout engine
        # serving the same weights would report them).
        t._recompute_proximal([batch.to_tensors()])
        start = t._proximal.pop()
        batch.rollout_logprobs = [start[i].tolist() for i in range(len(batch))]
        batch.trainer_version = 0
        first, second = t.train([batch.to_parts()] * 2)
    finally:
        t.close()
    assert first.off_policy["logprobDiffLag0AbsMax"] == pytest.approx(0.0, abs=1e-5)
    assert first.off_policy["isWeightMean"] == pytest.approx(1.0, abs=1e-5)
    if proximal == "recompute":
        # The second mini-batch is weighted against the step's start: still the behaviour policy.
        assert second.off_policy["isWeightMax"] == pytest.approx(1.0, abs=1e-5)
    else:
        # Against the weights the first update moved, the same samples are off-policy.
        assert second.off_policy["isWeightMax"] > 1.0 + 1e-3
    # The trainer's own log-probs moved in both cases (lr 1e-2): the lag-0 diff shows it.
    assert second.off_policy["logprobDiffLag0AbsMean"] > 1e-3


def test_the_final_status_goes_to_the_termination_log_only_where_the_kubelet_made_one(tmp_path: Path) -> None:
    import json

    from kubedistill.api.progress import TrainerProgress
    from kubedistill.runtime.entrypoints.trainer import write_termination_message

    status = TrainerProgress(step=12, total_steps=12, weight_version=12)
    absent = tmp_path / "termination-log"
    write_termination_message(status, absent)
    assert not absent.exists()  # `kubedistill run`: no kubelet, no file made
    absent.write_text("")  # what the kubelet mounts
    write_termination_message(status, absent)
    assert json.loads(absent.read_text())["step"] == 12
