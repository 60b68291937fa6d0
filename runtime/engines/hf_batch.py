"""A left-padded batch KV cache for continuous batching on a plain transformers model.

Why this mechanism (and not the alternatives):
* transformers' own continuous-batching manager (paged attention) takes one generation config for
  the whole batch and hides the step loop, so per-request temperature/top-p/seed, per-token
  log-probs and weight versions, an abort between two tokens and a 'keep' pause that freezes the
  KV cache across a weight load would all have to be bolted on from outside.
* Recomputing the whole padded batch every step (no cache) is simplest but costs O(length) more
  compute per token, which already dominates at SmolLM2-135M with a few hundred tokens.
* A padded KV cache keeps one forward per decode step with one new token per row, and needs only
  three operations the HF models already support: a left-padded prefill (attention_mask +
  explicit position_ids per row, `logits_to_keep=1`), a decode step (mask column + position per
  row), and row surgery on the cache tensors between steps (drop rows that finished, left-pad
  and concatenate rows that joined). Left padding keeps every row's newest token in the last
  column, so a decode step feeds one token per row and reads the last logits; padded key/value
  columns are masked out, and each row's position ids count only its real tokens, so a row's
  logits equal the unbatched model's (up to float summation order).

The cache is a `DynamicCache` of full-attention `DynamicLayer`s (also for sliding-window models:
the mask enforces the window, the cache just keeps more). All tensors live on the model's device.

Vision-language models (Qwen-VL style, M-RoPE) batch the same way: the cache does not care
where a key came from, so image requests and text requests share the batch, and only positions
and the prefill's inputs differ. A prefill of such a model passes position ids [4, rows, width]
(the text positions that build the mask, then each row's three M-RoPE axes: `RowVision.positions`
for a row with images, the text positions for one without) and the joiners' `pixel_values` and
`image_grid_thw` in row order, which is the order the model scatters image features into the pad
tokens; each row's rope delta (its next M-RoPE position minus its length: 0 without images) is
kept in `delta`, so a decode step feeds every row `length + delta` on the three axes, as
transformers' own generate does after an image prompt. Without a vision-language model `delta`
is None and the forwards are exactly the causal LM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel
    from transformers.cache_utils import DynamicLayer

PAD_ID = 0  # any valid id: padded positions are masked out, their embeddings never reach a real row


@dataclass(frozen=True)
class RowVision:
    """A context's images, as a vision-language model's forward takes them."""

    positions: torch.Tensor
    """[3, len(context)] its M-RoPE positions (trainer.microbatch.mrope_positions)."""
    pixel_values: torch.Tensor
    """[patches, patch_dim] its images' pixel rows, images in order (the image processor's)."""
    grid_thw: torch.Tensor
    """[images, 3] each image's patch grid."""

    @property
    def delta(self) -> int:
        """The next M-RoPE position minus the context's length (transformers' rope delta)."""
        return int(self.positions.max()) + 1 - int(self.positions.shape[1])


