"""A train step's batch: its fields, and the forms it travels in.

Per sample i:

* ``token_ids[i]``: prompt + response token ids; ``prompt_lens[i]``: how many are prompt.
  The response is ``token_ids[i][prompt_lens[i]:]`` (R_i = len - prompt_len >= 1 tokens).
* ``rollout_logprobs[i]``: the rollout engine's log-prob of each response token (behaviour
  policy mu, length R_i).
* ``signals[name][i]``: what the loss reads of sample i, keyed by the loss contract's signal
  names (kubedistill.api.losses.Signal): one entry per response token (length R_i), a float
  (``teacher_logprobs``) or a row of top-k ids or log-probs (``teacher_topk_ids`` /
  ``teacher_topk_logprobs`` of forwardKLTopK, ``rollout_topk_ids`` /
  ``teacher_logprobs_at_rollout_topk`` of reverseKLTopK). Rows may be shorter than
  spec.algorithm.distillation.topK (a small vocabulary); missing slots are padded internally and
  masked.
* ``rewards[i]`` and ``group_ids[i]``: the task reward and the prompt group (samples of one
  prompt share a group id); needed by GRPO (useTaskRewards).
* ``weight_versions[i]``: the oldest weight version that produced any of the sample's tokens
  (for staleness metrics; the loss corrects staleness through ``rollout_logprobs``).
* ``trainer_version``: the trainer's weight version when the step was assembled, so the trainer
  can report its log-probs against the rollout's per version lag (0: the same weights).
* ``loss_masks[i]``: which response tokens carry loss (length R_i; None, the default: all). A
  multi-turn trace's observation tokens, which the student did not sample, do not.
* ``images[i]``: a vision-language student's image inputs of sample i (:class:`SampleImages`:
  the student's image processor's ``pixel_values`` and ``image_grid_thw``), None for a text
  sample; the whole list None (the default) when no sample has images. The prompt ids of an image
  sample are the processor-expanded ids (one image pad token per merged patch).

``TrainBatch`` is the list form: easy to write by hand (tests, the trainer's start-up probes),
checked field by field (``validate``), turned into parts by ``to_parts``. What the driver hands
``Trainer.step``/``train`` (the only form they take) is :class:`BatchParts`: each sample's
arrays (:class:`SampleArrays`, made once by :func:`pack_sample` as the sample entered the buffer)
with the per-sample lists. Rank 0 lays them out in the order of the step's plan (each micro-batch
one contiguous range) as :class:`TensorBatch`: a few flat tensors (ids int64, log-probs float32,
top-k rows [N, K], their ids int32, with per-row widths when some are short) plus per-sample lengths. A small
pickled header announces the shapes; the tensors follow as a few ``torch.distributed.broadcast``
calls of their bytes (:class:`BatchBuffers` keeps the memory from step to step), and every rank
slices its micro-batches from them without a Python loop over tokens (see
:mod:`kubedistill.runtime.trainer`). No float travels as a pickled Python object.

Images travel the same way: the pixel rows of every image sample end to end (float32
[patches, D]) and their grids (int64 [images, 3]) are two more flat tensors, with the number of
images per sample in the header; a batch without images has neither (a text job pays nothing).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kubedistill.api.losses import SIGNAL_NAMES, TOKEN_SIGNALS, LossContract, Signal


@dataclass
class TrainBatch:
    token_ids: list[list[int]]
    prompt_lens: list[int]
    rollout_logprobs: list[list[float]]
    signals: dict[str, list[list[Any]]] = field(default_factory=dict)
    rewards: list[float] | None = None
    group_ids: list[int] | None = None
    weight_versions: list[int] = field(default_factory=list)
    trainer_version: int | None = None
    images: list[SampleImages | None] | None = None
    loss_masks: list[list[bool]] | None = None

    def lag(self, i: int) -> int | None:
        """How many weight versions sample i's oldest token lags the trainer (None: unknown)."""
        if self.trainer_version is None or not self.weight_versions:
            return None
        return self.trainer_version - self.weight_versions[i]

    def signal(self, name: Signal) -> list[list[Any]] | None:
        return self.signals.get(name.value)

    def __len__(self) -> int:
        return len(self.token_ids)

    def response_len(self, i: int) -> int:
        return len(self.token_ids[i]) - self.prompt_lens[i]

    def to_parts(self) -> BatchParts:
        """This batch as the driver hands it to the trainer (the values as float32 / int64 / int32);
        ValueError when a per-sample list is not one entry per sample (`check_lists`)."""
        self.check_lists()
        parts = [
            pack_sample(
                self.token_ids[i],
                self.prompt_lens[i],
                self.rollout_logprobs[i],
                {name: values[i] for name, values in self.signals.items()},
                images=self.images[i] if self.images is not None else None,
                loss_mask=self.loss_masks[i] if self.loss_masks is not None else None,
            )
            for i in range(len(self))
        ]
        return BatchParts(parts, self.rewards, self.group_ids, self.weight_versions, self.trainer_version)

    def to_tensors(self) -> TensorBatch:
        """This batch as flat tensors, samples in their order."""
        return self.to_parts().to_tensors()

    def validate(self, contract: LossContract | None = None, *, rewards: bool = False) -> None:
        """Raise ValueError naming the first inconsistent field (one line, no traceback noise),
        or the first signal `contract` needs that the batch lacks (and rewards, when `rewards`).
        The lists are checked as far as packing them needs (`check_lists`), the rest as arrays
        (BatchParts.validate), so both forms answer alike."""
        self.to_parts().validate(contract, rewards=rewards)

    def check_lists(self) -> None:
        """Refuse a per-sample list that is not one entry per sample: `to_parts` indexes them."""
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("TrainBatch.token_ids: the batch has no samples")
        per_sample: dict[str, Sized | None] = {
            "prompt_lens": self.prompt_lens,
            "rollout_logprobs": self.rollout_logprobs,
            **{f"signals[{name!r}]": values for name, values in self.signals.items()},
            "rewards": self.rewards,
            "group_ids": self.group_ids,
            "images": self.images,
            "loss_masks": self.loss_masks,
        }
        if self.weight_versions:
            per_sample["weight_versions"] = self.weight_versions
        for name, values in per_sample.items():
            if values is not None and len(values) != n:
                raise ValueError(f"TrainBatch.{name}: has {len(values)} entries, expected one per sample ({n})")


