"""The student trainer: log-probs, the configured loss, AdamW, checkpoints, full weights.

One ``Trainer`` per trainer rank. Rank 0 (the only rank running the driver) *leads*: each call
it makes (``step``, ``named_full_weights``, ``save_checkpoint``, ``resume``, ``export_hf``,
``close``) first broadcasts a small command (and, for ``step``, the pickled ``TrainBatch``) over
a gloo group; the other ranks sit in :meth:`Trainer.follow` and run the same call, so every
collective happens on every rank in the same order. Usage::

    trainer = Trainer(spec)            # every rank; joins the default process group
    if trainer.rank == 0:
        resumed = trainer.resume()     # -> Resumed(step, weight_version, driver_state) | None
        stats = trainer.step(batch)    # -> StepStats (global values)
        for name, tensor in trainer.named_full_weights(): ...   # HF names; exhaust it
        trainer.save_checkpoint(step, weight_version, driver_state)
        trainer.export_hf(out_dir)
        trainer.close()                # releases the followers
    else:
        trainer.follow()               # returns after rank 0's close()

Parallelism: FSDP2 ``fully_shard`` over all ranks (each decoder layer, then the root), on GPU
with NCCL and on CPU with gloo. Without an initialised process group the trainer creates a
single-rank one (in-process HashStore), so one code path serves 1 and N ranks.

Batch split: every rank receives the whole batch, computes the same plan (runtime/trainer/plan.py),
and processes its share in token-bounded micro-batches (``trainer.microBatchTokens``); ranks with
fewer micro-batches run zero-weight fillers so FSDP's collectives stay matched. Per-token loss
weights are computed over the whole batch and multiplied by the world size (FSDP averages
gradients over ranks), so the gradient equals the 1-rank gradient of the same global batch.

Packing (``trainer.packSequences``, on by default): samples are laid end to end in rows no wider
than the batch's longest sample, with position ids restarting per sample, so a step computes on
real tokens rather than padding (long-tailed response lengths waste most of a padded batch); a
start-up check falls back to padded rows for a model whose attention ignores such packing.

Log-probs: the decoder runs on the micro-batch's rows, the LM head only at the positions that
predict response tokens; log pi(y) = logit(y) - logsumexp(logits), and the same for the teacher's
top-k ids (forwardKLTopK). One optimiser step per ``step(batch)``: the driver calls it once per
mini-batch.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.checkpoint import CheckpointStore, read_pickle, write_pickle
from kubedistill.runtime.models.loading import load_causal_lm
from kubedistill.runtime.trainer import losses as L
from kubedistill.runtime.trainer.plan import collate, micro_batches, shard_samples
from kubedistill.runtime.trainer.schedule import lr_factor
from kubedistill.runtime.wire.batch import TrainBatch

log = logging.getLogger("kubedistill.trainer")

_PREFIX = "lm."
_TRAINER_FILE = "trainer.pt"
_DRIVER_FILE = "driver.pkl"


@dataclass
class StepStats:
    """What one train step did (global over ranks; identical on every rank)."""

    step: int
    """Completed optimiser steps after this one (1-based)."""
    loss_total: float
    loss_distill: float
    loss_pg: float
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    samples: int
    tokens: int
    """Prompt + response tokens forwarded (no padding)."""
    response_tokens: int
    kl: float | None
    """Mean k1 = s - T over response tokens: the reverse KL(student || teacher) estimate
    (None when the batch has no teacher log-probs of the sampled tokens)."""
    seconds: float
    tokens_per_second: float


@dataclass
class Resumed:
    step: int
    weight_version: int
    driver_state: Any
    path: Path


class _LogProbModel(nn.Module):
    """Wraps the HF causal LM: decoder on all positions, LM head only where log-probs are needed.

    Wrapping (instead of calling submodules of an FSDP-sharded model) keeps FSDP2's root hooks
    in charge of gathering the embedding, final norm and LM head.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self,
        input_ids: torch.Tensor,
        gather_index: torch.Tensor,
        targets: torch.Tensor,
        topk_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, gather_index)
        logits = self.lm.get_output_embeddings()(h).float()
        lse = torch.logsumexp(logits, dim=-1)
        token_lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        topk_lp = logits.gather(-1, topk_ids) - lse.unsqueeze(-1) if topk_ids is not None else None
        return token_lp, topk_lp


