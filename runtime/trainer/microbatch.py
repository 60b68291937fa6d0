"""Micro-batches: split a TensorBatch over ranks and token-bounded micro-batches (optionally
packing several samples into one row, padding-free), and slice a micro-batch's tensors from the
batch's flat ones. No torch.distributed here, so it is unit-testable.

Every rank holds the whole batch (rank 0 broadcasts it), computes the same plan and works on its
own share. Loss weights are computed over the whole batch (losses.token_weights), so the sum over
ranks and micro-batches is exactly the loss of the batch whatever the split.

Images (a vision-language student): a micro-batch carries the pixel rows and grids of exactly its
samples, in the order their image tokens appear in its rows (row after row, sample after sample),
which is the order the model scatters image features into the image pad tokens. Its position ids
are then Qwen-VL's multimodal ones (M-RoPE: text tokens advance one position on all three axes, an
image's tokens take (t, h, w) grid positions), computed per sample here (:func:`mrope_positions`,
checked against the model's own ``get_rope_index`` at start-up), as a [4, rows, L] tensor: the
text positions first, then the three M-RoPE axes. The text row restarts at 0 for each packed
sample, which is what turns the causal mask block-causal; so image samples pack like text ones
(exactness checked at start-up, model.packing_is_exact). A micro-batch without images keeps the
text layout (2-D position ids, or none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kubedistill.api.losses import TOKEN_SIGNALS, TopKSignals
from kubedistill.runtime.wire.batch import Plan, TensorBatch


def shard_samples(lengths: list[int], world: int) -> list[list[int]]:
    """Sample indices per rank, balancing tokens (longest first onto the least-loaded rank)."""
    load = [0] * world
    shards: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shards[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shards]


Row = list[int]
"""Sample indices laid end to end in one row of a micro-batch (one index when not packing)."""


@dataclass(frozen=True)
class VisionTokens:
    """What collate needs to know of a vision-language student: the id of its image pad token and
    the vision tower's spatial merge (merge x merge patches make one image token)."""

    image_token_id: int
    merge: int

    def tokens_per_image(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Image pad tokens of each image of a [images, 3] grid."""
        return grid_thw.prod(dim=-1) // (self.merge * self.merge)


def mrope_positions(ids: torch.Tensor, grid_thw: torch.Tensor, vision: VisionTokens) -> torch.Tensor:
    """Qwen-VL's multimodal rotary positions [3, n] (temporal, height, width) of one sample's ids
    [n] whose images have the grids [images, 3]: a text token advances all three axes by one; an
    image's run of pad tokens gets its merged grid's (t, h, w) coordinates offset by the position
    reached, after which the text resumes max(h, w) / merge further on (transformers'
    Qwen3VLModel.get_rope_index, images only). The loop is over images, never tokens."""
    n = len(ids)
    pads = torch.nonzero(ids == vision.image_token_id).flatten()
    counts = vision.tokens_per_image(grid_thw).tolist()
    if sum(counts) != len(pads):
        raise ValueError(
            f"a sample has {len(pads)} image pad tokens, its image grids {grid_thw.tolist()} make {sum(counts)}"
        )
    out = torch.empty((3, n), dtype=torch.long)
    pos, cursor, at = 0, 0, 0  # next position, next token, next pad token
    for j, ((t, h, w), c) in enumerate(zip(grid_thw.tolist(), counts)):
        start = int(pads[at])
        if int(pads[at + c - 1]) != start + c - 1:
            raise ValueError(f"a sample's image {j}: its {c} image pad tokens are not one run")
        out[:, cursor:start] = torch.arange(pos, pos + start - cursor)
        pos += start - cursor
        gh, gw = h // vision.merge, w // vision.merge
        out[0, start : start + c] = pos + torch.arange(t).repeat_interleave(gh * gw)
        out[1, start : start + c] = pos + torch.arange(gh).repeat_interleave(gw).repeat(t)
        out[2, start : start + c] = pos + torch.arange(gw).repeat(t * gh)
        pos += max(gh, gw)
        cursor, at = start + c, at + c
    out[:, cursor:] = torch.arange(pos, pos + n - cursor)
    return out


def pack_rows(indices: list[int], lengths: list[int], capacity: int) -> list[Row]:
    """First-fit decreasing: put each sample (longest first) into the first row with room for it,
    rows holding at most `capacity` tokens; a sample longer than `capacity` gets a row alone (so
    capacity 0 gives one row per sample, longest first)."""
    rows: list[Row] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def micro_batches(indices: list[int], lengths: list[int], max_tokens: int, pack: bool = False) -> list[list[Row]]:
    """Rows grouped so each micro-batch's padded size (rows x widest row) stays within max_tokens.

    Not packing, every sample is a row of its own, and samples are taken longest first so
    similar lengths share a micro-batch (little padding). Packing, samples are first laid end to
    end into rows no wider than the longest sample (`pack_rows`): a packed micro-batch never has
    more rows or wider rows than the padded one, so it never costs more, and with long-tailed
    lengths it drops most of the padding. A row wider than max_tokens gets a micro-batch alone.
    """
    if not indices:
        return []
    rows = pack_rows(indices, lengths, max(lengths[i] for i in indices) if pack else 0)
    sized = sorted(((sum(lengths[i] for i in row), row) for row in rows), key=lambda x: -x[0])
    out: list[list[Row]] = []
    current: list[Row] = []
    widest = 0
    for width, row in sized:
        if current and (len(current) + 1) * widest > max_tokens:
            out.append(current)
            current = []
        if not current:
            widest = width
        current.append(row)
    if current:
        out.append(current)
    return out


def plan_step(lengths: list[int], world: int, max_tokens: int, pack: bool) -> list[list[list[Row]]]:
    """Per rank, its micro-batches of a batch with these sample lengths (shard_samples, then
    micro_batches): the same on every rank."""
    return [micro_batches(s, lengths, max_tokens, pack=pack) for s in shard_samples(lengths, world)]


def plan_order(plan: list[list[list[Row]]]) -> tuple[list[int], list[list[list[Row]]]]:
    """The order to lay a batch's samples out in so that every micro-batch of `plan` is one
    contiguous range (rank after rank, micro-batch after micro-batch, row after row), and the plan
    in the indices of that order."""
    order = [i for rank in plan for mb in rank for row in mb for i in row]
    at = {i: j for j, i in enumerate(order)}
    return order, [[[[at[i] for i in row] for row in mb] for mb in rank] for rank in plan]


@dataclass
class MicroBatch:
    """Tensors of one micro-batch. N = response tokens in it, k = top-k width."""

    input_ids: torch.Tensor  # [rows, L] right-padded
    gather_index: torch.Tensor  # [N] index into the flattened [rows*L] positions predicting each response token
    targets: torch.Tensor  # [N] response token ids
    behaviour_logprobs: torch.Tensor  # [N]
    weights: torch.Tensor  # [N] loss weight of each token (0 for a filler micro-batch)
    # The batch's per-token float signals ([N] each), keyed as in TensorBatch.signals.
    signals: dict[str, torch.Tensor] = field(default_factory=dict)
    # The loss contract's top-k pair: the ids the term sums over and the teacher's log-probs at them.
    topk_ids: torch.Tensor | None = None  # [N, k]
    topk_logprobs: torch.Tensor | None = None  # [N, k]
    topk_valid: torch.Tensor | None = None  # [N, k]
    task_advantages: torch.Tensor | None = None  # [N]
    lags: torch.Tensor | None = None  # [N] versions each token's sample lags the trainer (-1: unknown)
    segments: torch.Tensor | None = None  # [N] which sample of the micro-batch each token belongs to (0, 1, ...)
    loss_mask: torch.Tensor | None = None  # bool [N] tokens that carry loss (None: all; observations do not)
    real_tokens: int = 0  # prompt + response tokens (no padding), 0 for a filler
    # [rows, L] when rows hold packed samples; [4, rows, L] (text, then M-RoPE t/h/w) with images.
    position_ids: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None  # [patches, D] of its image samples, in row order
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    touch_vision: bool = False
    """Run the vision tower on a placeholder image though this micro-batch has none, its output
    weighted 0: another rank's micro-batch at the same index has images, and FSDP's collectives of
    the sharded vision tower must run on every rank alike (Trainer._micro_batches decides)."""

    @property
    def has_images(self) -> bool:
        return self.pixel_values is not None

    def to(self, device: torch.device) -> MicroBatch:
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        kw["signals"] = {k: v.to(device) for k, v in self.signals.items()}
        return MicroBatch(**kw)


def collate(
    batch: TensorBatch,
    rows: list[Row],
    token_weights: torch.Tensor,
    sample_advantages: torch.Tensor | None,
    pad_id: int,
    filler: bool = False,
    *,
    top_k: TopKSignals | None = None,
    vision: VisionTokens | None = None,
) -> MicroBatch:
    """Tensors for the samples in `rows` of `batch` (each row's samples laid end to end, rows
    right-padded to the widest), sliced from the batch's flat tensors: the Python loop is over
    samples, never tokens. `token_weights` holds every response token's weight (flat, batch
    order); a `filler` micro-batch (a rank with less work) gets zero weights. When a row holds
    more than one sample, `position_ids` restart at 0 for each, which is how transformers
    recognises packed sequences (block-causal attention: no sample sees another). `top_k` is the
    loss contract's top-k pair; every per-token float signal of the batch is laid out like the
    behaviour log-probs. With images among its samples (a vision-language student: `vision`), the
    micro-batch carries their pixel rows and grids in row order and M-RoPE position ids (module
    docstring)."""
    lengths, prompts = batch.lengths, batch.prompt_lens
    tok_at = _offsets(lengths)
    resp_at = _offsets(batch.response_lens)
    width = max(sum(lengths[i] for i in row) for row in rows)
    packed = any(len(row) > 1 for row in rows)
    images = _image_slices(batch, [i for row in rows for i in row])
    if images is not None and vision is None:
        raise ValueError("a micro-batch has image samples but the student is not a vision-language model")
    positions = _positions(batch, rows, width, images, vision) if images is not None or packed else None
    ids, gather, index, order = _lay_out_rows(batch, rows, width, pad_id, tok_at, resp_at)
    # Samples laid out in plan order (TensorBatch.plan) make the micro-batch one contiguous range
    # of the flat tensors: slice views, no copies. Otherwise gather its rows.
    contiguous = order == list(range(order[0], order[0] + len(order)))
    sel: slice | torch.Tensor = slice(resp_at[order[0]], resp_at[order[-1] + 1]) if contiguous else index
    counts = torch.tensor([batch.response_len(i) for i in order])
    lags = torch.tensor([-1 if (lag := batch.lag(i)) is None else lag for i in order], dtype=torch.long)
    token_signals = {name for name in batch.signals if name in {s.value for s in TOKEN_SIGNALS}}
    # Response token j of sample i sits at token_ids[tok_at[i] + prompt_lens[i] + j] and at row
    # resp_at[i] + j of the per-token tensors; the shift between the two is per sample.
    shift = torch.tensor([tok_at[i] + prompts[i] - resp_at[i] for i in order]).repeat_interleave(counts)
    mb = MicroBatch(
        input_ids=ids,
        position_ids=positions,
        gather_index=gather,
        targets=batch.token_ids[index + shift],
        behaviour_logprobs=batch.rollout_logprobs[sel],
        weights=torch.zeros(len(index)) if filler else token_weights[sel].to(torch.float32),
        signals={name: batch.signals[name][sel] for name in token_signals},
        task_advantages=(
            sample_advantages[order].repeat_interleave(counts).to(torch.float32)
            if sample_advantages is not None
            else None
        ),
        lags=lags.repeat_interleave(counts),
        segments=torch.arange(len(order)).repeat_interleave(counts),
        loss_mask=batch.loss_mask[sel] if batch.loss_mask is not None else None,
        real_tokens=0 if filler else sum(lengths[i] for i in order),
    )
    if images is not None:
        mb.pixel_values, mb.image_grid_thw = images
    if top_k is not None and top_k.ids.value in batch.signals and top_k.logprobs.value in batch.signals:
        mb.topk_ids, mb.topk_logprobs, mb.topk_valid = _top_k_rows(batch, top_k, sel)
    return mb


def _lay_out_rows(
    batch: TensorBatch, rows: list[Row], width: int, pad_id: int, tok_at: list[int], resp_at: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(input ids [rows, width], the logits' flat index of every response token, the response
    tokens' rows in the per-token tensors, the samples in row order)."""
    lengths, prompts = batch.lengths, batch.prompt_lens
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    order: list[int] = []
    gather, resp_index = [], []
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            n, p = lengths[i], prompts[i]
            ids[r, offset : offset + n] = batch.token_ids[tok_at[i] : tok_at[i] + n]
            # Logits at position t predict token t + 1.
            gather.append(torch.arange(p - 1, n - 1) + r * width + offset)
            resp_index.append(torch.arange(resp_at[i], resp_at[i + 1]))
            order.append(i)
            offset += n
    return ids, torch.cat(gather), torch.cat(resp_index), order


