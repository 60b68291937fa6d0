"""The list form of a batch read back from its flat tensors, for tests that compare batches by value.

The product only goes lists -> parts -> tensors (runtime/wire/batch.py); the way back exists for
the tests' assertions alone, so it lives here.
"""

from __future__ import annotations

from typing import Any

import torch

from kubedistill.runtime.wire.batch import BatchParts, SampleImages, TensorBatch, TrainBatch


def to_lists(batch: TensorBatch | BatchParts) -> TrainBatch:
    """The inverse of TrainBatch.to_tensors up to float32 (parts are laid out first, in their order)."""
    if isinstance(batch, BatchParts):
        batch = batch.to_tensors()
    resp = batch.response_lens
    signals: dict[str, list[list[Any]]] = {}
    for name, values in batch.signals.items():
        rows = values.tolist()
        if name in batch.widths:
            rows = [row[:w] for row, w in zip(rows, batch.widths[name].tolist())]
        it = iter(rows)
        signals[name] = [[next(it) for _ in range(r)] for r in resp]
    return TrainBatch(
        token_ids=[t.tolist() for t in torch.split(batch.token_ids, batch.lengths)],
        prompt_lens=list(batch.prompt_lens),
        rollout_logprobs=[t.tolist() for t in torch.split(batch.rollout_logprobs, resp)],
        signals=signals,
        rewards=None if batch.rewards is None else list(batch.rewards),
        group_ids=None if batch.group_ids is None else list(batch.group_ids),
        weight_versions=list(batch.weight_versions),
        trainer_version=batch.trainer_version,
        images=_images(batch),
        loss_masks=None if batch.loss_mask is None else [t.tolist() for t in torch.split(batch.loss_mask, resp)],
    )


def _images(batch: TensorBatch) -> list[SampleImages | None] | None:
    if batch.image_counts is None or batch.pixel_values is None or batch.image_grid_thw is None:
        return None
    pixels = torch.split(batch.pixel_values, batch.patch_counts())
    grids = torch.split(batch.image_grid_thw, batch.image_counts)
    return [
        SampleImages(pv.numpy().copy(), g.numpy().copy()) if n else None
        for pv, g, n in zip(pixels, grids, batch.image_counts)
    ]