ID_SIGNALS: frozenset[str] = frozenset({Signal.teacher_topk_ids.value, Signal.rollout_topk_ids.value})
"""Top-k rows of token ids, int32 as the teacher sends them (half the bytes of int64 to hold and
broadcast; each micro-batch widens its slice for torch.gather); the other row signals are log-probs."""


@dataclass(frozen=True, eq=False)
class SampleImages:
    """A sample's images as a vision-language student's forward takes them: what its image
    processor made of them (runtime/driver/pixels.py), shared by the samples of one prompt
    (compared by identity: arrays have no single truth value)."""

    pixel_values: np.ndarray  # float32 [patches, D]: every image's patches, image after image
    grid_thw: np.ndarray  # int64 [images, 3]: each image's (t, h, w) grid of patches

    @property
    def count(self) -> int:
        return len(self.grid_thw)

    @property
    def patches(self) -> int:
        return len(self.pixel_values)

    def check(self, where: str) -> None:
        """Refuse arrays the forward would misread, in one line naming `where`."""
        pv, grid = self.pixel_values, self.grid_thw
        if pv.dtype != np.float32 or pv.ndim != 2 or grid.dtype != np.int64 or grid.ndim != 2 or grid.shape[1] != 3:
            raise ValueError(
                f"{where}: needs pixel_values float32 [patches, D] and grid_thw int64 [images, 3], got "
                f"{pv.dtype} {list(pv.shape)} and {grid.dtype} {list(grid.shape)}"
            )
        if self.count == 0 or int(grid.prod(axis=1).sum()) != self.patches:
            raise ValueError(
                f"{where}: {self.count} image grid(s) {grid.tolist()} cover {int(grid.prod(axis=1).sum())} "
                f"patches, pixel_values has {self.patches}"
            )