def _top_k_rows(
    batch: TensorBatch, top_k: TopKSignals, sel: slice | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The micro-batch's top-k ids and log-probs, as wide as its widest row (not the batch's),
    and which entries are real when some rows are shorter (None when none is)."""
    tid = batch.signals[top_k.ids.value][sel].long()  # int32 in the batch; gather indexes with int64
    tlp = batch.signals[top_k.logprobs.value][sel].to(torch.float32)
    widths = batch.widths.get(top_k.ids.value)
    if widths is None:
        return tid, tlp, None
    w = widths[sel]
    k = int(w.max())
    valid = torch.arange(k) < w.unsqueeze(1) if int(w.min()) < k else None
    return tid[:, :k], tlp[:, :k], valid


def _image_slices(batch: TensorBatch, order: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The pixel rows and grids of the samples in `order`, in that order (slices when they are
    contiguous, as in plan order); None when none of them has images."""
    counts = batch.image_counts
    if counts is None or batch.pixel_values is None or batch.image_grid_thw is None:
        return None
    if not any(counts[i] for i in order):
        return None
    grid_at = _offsets(counts)
    pixel_at = _offsets(batch.patch_counts())
    if order == list(range(order[0], order[0] + len(order))):
        lo, hi = order[0], order[-1] + 1
        return batch.pixel_values[pixel_at[lo] : pixel_at[hi]], batch.image_grid_thw[grid_at[lo] : grid_at[hi]]
    return (
        torch.cat([batch.pixel_values[pixel_at[i] : pixel_at[i + 1]] for i in order]),
        torch.cat([batch.image_grid_thw[grid_at[i] : grid_at[i + 1]] for i in order]),
    )


