"""The trainer's micro-batch collate as it was before batches travelled as tensors: a TrainBatch
of nested lists rebuilt into tensors in Python loops over tokens. Kept only as the reference the
tensor path (runtime/trainer/microbatch.py) is tested against (test_batch_tensors.py)."""

from __future__ import annotations

import torch

from kubedistill.api.losses import TOKEN_SIGNALS, TopKSignals
from kubedistill.runtime.trainer.microbatch import MicroBatch, Row
from kubedistill.runtime.wire.batch import TrainBatch


def list_collate(
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
    top_ids, top_lps = (batch.signal(top_k.ids), batch.signal(top_k.logprobs)) if top_k else (None, None)
    scored_topk = (top_ids, top_lps) if top_ids is not None and top_lps is not None else None
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