@dataclass
class SampleArrays:
    """One sample's token data as arrays, made once from its lists (pack_sample)."""

    token_ids: np.ndarray  # int64 [L] prompt + response
    prompt_len: int
    rollout_logprobs: np.ndarray  # float32 [R]
    signals: dict[str, np.ndarray]  # float32 [R], or [R, K] rows (int32 ids / float32 log-probs)
    widths: dict[str, np.ndarray]  # row signals with rows shorter than K: int64 [R] entries per row
    weight_version: int | None = None  # the oldest weight version of its tokens, if known
    images: SampleImages | None = None  # a vision-language sample's image inputs
    loss_mask: np.ndarray | None = None  # bool [R]: tokens the student sampled (None: all of them)

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len


def pack_sample(
    token_ids: Sequence[int],
    prompt_len: int,
    rollout_logprobs: Sequence[float],
    signals: Mapping[str, Sequence[Any] | np.ndarray],
    response_ids: Sequence[int] | None = None,
    weight_version: int | None = None,
    images: SampleImages | None = None,
    loss_mask: Sequence[bool] | None = None,
) -> SampleArrays:
    """Arrays of one sample's lists (`response_ids`, when given, follows `token_ids` as the
    response). Rows of a row signal shorter than the widest are zero-padded and their widths kept.
    `images` (already arrays) are kept as they are. `loss_mask` (one per response token) marks the
    tokens that carry loss: a multi-turn trace's observations do not (docs/design.md)."""
    ids = np.fromiter(token_ids, np.int64, len(token_ids))
    if response_ids is not None:
        ids = np.concatenate([ids, np.fromiter(response_ids, np.int64, len(response_ids))])
    arrays: dict[str, np.ndarray] = {}
    widths: dict[str, np.ndarray] = {}
    for name, values in signals.items():
        dtype = np.int32 if name in ID_SIGNALS else np.float32
        if name in {s.value for s in TOKEN_SIGNALS}:
            arrays[name] = np.fromiter(values, dtype, len(values))
            continue
        if isinstance(values, np.ndarray) and values.ndim == 2:  # full rows as the wire brought them
            arrays[name] = values.astype(dtype, copy=False)
            continue
        w = np.fromiter(map(len, values), np.int64, len(values))
        k = int(w.max()) if len(w) else 0
        if len(w) and int(w.min()) == k:
            arrays[name] = np.array(values, dtype=dtype).reshape(len(values), k)
        else:
            rows: np.ndarray = np.zeros((len(values), k), dtype=dtype)
            for t, row in enumerate(values):
                rows[t, : len(row)] = row
            arrays[name], widths[name] = rows, w
    mu = np.fromiter(rollout_logprobs, np.float32, len(rollout_logprobs))
    mask = None if loss_mask is None or all(loss_mask) else np.fromiter(loss_mask, np.bool_, len(loss_mask))
    return SampleArrays(ids, prompt_len, mu, arrays, widths, weight_version, images, mask)


Row = list[int]
"""Sample indices laid end to end in one row of a micro-batch (one index when not packing)."""

Plan = list[list[list[Row]]]
"""Per rank, its micro-batches, each a list of rows (see runtime/trainer/microbatch.py)."""