@torch.no_grad()
def packing_is_exact(model: _LogProbModel, device: torch.device, atol: float = 1e-4) -> bool:
    """Whether two sequences packed into one row (position ids restarting at the second) give the
    same log-probs as each alone. transformers' own attention code turns restarting position ids
    into a block-causal mask (varlen on flash-attention); a model with its own attention code may
    not, and would silently let packed samples attend to each other. Runs before sharding."""
    vocab = model.lm.config.vocab_size
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, vocab, (n,), generator=g) for n in (7, 5))
    targets = torch.cat([a[1:], b[1:]]).to(device)
    alone = torch.cat(
        [
            model(seq[None].to(device), torch.arange(len(seq) - 1, device=device), seq[1:].to(device), None)[0]
            for seq in (a, b)
        ]
    )
    ids = torch.cat([a, b])[None].to(device)
    positions = torch.cat([torch.arange(len(a)), torch.arange(len(b))])[None].to(device)
    index = torch.cat([torch.arange(len(a) - 1), torch.arange(len(b) - 1) + len(a)]).to(device)
    try:
        packed = model(ids, index, targets, None, positions)[0]
    except Exception:  # a model that refuses position ids of this shape cannot pack either
        return False
    return bool(torch.allclose(packed.float(), alone.float(), atol=atol))


def _compute_dtype(spec: DistillationJobSpec) -> torch.dtype:
    name = spec.trainer.mixed_precision.value
    if name == "auto":
        name = "bfloat16" if spec.device.value == "cuda" else "float32"
    return getattr(torch, name)


