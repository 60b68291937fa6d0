"""Micro-batches: split a TensorBatch over ranks and token-bounded micro-batches (optionally
packing several samples into one row, padding-free), and slice a micro-batch's tensors from the
batch's flat ones. No torch.distributed here, so it is unit-testable.

Every rank holds the whole batch (rank 0 broadcasts it), computes the same plan and works on its
own share. Loss weights are computed over the whole batch (losses.token_weights), so the sum over
ranks and micro-batches is exactly the loss of the batch whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kubedistill.api.losses import TOKEN_SIGNALS, TopKSignals
from kubedistill.runtime.wire.batch import TensorBatch


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
    real_tokens: int = 0  # prompt + response tokens (no padding), 0 for a filler
    position_ids: torch.Tensor | None = None  # [rows, L] when rows hold packed samples

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
) -> MicroBatch:
    """Tensors for the samples in `rows` of `batch` (each row's samples laid end to end, rows
    right-padded to the widest), sliced from the batch's flat tensors: the Python loop is over
    samples, never tokens. `token_weights` holds every response token's weight (flat, batch
    order); a `filler` micro-batch (a rank with less work) gets zero weights. When a row holds
    more than one sample, `position_ids` restart at 0 for each, which is how transformers
    recognises packed sequences (block-causal attention: no sample sees another). `top_k` is the
    loss contract's top-k pair; every per-token float signal of the batch is laid out like the
    behaviour log-probs."""
    lengths, prompts = batch.lengths, batch.prompt_lens
    tok_at = _offsets(lengths)
    resp_at = _offsets(batch.response_lens)
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    packed = any(len(row) > 1 for row in rows)
    positions = torch.zeros((len(rows), width), dtype=torch.long) if packed else None
    order: list[int] = []
    gather, resp_index = [], []
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            n, p = lengths[i], prompts[i]
            ids[r, offset : offset + n] = batch.token_ids[tok_at[i] : tok_at[i] + n]
            if positions is not None:
                positions[r, offset : offset + n] = torch.arange(n)
            # Logits at position t predict token t + 1.
            gather.append(torch.arange(p - 1, n - 1) + r * width + offset)
            resp_index.append(torch.arange(resp_at[i], resp_at[i + 1]))
            order.append(i)
            offset += n
        if positions is not None and offset < width:
            # The padded tail continues the last sample's positions: causal attention keeps it
            # from reaching any real token, and it starts no extra packed sequence.
            start = int(positions[r, offset - 1]) + 1
            positions[r, offset:] = torch.arange(start, start + width - offset)
    index = torch.cat(resp_index)
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
        gather_index=torch.cat(gather),
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
        real_tokens=0 if filler else sum(lengths[i] for i in order),
    )
    if top_k is not None and top_k.ids.value in batch.signals and top_k.logprobs.value in batch.signals:
        tid = batch.signals[top_k.ids.value][sel]
        tlp = batch.signals[top_k.logprobs.value][sel].to(torch.float32)
        widths = batch.widths.get(top_k.ids.value)
        valid = None
        if widths is not None:
            w = widths[sel]
            k = int(w.max())  # as wide as this micro-batch's widest row, not the batch's
            tid, tlp = tid[:, :k], tlp[:, :k]
            if int(w.min()) < k:
                valid = torch.arange(k) < w.unsqueeze(1)
        mb.topk_ids, mb.topk_logprobs, mb.topk_valid = tid, tlp, valid
    return mb


def _offsets(lengths: list[int]) -> list[int]:
    """Where each sample starts in a flat tensor of them laid end to end, and the total last."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