def _positions(
    batch: TensorBatch,
    rows: list[Row],
    width: int,
    images: tuple[torch.Tensor, torch.Tensor] | None,
    vision: VisionTokens | None,
) -> torch.Tensor:
    """Position ids of a micro-batch's rows: [rows, width] restarting at 0 for each sample (a
    packed text micro-batch), or with images [4, rows, width]: those text positions, then each
    sample's M-RoPE positions (mrope_positions). The padded tail of a row continues the last
    sample's positions: causal attention keeps it from reaching any real token, and it starts no
    extra packed sequence."""
    axes = 4 if images is not None else 1
    out = torch.zeros((axes, len(rows), width), dtype=torch.long)
    tok_at = _offsets(batch.lengths)
    grid_at = _offsets(batch.image_counts) if batch.image_counts is not None else None
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            n = batch.lengths[i]
            out[0, r, offset : offset + n] = torch.arange(n)
            if axes == 4:
                assert vision is not None and grid_at is not None and batch.image_grid_thw is not None
                grids = batch.image_grid_thw[grid_at[i] : grid_at[i + 1]]
                sample = batch.token_ids[tok_at[i] : tok_at[i] + n]
                out[1:, r, offset : offset + n] = (
                    mrope_positions(sample, grids, vision) if len(grids) else torch.arange(n)
                )
            offset += n
        if offset < width:
            start = out[:, r, offset - 1 : offset] + 1
            out[:, r, offset:] = start + torch.arange(width - offset)
    return out if axes == 4 else out[0]


def _offsets(lengths: list[int]) -> list[int]:
    """Where each sample starts in a flat tensor of them laid end to end, and the total last."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def micro_batch_rows(mine: list[list[list[int]]], j: int) -> list[list[int]]:
    """A rank's rows of micro-batch j: its own, or past its last, a filler repeating that last
    micro-batch's rows (zero weights)."""
    if j < len(mine):
        return mine[j]
    return mine[-1] if mine else [[0]]


def vision_lockstep(plans: Plan, image_counts: list[int] | None, world: int) -> list[bool] | None:
    """Per micro-batch index, whether any rank's micro-batch there (fillers included) has images;
    then every rank runs the vision tower at that index, so the sharded tower's all-gathers and
    reduce-scatters match (MicroBatch.touch_vision). None when nothing needs it: one rank, or no
    images in the batch."""
    if world == 1 or image_counts is None:
        return None
    n_micro = max(len(p) for p in plans)
    return [any(image_counts[i] for p in plans for row in micro_batch_rows(p, j) for i in row) for j in range(n_micro)]