@dataclass
class BatchParts:
    """One step's samples as arrays, not yet laid end to end: what the driver hands the trainer
    (batcher.to_train_batch). Rank 0 lays them out in the order of the step's plan, so that every
    micro-batch is one contiguous range of the flat tensors (`header`, `tensors`)."""

    parts: list[SampleArrays]
    rewards: list[float] | None = None
    group_ids: list[int] | None = None
    weight_versions: list[int] = field(default_factory=list)
    trainer_version: int | None = None

    def __len__(self) -> int:
        return len(self.parts)

    @property
    def lengths(self) -> list[int]:
        return [len(p.token_ids) for p in self.parts]

    def header(self, order: Sequence[int] | None = None, plan: Plan | None = None) -> dict[str, Any]:
        """Everything of the batch laid out in `order` but the tensors' contents: the per-sample
        lists, the plan, and each tensor's shape and dtype in the order `tensors` yields them (so
        a receiver can allocate them). Computed from the parts' shapes: nothing is copied."""
        order = list(range(len(self))) if order is None else list(order)
        parts = [self.parts[i] for i in order]
        tokens = sum(len(p.rollout_logprobs) for p in parts)
        shapes: list[tuple[tuple[int, ...], torch.dtype]] = [
            ((sum(len(p.token_ids) for p in parts),), torch.int64),
            ((tokens,), torch.float32),
        ]
        names = list(parts[0].signals) if parts else []
        widths = []
        for name in names:
            first = parts[0].signals[name]
            dtype = torch.int32 if name in ID_SIGNALS else torch.float32
            if first.ndim == 1:
                shapes.append(((tokens,), dtype))
                continue
            k = max(p.signals[name].shape[1] for p in parts)
            shapes.append(((tokens, k), dtype))
            if any(name in p.widths or p.signals[name].shape[1] != k for p in parts):
                widths.append(name)
        shapes += [((tokens,), torch.int64)] * len(widths)
        images = image_counts(parts)
        if images is not None:
            shown = [p.images for p in parts if p.images is not None]
            patch_dim = shown[0].pixel_values.shape[1]
            shapes.append(((sum(x.patches for x in shown), patch_dim), torch.float32))
            shapes.append(((sum(images), 3), torch.int64))
        masked = any(p.loss_mask is not None for p in parts)
        if masked:  # a batch of single-turn samples carries no mask
            shapes.append(((tokens,), torch.bool))
        return {
            "prompt_lens": [p.prompt_len for p in parts],
            "lengths": [len(p.token_ids) for p in parts],
            "rewards": None if self.rewards is None else [self.rewards[i] for i in order],
            "group_ids": None if self.group_ids is None else [self.group_ids[i] for i in order],
            "weight_versions": [self.weight_versions[i] for i in order] if self.weight_versions else [],
            "trainer_version": self.trainer_version,
            "signals": names,
            "widths": widths,
            "images": images,
            "loss_mask": masked,
            "plan": plan,
            "tensors": shapes,
        }

    def layout(
        self,
        header: Mapping[str, Any],
        order: Sequence[int] | None = None,
        into: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Iterator[torch.Tensor]]:
        """The flat tensors `header` describes, samples in `order` (written `into` the given
        tensors, e.g. BatchBuffers', else new ones), filled as the iterator is drained: it yields
        each tensor as soon as it is filled, so rank 0 can broadcast it while copying the next."""
        order = list(range(len(self))) if order is None else list(order)
        parts = [self.parts[i] for i in order]
        names, widths = header["signals"], header["widths"]
        sources: list[list[np.ndarray]] = [[p.token_ids for p in parts], [p.rollout_logprobs for p in parts]]
        sources += [[p.signals[name] for p in parts] for name in names]
        sources += [
            [p.widths.get(name, np.full(p.response_len, p.signals[name].shape[1])) for p in parts] for name in widths
        ]
        if header.get("images") is not None:
            shown = [p.images for p in parts if p.images is not None]
            sources += [[x.pixel_values for x in shown], [x.grid_thw for x in shown]]
        if header.get("loss_mask"):
            ones: np.ndarray = np.ones(max(p.response_len for p in parts), np.bool_)
            sources.append([p.loss_mask if p.loss_mask is not None else ones[: p.response_len] for p in parts])
        full = list(into) if into is not None else TensorBatch.empty_tensors(header)
        for j, name in enumerate(names):
            if name in widths:
                full[2 + j].zero_()  # the padding of short rows
        return full, (_fill(out, arrays) for out, arrays in zip(full, sources))

    def to_tensors(self, order: Sequence[int] | None = None, plan: Plan | None = None) -> TensorBatch:
        header = self.header(order, plan)
        full, pieces = self.layout(header, order)
        for _ in pieces:
            pass
        return TensorBatch.from_wire(header, full)

    def validate(self, contract: LossContract | None = None, *, rewards: bool = False) -> None:
        """Raise ValueError naming the first inconsistent field, or the first signal `contract`
        needs that the batch lacks. Per sample, not per token: the per-token checks ran once, as
        each sample's arrays were made (batcher.sample_arrays)."""
        n = len(self.parts)
        if n == 0:
            raise ValueError("TrainBatch: the batch has no samples")
        if contract is not None:
            for needed in contract.signals:
                if any(needed.value not in p.signals for p in self.parts):
                    raise ValueError(
                        f"TrainBatch.signals[{needed.value!r}]: lossMode {contract.mode.value} needs "
                        f"{SIGNAL_NAMES[needed]}"
                    )
        if rewards and (self.rewards is None or self.group_ids is None):
            raise ValueError(
                "TrainBatch.rewards/group_ids: required when algorithm.distillation.useTaskRewards is true"
            )
        if (self.rewards is None) != (self.group_ids is None):
            raise ValueError("TrainBatch.rewards and group_ids must be given together")
        per_sample = {"rewards": self.rewards, "group_ids": self.group_ids, "weight_versions": self.weight_versions}
        for name, values in per_sample.items():
            if values and len(values) != n:
                raise ValueError(f"TrainBatch.{name}: has {len(values)} entries, expected one per sample ({n})")
        pair = contract.top_k if contract is not None else None
        dims = set()
        for i, p in enumerate(self.parts):
            if p.images is not None:
                p.images.check(f"TrainBatch.images[{i}]")
                dims.add(p.images.pixel_values.shape[1])
        if len(dims) > 1:
            raise ValueError(
                f"TrainBatch.images: pixel rows of {sorted(dims)} values in one batch (one processor makes one width)"
            )
        names = list(self.parts[0].signals)
        unknown = set(names) - {s.value for s in Signal}
        if unknown:
            raise ValueError(f"TrainBatch.signals: unknown signals {sorted(unknown)}")
        for i, p in enumerate(self.parts):
            if not 1 <= p.prompt_len < len(p.token_ids):
                raise ValueError(
                    f"TrainBatch.prompt_lens[{i}]: {p.prompt_len} must be >= 1 and < the sample's "
                    f"{len(p.token_ids)} tokens"
                )
            if list(p.signals) != names:
                raise ValueError(f"TrainBatch.signals: sample {i} has {sorted(p.signals)}, sample 0 {sorted(names)}")
            r = len(p.token_ids) - p.prompt_len
            masks = {"loss_masks": p.loss_mask} if p.loss_mask is not None else {}
            for name, a in {"rollout_logprobs": p.rollout_logprobs, **p.signals, **masks}.items():
                if len(a) != r:
                    raise ValueError(f"TrainBatch.{name}[{i}]: has {len(a)} entries, expected {r} response tokens")
            if pair is not None:
                ids, lps = p.signals[pair.ids.value], p.signals[pair.logprobs.value]
                wi, wl = p.widths.get(pair.ids.value), p.widths.get(pair.logprobs.value)
                if (
                    ids.shape != lps.shape
                    or (wi is None) != (wl is None)
                    or (wi is not None and wl is not None and not np.array_equal(wi, wl))
                    or ids.shape[-1] == 0
                    or (wi is not None and int(wi.min()) < 1)
                ):
                    raise ValueError(
                        f"TrainBatch.signals[{pair.ids.value!r}][{i}]: needs >= 1 id and as many log-probs in every row"
                    )


