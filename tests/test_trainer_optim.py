"""spec.trainer.optim's AdamW settings reach the trainer's optimiser, and gradClip bounds the
gradient the optimiser sees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubedistill.runtime.trainer import Trainer
from kubedistill.runtime.trainer.trainer import fused_adamw
from trainer_cases import make_batch, make_spec

torch.set_num_threads(1)


def test_adamw_takes_weight_decay_betas_and_eps(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    optim = {"lr": 2e-3, "weightDecay": 0.05, "betas": [0.8, 0.95], "eps": 1e-6}
    t = Trainer(make_spec(tiny_models["student"], tmp_path / "c", **{"trainer.optim": optim}))
    try:
        group = t.optimizer.param_groups[0]
        assert (group["weight_decay"], group["betas"], group["eps"]) == (0.05, (0.8, 0.95), 1e-6)
        assert group["initial_lr"] == 2e-3
        assert group["fused"] is True  # one kernel for every tensor on CPU (fused_adamw)
    finally:
        t.close()


def test_adamw_is_fused_on_cpu_and_cuda_only() -> None:
    assert fused_adamw("cpu") is True and fused_adamw("cuda") is True
    assert fused_adamw("mps") is None  # torch's own default elsewhere


def test_grad_clip_bounds_the_gradient_adamw_receives(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """AdamW's first moment after one update is (1 - beta1) x the gradient it received: its norm
    is (1 - beta1) x min(grad norm, gradClip)."""

    def first_moment(clip: float) -> tuple[float, float]:
        spec = make_spec(
            tiny_models["student"],
            tmp_path / str(clip),
            **{"trainer.optim": {"lr": 1e-3, "gradClip": clip}, "algorithm.offPolicy.importance.mode": "none"},
        )
        t = Trainer(spec)
        try:
            stats = t.step(make_batch().to_parts())
            moments = [t.optimizer.state[p]["exp_avg"] for p in t.trainable]
            return float(torch.linalg.vector_norm(torch.stack([m.norm() for m in moments]))), stats.grad_norm
        finally:
            t.close()

    loose, norm = first_moment(1000.0)
    assert norm > 0.01
    assert loose == pytest.approx(0.1 * norm, rel=1e-4)
    tight, _ = first_moment(0.01)
    assert tight == pytest.approx(0.1 * 0.01, rel=1e-4)