@dataclass
class PaddedKVBatch:
    cache: DynamicCache  # [rows, heads, columns, head_dim] per layer
    mask: torch.Tensor  # [rows, columns] long, 1 = real token in the cache
    last: torch.Tensor  # [rows] long: each row's newest token, not yet in the cache
    delta: torch.Tensor | None = None
    """[rows] long, a vision-language model's rope delta per row (0 for a text row); None for a
    causal LM."""

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens in the cache per row (= the position id of the next token)."""
        return self.mask.sum(1)

    # --- forwards (call under torch.no_grad) ----------------------------------------------------
    @classmethod
    def prefill(
        cls,
        model: PreTrainedModel,
        contexts: Sequence[Sequence[int]],
        vision: Sequence[RowVision | None] | None = None,
    ) -> tuple[PaddedKVBatch, torch.Tensor]:
        """Run the contexts (prompt + prefix each) left-padded in one forward. Returns the batch
        holding every context token in its cache, and the logits [rows, vocab] that predict each
        row's next token. `last` is left for the caller to set to the sampled tokens. `vision`:
        for a vision-language model, each row's images (None for a text row); see the module
        docstring."""
        from transformers import DynamicCache

        device = model.device
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, width - len(c) :] = torch.tensor(list(c), dtype=torch.long)
            mask[i, width - len(c) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        delta = None
        images: dict[str, torch.Tensor] = {}
        if vision is not None:
            positions, delta, images = _vision_inputs(positions, mask, vision, model)
        cache = DynamicCache()
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **images,
        )
        batch = cls(
            cache=out.past_key_values,
            mask=mask,
            last=torch.zeros(len(contexts), dtype=torch.long, device=device),
            delta=delta,
        )
        return batch, out.logits[:, -1]

    def step(self, model: PreTrainedModel) -> torch.Tensor:
        """Feed every row's `last` token; returns the logits [rows, vocab] for the next token."""
        positions = self.lengths[:, None]
        if self.delta is not None:  # text positions (the mask), then M-RoPE's three axes
            positions = torch.cat([positions[None], (positions + self.delta[:, None])[None].expand(3, -1, -1)])
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        out = model(
            input_ids=self.last[:, None],
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        return out.logits[:, -1]

    # --- row surgery ----------------------------------------------------------------------------
    def layers(self) -> list[DynamicLayer]:
        return list(self.cache.layers)

    def select(self, keep: Sequence[int]) -> PaddedKVBatch | None:
        """Keep these rows (in this order); None when no row is left. Columns that became padding
        for every remaining row are cut off the left."""
        if not keep:
            return None
        idx = torch.tensor(list(keep), dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        real_cols = mask.any(0).nonzero()
        start = int(real_cols[0]) if real_cols.numel() else mask.shape[1]
        for layer in self.layers():
            layer.keys = layer.keys.index_select(0, idx)[:, :, start:]
            layer.values = layer.values.index_select(0, idx)[:, :, start:]
        self.mask = mask[:, start:]
        self.last = self.last.index_select(0, idx)
        if self.delta is not None:
            self.delta = self.delta.index_select(0, idx)
        return self

    def extend(self, other: PaddedKVBatch) -> PaddedKVBatch:
        """Append `other`'s rows after this batch's; the narrower one is left-padded first."""
        if (self.delta is None) != (other.delta is None):
            raise ValueError("a vision-language model's batch and a causal LM's cannot be joined")
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.layers(), other.layers()):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)], 0)
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)], 0)
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(other.mask, width)], 0)
        self.last = torch.cat([self.last, other.last])
        if self.delta is not None and other.delta is not None:
            self.delta = torch.cat([self.delta, other.delta])
        return self


def _vision_inputs(
    text_positions: torch.Tensor, mask: torch.Tensor, vision: Sequence[RowVision | None], model: PreTrainedModel
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A left-padded vision-language prefill's position ids [4, rows, width], rope deltas [rows]
    and image inputs (none when no row has images)."""
    rows, width = mask.shape
    positions = text_positions[None].repeat(4, 1, 1)
    delta = torch.zeros(rows, dtype=torch.long)
    for i, v in enumerate(vision):
        if v is not None:
            n = v.positions.shape[1]
            positions[1:, i, width - n :] = v.positions.to(positions.device)
            delta[i] = v.delta
    return positions, delta.to(mask.device), _images(vision, model)


def _images(vision: Sequence[RowVision | None], model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The rows' pixel_values and image_grid_thw, rows in order (none without images)."""
    with_images = [v for v in vision if v is not None]
    if not with_images:
        return {}
    return {
        "pixel_values": torch.cat([v.pixel_values for v in with_images]).to(model.device, model.dtype),
        "image_grid_thw": torch.cat([v.grid_thw for v in with_images]).to(model.device),
    }


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the column dimension (dim 2 of a [rows, heads, columns, dim] cache tensor, dim 1
    of a [rows, columns] mask) on the left up to `width`."""
    dim = 2 if t.dim() == 4 else 1
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim)


def score_batch(
    model: PreTrainedModel, sequences: Sequence[Sequence[int]], vision: Sequence[RowVision | None] | None = None
) -> list[torch.Tensor]:
    """Log-softmax [len(seq), vocab] of every position of each sequence, from one right-padded
    forward. No attention mask is needed: with causal attention a real position only ever sees
    the real positions before it, so the padding at the end cannot change it. `vision`: for a
    vision-language model, each sequence's images (None for a text one): position ids
    [4, rows, width] then, text positions first, each row's M-RoPE positions continued through
    its padding."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), PAD_ID, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    extra: dict[str, torch.Tensor] = {}
    if vision is not None and any(v is not None for v in vision):
        positions = torch.arange(width).repeat(4, len(sequences), 1)
        for i, v in enumerate(vision):
            if v is not None:
                n = v.positions.shape[1]
                positions[1:, i, :n] = v.positions
                positions[1:, i, n:] = v.positions[:, -1:] + 1 + torch.arange(width - n)
        extra = {"position_ids": positions.to(model.device), **_images(vision, model)}
    logits = model(input_ids=ids.to(model.device), use_cache=False, **extra).logits
    return [torch.log_softmax(logits[i, : len(s)].float(), -1) for i, s in enumerate(sequences)]
