"""Two gloo CPU ranks (FSDP2) against one rank on the same global batch, and the rank-0-leads
protocol: rank 0 broadcasts the batch and every command (step, weights, save, resume); the
follower joins each collective from Trainer.follow()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubedistill.runtime.trainer import Trainer
from trainer_cases import make_batch, make_spec, run_ranks

torch.set_num_threads(1)


def test_two_ranks_match_one_rank_and_resume_replays_a_step(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    spec = make_spec(
        tiny_models["student"],
        tmp_path / "ckpt",
        **{
            "algorithm.distillation.useTaskRewards": True,
            "rollout.sampling.samplesPerPrompt": 2,
            "trainer.miniBatchSize": 4,
        },
    )
    two = run_ranks(2, spec.model_dump_json(by_alias=True), tmp_path, "step_resume")

    # The same global batch on one rank (in this process).
    reference = Trainer(
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
    try:
        s1 = reference.step(make_batch())
        one = {n: t.clone() for n, t in reference.named_full_weights()}
    finally:
        reference.close()
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
        stats = reference.train([make_batch(), make_batch(seed=1)])
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
