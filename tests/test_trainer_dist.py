"""Two gloo CPU ranks (FSDP2) against one rank on the same global batch, and the rank-0-leads
protocol: rank 0 broadcasts the batch and every command (step, weights, save, resume); the
follower joins each collective from Trainer.follow()."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kubedistill.runtime.trainer import Trainer
from trainer_cases import make_batch, make_parts, make_spec, run_ranks, saved_batch_path

torch.set_num_threads(1)


def test_two_ranks_match_one_rank_and_resume_replays_a_step(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Two ranks with gradient checkpointing against one without: the same step."""
    spec = make_spec(
        tiny_models["student"],
        tmp_path / "ckpt",
        **{
            "algorithm.distillation.useTaskRewards": True,
            "rollout.sampling.samplesPerPrompt": 2,
            "trainer.miniBatchSize": 4,
            "trainer.gradientCheckpointing": True,
        },
    )
    two = run_ranks(2, spec.model_dump_json(by_alias=True), tmp_path, "step_resume")
    assert two["checkpointing"]

    # The same global batch on one rank (in this process).
    s1, one = _one_rank_step(
        make_spec(
            tiny_models["student"],
            tmp_path / "ckpt-1",
            **{
                "algorithm.distillation.useTaskRewards": True,
                "rollout.sampling.samplesPerPrompt": 2,
                "trainer.miniBatchSize": 4,
            },
        )
    )
    s2 = two["stats"]
    assert s1.samples == s2.samples == len(make_batch())
    assert s1.tokens == s2.tokens and s1.response_tokens == s2.response_tokens
    assert abs(s1.loss_total - s2.loss_total) < 1e-6 and abs(s1.grad_norm - s2.grad_norm) < 1e-5 * s1.grad_norm
    assert s1.loss_pg != 0.0 and s1.loss_distill > 0.0
    assert list(one) == list(two["weights"])
    # Adam divides by sqrt(v): summation-order noise on near-zero gradients moves a few weights by
    # a small fraction of lr (1e-3); every weight moved by about lr.
    initial = _hf_weights(tiny_models["student"])
    for name, w1 in one.items():
        assert torch.allclose(w1, two["weights"][name], atol=1e-4), name
        assert (w1 - initial[name]).abs().median() > 5e-4, f"{name} did not move"

    # Checkpoint after step 1, step 2, resume, step 2 again: the same weights.
    assert two["resumed"] == (1, 7, {"cursor": 11}, 1)
    for name, w in two["after_two"].items():
        assert torch.allclose(w, two["replayed"][name], atol=1e-6), name


def test_proximal_pass_over_two_ranks_matches_one_rank(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    overrides = {"algorithm.distillation": {"lossMode": "k1", "usePolicyGradient": True}}
    spec = make_spec(tiny_models["student"], tmp_path / "ckpt", **overrides)
    two = run_ranks(2, spec.model_dump_json(by_alias=True), tmp_path, "proximal")
    reference = Trainer(make_spec(tiny_models["student"], tmp_path / "ckpt-1", **overrides))
    try:
        stats = reference.train([make_parts(), make_parts(seed=1)])
        one = {n: t.clone() for n, t in reference.named_full_weights()}
    finally:
        reference.close()
    for s1, s2 in zip(stats, two["stats"]):
        assert abs(s1.loss_total - s2.loss_total) < 1e-6
        # The second mini-batch's importance weights are taken against the step's start on both.
        assert s1.off_policy["isWeightMean"] == pytest.approx(s2.off_policy["isWeightMean"], abs=1e-6)
    for name, w1 in one.items():
        assert torch.allclose(w1, two["weights"][name], atol=1e-4), name


def _hf_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_bf16_compute_on_two_ranks_keeps_float32_masters_and_tracks_float32(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """FSDP2's bf16 policy (bf16 forward/backward, fp32 gradient reduction and master weights) on
    two gloo ranks against float32 on one: the same step within bf16's precision."""
    overrides = {"trainer.optim.lr": 1e-3}
    spec = make_spec(tiny_models["student"], tmp_path / "ckpt", **overrides, **{"trainer.mixedPrecision": "bfloat16"})
    torch.save(make_batch(), saved_batch_path(tmp_path / "out-saved_batch-2.pt"))
    two = run_ranks(2, spec.model_dump_json(by_alias=True), tmp_path, "saved_batch")
    s1, one = _one_rank_step(make_spec(tiny_models["student"], tmp_path / "ckpt-1", **overrides))
    s2 = two["stats"]
    assert s2.loss_total == pytest.approx(s1.loss_total, rel=2e-2)
    assert s2.grad_norm == pytest.approx(s1.grad_norm, rel=5e-2)
    initial = _hf_weights(tiny_models["student"])
    agree = []
    for name, w1 in one.items():
        w2 = two["weights"][name]
        assert w2.dtype == torch.float32, name  # the masters stay float32
        # Each weight moves by about lr, in the same direction but where bf16 flips the sign of a
        # tiny gradient (a key bias's is noise: attention ignores it).
        assert (w2 - w1).abs().max() <= 2.5e-3, name
        agree.append(((w2 - initial[name]).sign() == (w1 - initial[name]).sign()).flatten())
    assert torch.cat(agree).float().mean() > 0.95


def test_two_ranks_exit_cleanly_run_after_run(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The end of a finished rank as the product ends it (Trainer.close / follow, every process
    group destroyed, then runtime/entrypoints/roles.finish_process): exit code 0 on both ranks,
    every time (an abort at exit once failed 1 run in ~20: a failed pod for a finished job)."""
    spec_json = make_spec(tiny_models["student"], tmp_path / "ckpt").model_dump_json(by_alias=True)
    for attempt in range(2):  # every other two-rank test exits through the same path too
        work = tmp_path / f"run{attempt}"
        work.mkdir()
        out = run_ranks(2, spec_json, work, "exit")  # asserts exit code 0 on each rank
        assert out["stats"].samples == len(make_batch())


def _one_rank_step(spec: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """make_batch()'s step on one rank in this process: its stats and the weights after it."""
    reference = Trainer(spec)
    try:
        stats = reference.step(make_parts())
        return stats, {n: t.clone() for n, t in reference.named_full_weights()}
    finally:
        reference.close()