def image_counts(parts: Sequence[SampleArrays]) -> list[int] | None:
    """Images per sample, or None when no sample has any (the batch then carries no image tensors)."""
    if all(p.images is None for p in parts):
        return None
    return [p.images.count if p.images is not None else 0 for p in parts]


SPAN_BYTES = 8 << 20
"""A broadcast carries consecutive tensors of a batch, cut once it holds at least this many bytes:
rank 0 copies the next span while gloo sends this one, and gloo's fixed cost per call stays
small (docs/design.md, "Batch transfer")."""


@dataclass
class Carved:
    """A batch's tensors carved one after the other from one byte arena, so consecutive tensors
    travel as one broadcast of their bytes."""

    tensors: list[torch.Tensor]
    arena: torch.Tensor  # uint8
    bounds: list[tuple[int, int]]  # each tensor's byte range in the arena

    def spans(self) -> list[tuple[int, int]]:
        """Tensor index ranges [lo, hi) sent as one broadcast each (sender and receivers cut alike)."""
        out, lo = [], 0
        for i, (_, b) in enumerate(self.bounds):
            if b - self.bounds[lo][0] >= SPAN_BYTES or i == len(self.bounds) - 1:
                out.append((lo, i + 1))
                lo = i + 1
        return out

    def span_bytes(self, lo: int, hi: int) -> torch.Tensor:
        return self.arena[self.bounds[lo][0] : self.bounds[hi - 1][1]]

    def received(self) -> Iterator[torch.Tensor]:
        """A receiver's side: the byte spans to broadcast into."""
        return (self.span_bytes(lo, hi) for lo, hi in self.spans())

    def sent(self, filled: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Rank 0's side: each byte span as soon as `filled` (BatchParts.layout) has filled its
        tensors."""
        for lo, hi in self.spans():
            for _ in range(hi - lo):
                next(filled)
            yield self.span_bytes(lo, hi)


class BatchBuffers:
    """Memory for the flat tensors of batches, kept from step to step, one arena per `slot` (a
    batch in use at the same time as others needs a slot of its own). Fresh memory for every step
    costs page faults on first touch, on this machine about as long as broadcasting the bytes."""

    HEADROOM = 1.25
    """An arena grows to this much more than the batch that outgrew it (lengths vary by step)."""

    def __init__(self) -> None:
        self._arenas: dict[object, torch.Tensor] = {}

    def take(self, header: Mapping[str, Any], slot: object = "step") -> Carved:
        """Uninitialised tensors of the header's shapes and dtypes, carved from `slot`'s arena:
        valid until the next call for the same slot."""
        specs = header["tensors"]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + -(-n // 64) * 64)  # aligned for any dtype's view
        arena = self._arenas.get(slot)
        if arena is None or arena.numel() < starts[-1]:
            arena = self._arenas[slot] = torch.empty(int(starts[-1] * self.HEADROOM), dtype=torch.uint8)
        bounds = [(a, a + n) for a, n in zip(starts, sizes)]
        tensors = [arena[a:b].view(dtype).view(shape) for (a, b), (shape, dtype) in zip(bounds, specs)]
        return Carved(tensors, arena, bounds)


def _fill(out: torch.Tensor, arrays: Sequence[np.ndarray]) -> torch.Tensor:
    """Copy `arrays` end to end into `out` (rows narrower than out's zero-padded)."""
    dst = out.numpy()
    at = 0
    for a in arrays:
        if a.ndim == 2 and a.shape[1] != dst.shape[1]:
            dst[at : at + len(a), : a.shape[1]] = a
        else:
            dst[at : at + len(a)] = a
        at += len(a)
    return out


@dataclass
class TensorBatch:
    """A batch laid out as flat tensors: what every rank holds after the broadcast and slices its
    micro-batches from. Samples lie end to end; `lengths`/`prompt_lens` (small Python lists) give
    the offsets.

    * ``token_ids``: int64 [T], T = sum(lengths), each sample's prompt + response ids;
    * ``rollout_logprobs``: float32 [N], N = sum of response lengths, response tokens end to end;
    * ``signals[name]``: float32 [N] (``teacher_logprobs``) or [N, K] top-k rows (ids int32,
      log-probs float32), rows shorter than K zero-padded with their entry counts in
      ``widths[name]`` (int64 [N]; absent when every row has K entries);
    * ``rewards``, ``group_ids``, ``weight_versions``, ``trainer_version``: as in TrainBatch;
    * ``plan``: per rank, its micro-batches' rows, when rank 0 laid the samples out in that order
      (each micro-batch then a contiguous range); None: the trainer plans the split itself;
    * ``pixel_values`` float32 [P, D] and ``image_grid_thw`` int64 [I, 3]: the image samples'
      processor outputs end to end, ``image_counts[i]`` images for sample i; all three None
      when no sample has images.
    """

    token_ids: torch.Tensor
    prompt_lens: list[int]
    lengths: list[int]
    rollout_logprobs: torch.Tensor
    signals: dict[str, torch.Tensor] = field(default_factory=dict)
    widths: dict[str, torch.Tensor] = field(default_factory=dict)
    rewards: list[float] | None = None
    group_ids: list[int] | None = None
    weight_versions: list[int] = field(default_factory=list)
    trainer_version: int | None = None
    plan: Plan | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_counts: list[int] | None = None
    loss_mask: torch.Tensor | None = None
    """bool [N]: the response tokens that carry loss (None: all); a multi-turn trace's
    observation tokens do not."""

    def __len__(self) -> int:
        return len(self.lengths)

    def patch_counts(self) -> list[int]:
        """Pixel rows per sample (0 for a text sample)."""
        if self.image_counts is None or self.image_grid_thw is None:
            return [0] * len(self)
        per_image = self.image_grid_thw.prod(dim=1)
        return [int(s.sum()) for s in torch.split(per_image, self.image_counts)]

    @property
    def response_lens(self) -> list[int]:
        return [n - p for n, p in zip(self.lengths, self.prompt_lens)]

    def response_len(self, i: int) -> int:
        return self.lengths[i] - self.prompt_lens[i]

    def lag(self, i: int) -> int | None:
        """How many weight versions sample i's oldest token lags the trainer (None: unknown)."""
        if self.trainer_version is None or not self.weight_versions:
            return None
        return self.trainer_version - self.weight_versions[i]

    def signal(self, name: Signal) -> torch.Tensor | None:
        return self.signals.get(name.value)

    def tensors(self) -> list[torch.Tensor]:
        """In the order of the header's shapes (BatchParts.header)."""
        images = [self.pixel_values, self.image_grid_thw] if self.pixel_values is not None else []
        mask = [self.loss_mask] if self.loss_mask is not None else []
        return [self.token_ids, self.rollout_logprobs, *self.signals.values(), *self.widths.values(), *images, *mask]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @staticmethod
    def empty_tensors(header: Mapping[str, Any]) -> list[torch.Tensor]:
        """Uninitialised tensors for a receiver to broadcast into."""
        return [torch.empty(shape, dtype=dtype) for shape, dtype in header["tensors"]]

    @classmethod
    def from_wire(cls, header: Mapping[str, Any], tensors: Sequence[torch.Tensor]) -> TensorBatch:
        names, widths = header["signals"], header["widths"]
        images = header.get("images")
        at = 2 + len(names) + len(widths)
        return cls(
            token_ids=tensors[0],
            prompt_lens=list(header["prompt_lens"]),
            lengths=list(header["lengths"]),
            rollout_logprobs=tensors[1],
            signals=dict(zip(names, tensors[2 : 2 + len(names)])),
            widths=dict(zip(widths, tensors[2 + len(names) : at])),
            rewards=header["rewards"],
            group_ids=header["group_ids"],
            weight_versions=list(header["weight_versions"]),
            trainer_version=header["trainer_version"],
            plan=header["plan"],
            pixel_values=tensors[at] if images is not None else None,
            image_grid_thw=tensors[at + 1] if images is not None else None,
            image_counts=list(images) if images is not None else None,
            loss_mask=tensors[-1] if header.get("loss_mask") else None,
        )
