"""Micro-batches: split a TrainBatch over ranks and token-bounded micro-batches (optionally
packing several samples into one row, padding-free), and turn a micro-batch into tensors. No
torch.distributed here, so it is unit-testable.

Every rank holds the whole batch (rank 0 broadcasts it), computes the same plan and works on its
own share. Loss weights are computed over the whole batch (losses.token_weights), so the sum over
ranks and micro-batches is exactly the loss of the batch whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kubedistill.api.losses import TOKEN_SIGNALS, TopKSignals
from kubedistill.runtime.wire.batch import TrainBatch


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


@dataclass
class MicroBatch:
    """Tensors of one micro-batch. N = response tokens in it, k = top-k width."""

    input_ids: torch.Tensor  # [rows, L] right-padded
    gather_index: torch.Tensor  # [N] index into the flattened [rows*L] positions predicting each response token
    targets: torch.Tensor  # [N] response token ids
    behaviour_logprobs: torch.Tensor  # [N]
    weights: torch.Tensor  # [N] loss weight of each token (0 for a filler micro-batch)
    # The batch's per-token float signals ([N] each), keyed as in TrainBatch.signals.
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
    batch: TrainBatch,
    rows: list[Row],
    token_weight: list[torch.Tensor],
    sample_advantages: torch.Tensor | None,
    pad_id: int,
    filler: bool = False,
    *,
    top_k: TopKSignals | None = None,
) -> MicroBatch:
    """Tensors for the samples in `rows` of `batch` (each row's samples laid end to end, rows
    right-padded to the widest). `token_weight[i]` holds sample i's per-token weights; a `filler`
    micro-batch (a rank with less work) gets zero weights. When a row holds more than one sample,
    `position_ids` restart at 0 for each, which is how transformers recognises packed sequences
    (block-causal attention: no sample sees another). `top_k` is the loss contract's top-k pair;
    every per-token float signal of the batch is laid out like the behaviour log-probs."""
    width = max(sum(len(batch.token_ids[i]) for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    packed = any(len(row) > 1 for row in rows)
    positions = torch.zeros((len(rows), width), dtype=torch.long) if packed else None
    gather, targets, mu, w, adv, lags, segments = [], [], [], [], [], [], []
    token_signals = {name: values for name, values in batch.signals.items() if name in TOKEN_SIGNALS}
    per_token: dict[str, list[float]] = {name: [] for name in token_signals}
    scored_topk = batch.top_k_scores(top_k)
    topk_rows: list[list[int]] = []
    topk_lp_rows: list[list[float]] = []
    real = 0
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            tokens, p = batch.token_ids[i], batch.prompt_lens[i]
            n = len(tokens)
            real += n
            ids[r, offset : offset + n] = torch.tensor(tokens, dtype=torch.long)
            if positions is not None:
                positions[r, offset : offset + n] = torch.arange(n)
            # Logits at position t predict token t + 1.
            gather.append(torch.arange(p - 1, n - 1) + r * width + offset)
            targets.extend(tokens[p:])
            mu.extend(batch.rollout_logprobs[i])
            lag = batch.lag(i)
            lags.extend([-1 if lag is None else lag] * (n - p))
            segments.extend([len(gather) - 1] * (n - p))
            w.append(torch.zeros(n - p) if filler else token_weight[i])
            for name, values in token_signals.items():
                per_token[name].extend(values[i])
            if sample_advantages is not None:
                adv.append(sample_advantages[i].expand(n - p))
            if scored_topk is not None:
                topk_ids, topk_logprobs = scored_topk
                topk_rows.extend(topk_ids[i])
                topk_lp_rows.extend(topk_logprobs[i])
            offset += n
        if positions is not None and offset < width:
            # The padded tail continues the last sample's positions: causal attention keeps it
            # from reaching any real token, and it starts no extra packed sequence.
            start = int(positions[r, offset - 1]) + 1
            positions[r, offset:] = torch.arange(start, start + width - offset)
    mb = MicroBatch(
        input_ids=ids,
        position_ids=positions,
        gather_index=torch.cat(gather),
        targets=torch.tensor(targets, dtype=torch.long),
        behaviour_logprobs=torch.tensor(mu, dtype=torch.float32),
        weights=torch.cat(w).to(torch.float32),
        signals={name: torch.tensor(values, dtype=torch.float32) for name, values in per_token.items()},
        task_advantages=torch.cat(adv).to(torch.float32) if sample_advantages is not None else None,
        lags=torch.tensor(lags, dtype=torch.long),
        segments=torch.tensor(segments, dtype=torch.long),
        real_tokens=0 if filler else real,
    )
    if scored_topk is not None:
        k = max(len(r) for r in topk_rows)
        n_tok = len(topk_rows)
        tid = torch.zeros((n_tok, k), dtype=torch.long)
        tlp = torch.zeros((n_tok, k), dtype=torch.float32)
        valid = torch.zeros((n_tok, k), dtype=torch.bool)
        for j, (r_ids, r_lp) in enumerate(zip(topk_rows, topk_lp_rows)):
            tid[j, : len(r_ids)] = torch.tensor(r_ids, dtype=torch.long)
            tlp[j, : len(r_lp)] = torch.tensor(r_lp, dtype=torch.float32)
            valid[j, : len(r_ids)] = True
        if bool(valid.all()):
            valid = None  # the common case: every row has k entries; skip masking work
        mb.topk_ids, mb.topk_logprobs, mb.topk_valid = tid, tlp, valid
    return mb