class Trainer:
    def __init__(self, spec: DistillationJobSpec, *, metrics: Any = None, model_path: str | Path | None = None):
        self.spec = spec
        self.metrics = metrics
        self._own_group = False
        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if spec.device.value == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Commands, batches and stats travel over gloo even when the default group is NCCL.
        self._ctrl = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        if spec.device.value == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")

        path = model_path or spec.student.model
        lm = load_causal_lm(
            path, dtype="float32", what="spec.student.model", trust_remote_code=spec.student.trust_remote_code
        )
        self.model_path = Path(path)
        self.hf_config = lm.config
        if spec.trainer.gradient_checkpointing:
            lm.gradient_checkpointing_enable()
        lm.config.use_cache = False
        self.pad_id = lm.config.pad_token_id if lm.config.pad_token_id is not None else 0
        self.model = _LogProbModel(lm).to(self.device)
        self.pack = spec.trainer.pack_sequences and packing_is_exact(self.model, self.device)
        if spec.trainer.pack_sequences and not self.pack:
            log.warning(
                "trainer.packSequences: %s does not keep packed samples apart (its attention ignores "
                "position-id packing); training on padded rows instead",
                type(lm).__name__,
            )
        self._shard()

        o = spec.trainer.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, o, spec.trainer.total_steps)
        )
        self.step_count = 0
        self.store = CheckpointStore(spec.checkpoint.path, keep=spec.checkpoint.keep)

    # ---- set-up --------------------------------------------------------------------------------

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        dtype = _compute_dtype(self.spec)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        layers = getattr(self.model.lm.get_decoder(), "layers", None)
        if layers is None:
            raise ValueError(f"spec.student.model: {type(self.model.lm).__name__} has no decoder .layers to shard")
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(self.model, mesh=mesh, mp_policy=mp)

    # ---- leader / follower protocol ------------------------------------------------------------

    def _broadcast(self, obj: Any = None) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ctrl)
        return box[0]

    def _lead(self, command: str, payload: Any = None) -> None:
        if self.rank != 0:
            raise RuntimeError(f"Trainer.{command} is called on rank 0 only; other ranks run follow()")
        self._broadcast((command, payload))

    def follow(self) -> None:
        """Ranks > 0: run rank 0's calls until it calls close()."""
        while True:
            command, payload = self._broadcast(None)
            if command == "close":
                self._close_local()
                return
            if command == "step":
                self._step(payload)
            elif command == "weights":
                for _ in self._named_full_weights():
                    pass
            elif command == "save":
                self._save(*payload)
            elif command == "resume":
                self._resume()
            elif command == "export":
                self._export(payload)
            else:
                raise RuntimeError(f"unknown trainer command {command!r}")

    def close(self) -> None:
        """Rank 0: release the followers, then leave the process group if the trainer made it."""
        if self.world > 1:
            self._lead("close")
        self._close_local()

    def _close_local(self) -> None:
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False
        elif self.world > 1:
            dist.barrier(group=self._ctrl)

    # ---- train step ----------------------------------------------------------------------------

    def step(self, batch: TrainBatch) -> StepStats:
        """One optimiser step on `batch` (rank 0; the followers join). Returns global stats."""
        batch.validate()
        self._check_signals(batch)
        if self.world > 1:
            self._lead("step", batch)
        return self._step(batch)

    def _check_signals(self, batch: TrainBatch) -> None:
        """Refuse a batch lacking what the configured loss reads, before the followers get it."""
        d = self.spec.algorithm.distillation
        if d.enabled and d.loss_mode.value == "forwardKLTopK" and batch.teacher_topk_ids is None:
            raise ValueError(
                "TrainBatch.teacher_topk_ids: lossMode forwardKLTopK needs teacher top-k ids and log-probs"
            )
        if d.enabled and d.loss_mode.value in ("k1", "k3") and batch.teacher_logprobs is None:
            raise ValueError(f"TrainBatch.teacher_logprobs: lossMode {d.loss_mode.value} needs teacher log-probs")
        if d.use_task_rewards and batch.rewards is None:
            raise ValueError(
                "TrainBatch.rewards/group_ids: required when algorithm.distillation.useTaskRewards is true"
            )

    def _step(self, batch: TrainBatch) -> StepStats:
        start = time.perf_counter()
        spec = self.spec
        algo = spec.algorithm
        n = len(batch)
        resp_lens = [batch.response_len(i) for i in range(n)]
        lengths = [len(t) for t in batch.token_ids]
        weights = L.token_weights(resp_lens, algo.loss_aggregation.value) * self.world
        per_sample_w = list(torch.split(weights, resp_lens))
        advantages = None
        if algo.distillation.use_task_rewards:
            advantages = L.grpo_advantages(torch.tensor(batch.rewards, dtype=torch.float32), batch.group_ids)

        shards = shard_samples(lengths, self.world)
        plans = [micro_batches(s, lengths, spec.trainer.micro_batch_tokens, pack=self.pack) for s in shards]
        n_micro = max(len(p) for p in plans)
        mine = plans[self.rank]
        # sums: total, distill, pg, kl numerator, kl tokens, tokens, response tokens
        sums = torch.zeros(7, dtype=torch.float64)
        self.model.train()
        for j in range(n_micro):
            filler = j >= len(mine)
            rows = mine[j] if not filler else (mine[-1] if mine else [[0]])
            mb = collate(batch, rows, per_sample_w, advantages, self.pad_id, filler=filler).to(self.device)
            self.model.set_requires_gradient_sync(j == n_micro - 1)
            logprobs, topk_lp = self.model(mb.input_ids, mb.gather_index, mb.targets, mb.topk_ids, mb.position_ids)
            parts = L.per_token_losses(
                algo,
                logprobs=logprobs,
                behaviour_logprobs=mb.behaviour_logprobs,
                teacher_logprobs=mb.teacher_logprobs,
                student_topk_logprobs=topk_lp,
                teacher_topk_logprobs=mb.topk_logprobs,
                topk_valid=mb.topk_valid,
                task_advantages=mb.task_advantages,
            )
            loss = (parts["total"] * mb.weights).sum()
            loss.backward()
            with torch.no_grad():
                w = mb.weights.double() / self.world
                sums[0] += (parts["total"].double() * w).sum().cpu()
                sums[1] += (parts["distill"].double() * w).sum().cpu()
                sums[2] += (parts["pg"].double() * w).sum().cpu()
                if mb.teacher_logprobs is not None and not filler:
                    sums[3] += (logprobs.detach().double() - mb.teacher_logprobs.double()).sum().cpu()
                    sums[4] += logprobs.numel()
                if not filler:
                    sums[5] += mb.real_tokens
                    sums[6] += logprobs.numel()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.trainer.optim.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        if self.world > 1:
            dist.all_reduce(sums, group=self._ctrl)
        seconds = time.perf_counter() - start
        tokens = int(sums[5])
        stats = StepStats(
            step=self.step_count,
            loss_total=float(sums[0]),
            loss_distill=float(sums[1]),
            loss_pg=float(sums[2]),
            grad_norm=float(grad_norm),
            lr=lr,
            samples=n,
            tokens=tokens,
            response_tokens=int(sums[6]),
            kl=float(sums[3] / sums[4]) if sums[4] > 0 else None,
            seconds=seconds,
            tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
        )
        self._record(stats)
        return stats

    def _record(self, s: StepStats) -> None:
        m = self.metrics
        if m is None:
            return
        m["step"].set(s.step)
        m["step_seconds"].labels(phase="train").observe(s.seconds)
        m["loss"].labels(kind="total").set(s.loss_total)
        m["loss"].labels(kind="distill").set(s.loss_distill)
        m["loss"].labels(kind="pg").set(s.loss_pg)
        m["grad_norm"].set(s.grad_norm)
        m["learning_rate"].set(s.lr)
        m["tokens_per_second"].set(s.tokens_per_second)
        if s.kl is not None:
            m["kl_student_teacher"].set(s.kl)

    # ---- weights -------------------------------------------------------------------------------

    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, full fp32 tensor) in a fixed order; a tied lm_head is omitted.

        Collective: rank 0 calls it and must exhaust the iterator; the followers join through
        follow(). Tensors are on the trainer's device, materialised one at a time.
        """
        if self.world > 1:
            self._lead("weights")
        return self._named_full_weights()

    def _named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # named_parameters() yields a tied parameter once, under its first (embedding) name.
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name[len(_PREFIX) :], full.detach()

    def _full_model_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # ---- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, step: int, weight_version: int, driver_state: Any) -> Path:
        """Atomic checkpoint of model, optimiser, scheduler, RNG, step and weight version plus the
        driver's opaque `driver_state` (bytes or any picklable object). Rank 0; collective."""
        if self.world > 1:
            self._lead("save", (step, weight_version, None))
        return self._save(step, weight_version, driver_state)

    def _save(self, step: int, weight_version: int, driver_state: Any) -> Path | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        model_sd = self._full_model_state()
        optim_sd = get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        path = None
        if self.rank == 0:
            state = {
                "model": model_sd,
                "optimizer": optim_sd,
                "scheduler": self.scheduler.state_dict(),
                "step_count": self.step_count,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            }
            if self.device.type == "cuda":
                state["rng"]["cuda"] = torch.cuda.get_rng_state()

            def write_trainer(p: Path) -> None:
                torch.save(state, p)

            path = self.store.save(
                step,
                weight_version,
                {_TRAINER_FILE: write_trainer, _DRIVER_FILE: write_pickle(driver_state)},
                {"world_size": self.world},
            )
        if self.world > 1:
            dist.barrier(group=self._ctrl)
        return path

    def resume(self) -> Resumed | None:
        """Load the newest complete checkpoint if spec.checkpoint.resume is auto (rank 0;
        collective). None when there is none (or resume: never): start fresh."""
        if self.world > 1:
            self._lead("resume")
        return self._resume()

    def _resume(self) -> Resumed | None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        info = None
        if self.rank == 0:
            self.store.remove_partial()
            if self.spec.checkpoint.resume.value == "auto":
                info = self.store.latest()
        found = self._broadcast(info is not None)
        if not found:
            return None
        state = torch.load(info.path / _TRAINER_FILE, weights_only=False) if self.rank == 0 else {}
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, state.get("model", {}), options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, state.get("optimizer", {}), options=opts)
        small = self._broadcast({k: state[k] for k in ("scheduler", "step_count", "rng")} if self.rank == 0 else None)
        self.scheduler.load_state_dict(small["scheduler"])
        self.step_count = small["step_count"]
        torch.set_rng_state(small["rng"]["torch"])
        random.setstate(small["rng"]["python"])
        if "cuda" in small["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(small["rng"]["cuda"])
        if self.rank != 0:
            return None
        return Resumed(info.step, info.weight_version, read_pickle(info.path / _DRIVER_FILE), info.path)

    def export_hf(self, out_dir: str | Path) -> Path | None:
        """Write the student as a plain HF directory (safetensors, config, tokenizer) loadable by
        transformers and vLLM. Rank 0; collective. Written to a temp dir and renamed."""
        if self.world > 1:
            self._lead("export", str(out_dir))
        return self._export(str(out_dir))

    def _export(self, out_dir: str) -> Path | None:
        import shutil

        from transformers import AutoModelForCausalLM, AutoTokenizer

        sd = {k[len(_PREFIX) :]: v for k, v in self._full_model_state().items()}
        out = None
        if self.rank == 0:
            out = Path(out_dir)
            tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            fresh = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
            result = fresh.load_state_dict(sd, strict=False)
            tied = {"lm_head.weight"} if getattr(self.hf_config, "tie_word_embeddings", False) else set()
            if result.unexpected_keys or set(result.missing_keys) - tied:
                raise RuntimeError(
                    f"export: state dict does not match {type(fresh).__name__}: missing "
                    f"{sorted(set(result.missing_keys) - tied)}, unexpected {sorted(result.unexpected_keys)}"
                )
            fresh.save_pretrained(str(tmp), safe_serialization=True)
            tok_src = self.spec.student.tokenizer or self.model_path
            AutoTokenizer.from_pretrained(str(tok_src), local_files_only=True).save_pretrained(str(tmp))
            gen = self.model_path / "generation_config.json"
            if gen.is_file():
                shutil.copy(gen, tmp / gen.name)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        if self.world > 1:
            dist.barrier(group=self._ctrl)
        return out
