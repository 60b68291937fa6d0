"""Pure batch planning: split a TrainBatch over ranks and token-bounded micro-batches, and turn a
micro-batch into tensors. No torch.distributed here, so it is unit-testable.

Every rank holds the whole batch (rank 0 broadcasts it), computes the same plan and works on its
own share. Loss weights are computed over the whole batch (losses.token_weights), so the sum over
ranks and micro-batches is exactly the loss of the batch whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kubedistill.runtime.batch import TrainBatch


def shard_samples(lengths: list[int], world: int) -> list[list[int]]:
    """Sample indices per rank, balancing tokens (longest first onto the least-loaded rank)."""
    load = [0] * world
    shards: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shards[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shards]


def micro_batches(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group samples so each micro-batch's padded size (count x longest) stays within max_tokens.

    Samples are taken longest first so similar lengths share a micro-batch (little padding); a
    sample longer than max_tokens gets a micro-batch of its own.
    """
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > max_tokens:
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


@dataclass
class MicroBatch:
    """Tensors of one micro-batch. N = response tokens in it, k = top-k width."""

    input_ids: torch.Tensor  # [b, L] right-padded
    gather_index: torch.Tensor  # [N] index into the flattened [b*L] positions predicting each response token
    targets: torch.Tensor  # [N] response token ids
    behaviour_logprobs: torch.Tensor  # [N]
    weights: torch.Tensor  # [N] loss weight of each token (0 for a filler micro-batch)
    teacher_logprobs: Optional[torch.Tensor] = None  # [N]
    topk_ids: Optional[torch.Tensor] = None  # [N, k]
    topk_logprobs: Optional[torch.Tensor] = None  # [N, k]
    topk_valid: Optional[torch.Tensor] = None  # [N, k]
    task_advantages: Optional[torch.Tensor] = None  # [N]
    real_tokens: int = 0  # prompt + response tokens (no padding), 0 for a filler

    def to(self, device: torch.device) -> "MicroBatch":
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**kw)


def collate(
    batch: TrainBatch,
    indices: list[int],
    token_weight: list[torch.Tensor],
    sample_advantages: Optional[torch.Tensor],
    pad_id: int,
    filler: bool = False,
) -> MicroBatch:
    """Tensors for samples `indices` of `batch`. `token_weight[i]` holds sample i's per-token
    weights; a `filler` micro-batch (a rank with less work) gets zero weights."""
    longest = max(len(batch.token_ids[i]) for i in indices)
    ids = torch.full((len(indices), longest), pad_id, dtype=torch.long)
    gather, targets, mu, w, teacher, adv = [], [], [], [], [], []
    topk_rows: list[list[int]] = []
    topk_lp_rows: list[list[float]] = []
    real = 0
    for row, i in enumerate(indices):
        tokens, p = batch.token_ids[i], batch.prompt_lens[i]
        n = len(tokens)
        real += n
        ids[row, :n] = torch.tensor(tokens, dtype=torch.long)
        # Logits at position t predict token t + 1.
        gather.append(torch.arange(p - 1, n - 1) + row * longest)
        targets.extend(tokens[p:])
        mu.extend(batch.rollout_logprobs[i])
        w.append(torch.zeros(n - p) if filler else token_weight[i])
        if batch.teacher_logprobs is not None:
            teacher.extend(batch.teacher_logprobs[i])
        if sample_advantages is not None:
            adv.append(sample_advantages[i].expand(n - p))
        if batch.teacher_topk_ids is not None:
            topk_rows.extend(batch.teacher_topk_ids[i])
            topk_lp_rows.extend(batch.teacher_topk_logprobs[i])
    mb = MicroBatch(
        input_ids=ids,
        gather_index=torch.cat(gather),
        targets=torch.tensor(targets, dtype=torch.long),
        behaviour_logprobs=torch.tensor(mu, dtype=torch.float32),
        weights=torch.cat(w).to(torch.float32),
        teacher_logprobs=torch.tensor(teacher, dtype=torch.float32) if batch.teacher_logprobs is not None else None,
        task_advantages=torch.cat(adv).to(torch.float32) if sample_advantages is not None else None,
        real_tokens=0 if filler else real,
    )
    if batch.teacher_topk_ids is not None:
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
