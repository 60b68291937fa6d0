"""The student trainer: log-probs, the configured loss, AdamW, checkpoints, full weights.

One ``Trainer`` per trainer rank. Rank 0 (the only rank running the driver) *leads*: each call
it makes first broadcasts a command (for ``step``, the batch: a small header, then its flat
tensors), and the other ranks, in :meth:`Trainer.follow`, run the same call, so every collective
happens on every rank in the same order. Usage::

    trainer = Trainer(spec)            # every rank; joins the default process group
    if trainer.rank == 0:
        resumed = trainer.resume()     # -> Resumed(step, weight_version, driver_state) | None
        stats = trainer.step(batch)    # BatchParts -> StepStats (global values)
        for name, tensor in trainer.named_full_weights(): ...   # HF names; exhaust it
        trainer.save_checkpoint(step, weight_version, driver_state)
        trainer.export_hf(out_dir)
        trainer.close()                # releases the followers
    else:
        trainer.follow()               # returns after rank 0's close()

Its components are the other modules of this package; how a step splits its batch, packs rows,
trains vision-language students and computes the proximal policy: docs/architecture.md#the-train-step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kubedistill.api.losses import Signal, active_contract
from kubedistill.api.spec import (
    DistillationJobSpec,
)
from kubedistill.runtime.trainer import losses as L
from kubedistill.runtime.trainer.commands import Command, CommandChannel, Handler
from kubedistill.runtime.trainer.distributed import Ranks, compute_dtype, shard
from kubedistill.runtime.trainer.loss_inputs import distillation_baseline, needs_proximal_pass, task_advantages
from kubedistill.runtime.trainer.microbatch import (
    MicroBatch,
    collate,
    micro_batch_rows,
    plan_order,
    plan_step,
    vision_lockstep,
)
from kubedistill.runtime.trainer.model import (
    frozen_prefixes,
    full_weights,
    load_student,
    lora_adapter,
    pad_token_id,
    use_packing,
    weight_metas,
)
from kubedistill.runtime.trainer.schedule import lr_factor, updates_per_step
from kubedistill.runtime.trainer.state import Resumed, TrainerState
from kubedistill.runtime.trainer.stats import StepStats, StepSums, record_step
from kubedistill.runtime.wire.batch import BatchBuffers, BatchParts, Plan, TensorBatch
from kubedistill.runtime.wire.protocol import LoraAdapter, TensorMeta

if TYPE_CHECKING:
    from kubedistill.runtime.metrics import RoleMetrics

__all__ = ["Resumed", "StepStats", "Trainer"]


class Trainer:
    """One trainer rank: the model, the optimiser and the step; the rest is delegated."""

    def __init__(
        self, spec: DistillationJobSpec, *, metrics: RoleMetrics | None = None, model_path: str | Path | None = None
    ):
        self.spec = spec
        self.contract = active_contract(spec.algorithm.distillation)
        self.metrics = metrics
        self.ranks = Ranks(spec.device)
        self.commands = CommandChannel(self.ranks)

        path = model_path or spec.student.model
        self.model = load_student(spec, path, self.device)
        self.model_path = Path(path)
        self.hf_config = self.model.lm.config
        self.pad_id = pad_token_id(self.hf_config)
        self.pack = use_packing(spec, self.model, self.device)
        self.sharded = shard(self.model, self.ranks, compute_dtype(spec.trainer.mixed_precision, spec.device))
        """Whether the model is under FSDP2 (several ranks, or mixed precision)."""

        o = spec.trainer.optim
        # With LoRA only the adapters train: AdamW keeps no state for the frozen base.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=fused_adamw(self.device.type),
        )
        # The schedule runs in train steps; each of a step's mini-batches is one optimiser update.
        updates = updates_per_step(spec)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda u: lr_factor(u // updates, o, spec.trainer.total_steps)
        )
        self.step_count = 0
        # The proximal log-probs of the current step's mini-batches still to train, per sample of
        # this rank's share (recompute_proximal fills it, _step consumes one entry per call).
        self._proximal: list[dict[int, torch.Tensor]] = []
        # Where batches are laid out and received, reused from step to step: a step's batch lives
        # in slot "step" until the next step, a proximal pass's mini-batches in slots of their own.
        self.buffers = BatchBuffers()
        self._sending: list[Callable[[], None]] = []
        self._proximal_seconds = 0.0
        """The last proximal pass's compute, not yet reported in a step's stats."""
        self.state = TrainerState(spec, self.ranks, self.model, self.optimizer, self.scheduler, self.model_path)

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world(self) -> int:
        return self.ranks.world

    @property
    def device(self) -> torch.device:
        return self.ranks.device

    # ---- rank 0 leads, the others follow -------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: run rank 0's calls until it calls close()."""
        self.commands.follow(self._follower_handlers())

    def _follower_handlers(self) -> Mapping[Command, Handler]:
        return {
            Command.step: lambda header: self._step(self._receive(header)),
            Command.recompute_proximal: lambda headers: self._recompute_proximal(
                [self._receive(h, ("proximal", i)) for i, h in enumerate(headers)]
            ),
            Command.named_full_weights: lambda _: _exhaust(full_weights(self.model)),
            Command.save_checkpoint: lambda _: self.state.join_save(),
            Command.resume: lambda _: self._join_resume(),
            Command.export_hf: lambda _: self.state.join_export(),
            Command.close: lambda _: self.ranks.close(),
        }

    def close(self) -> None:
        """Rank 0: release the followers, then leave the process group if the trainer made it."""
        self.commands.broadcast(Command.close)
        self.ranks.close()

    # ---- train step ----------------------------------------------------------------------------

    def train(self, batches: Sequence[BatchParts]) -> list[StepStats]:
        """One optimiser step per mini-batch of a driver step, after the proximal pass when the
        spec asks for it (rank 0; the followers join)."""
        checked = [self._validate(b) for b in batches]
        if needs_proximal_pass(self.spec.algorithm, len(checked)):
            layouts = [self._layout(b) for b in checked]
            self.commands.broadcast(Command.recompute_proximal, [header for header, _ in layouts])
            self._recompute_proximal(
                [self._send(b, *layout, slot=("proximal", i)) for i, (b, layout) in enumerate(zip(checked, layouts))]
            )
            self._sent()
        return [self._lead_step(b) for b in checked]

    def _layout(self, batch: BatchParts) -> tuple[dict[str, Any], list[int]]:
        """The header of `batch` laid out in the order of its plan (every rank's micro-batches one
        after the other, each a contiguous range), and that order."""
        order, plan = plan_order(self._plan(batch.lengths))
        return batch.header(order, plan), order

    def _plan(self, lengths: list[int]) -> Plan:
        return plan_step(lengths, self.world, self.spec.trainer.micro_batch_tokens, self.pack)

    def _send(self, batch: BatchParts, header: dict[str, Any], order: list[int], slot: object = "step") -> TensorBatch:
        """Rank 0: lay `batch` out in `slot`'s buffers and broadcast its tensors to the followers,
        which announced `header` already; each piece is sent while the next is copied."""
        self._sent()  # the slot's buffers may still be sending the previous batch
        carved = self.buffers.take(header, slot)
        full, filled = batch.layout(header, order, into=carved.tensors)
        # Rank 0 computes on its copy while the followers still receive theirs.
        self._sending.append(self.ranks.broadcast_tensors(carved.sent(filled), wait=False))
        return TensorBatch.from_wire(header, full)

    def _sent(self) -> None:
        """Wait for the batches rank 0 is still sending."""
        while self._sending:
            self._sending.pop(0)()

    def _receive(self, header: Mapping[str, Any], slot: object = "step") -> TensorBatch:
        """A follower's copy of the batch rank 0 announced with `header`, in `slot`'s buffers."""
        carved = self.buffers.take(header, slot)
        self.ranks.broadcast_tensors(carved.received())
        return TensorBatch.from_wire(header, carved.tensors)

    def _recompute_proximal(self, batches: Sequence[TensorBatch]) -> None:
        self._proximal = []
        start = time.perf_counter()
        self.model.eval()
        with torch.no_grad():
            for batch in batches:
                mine: dict[int, torch.Tensor] = {}
                for rows, mb, filler in self._micro_batches(batch):
                    logprobs, _ = self._forward(mb, top_k=False)
                    if filler:
                        continue
                    lens = [batch.response_len(i) for row in rows for i in row]
                    for i, part in zip((i for row in rows for i in row), torch.split(logprobs.float(), lens)):
                        mine[i] = part.cpu()
                self._proximal.append(mine)
        # Counted as compute of the step's first mini-batch (its forward passes, in effect).
        self._proximal_seconds = time.perf_counter() - start

    def _micro_batches(
        self,
        batch: TensorBatch,
        token_weights: torch.Tensor | None = None,
        advantages: torch.Tensor | None = None,
    ) -> Iterator[tuple[list[list[int]], MicroBatch, bool]]:
        """This rank's micro-batches of `batch` as (rows, tensors on the device, filler): every
        rank yields the same number, fillers (zero weights) keeping FSDP's collectives matched."""
        if token_weights is None:
            token_weights = torch.zeros(sum(batch.response_lens))
        top_k = self.contract.top_k if self.contract is not None else None
        plans = batch.plan if batch.plan is not None else self._plan(batch.lengths)
        n_micro = max(len(p) for p in plans)
        vision = vision_lockstep(plans, batch.image_counts, self.world) if self.model.vision is not None else None
        mine = plans[self.rank]
        for j in range(n_micro):
            filler = j >= len(mine)
            rows = micro_batch_rows(mine, j)
            mb = collate(
                batch,
                rows,
                token_weights,
                advantages,
                self.pad_id,
                filler=filler,
                top_k=top_k,
                vision=self.model.vision,
            )
            mb.touch_vision = vision is not None and vision[j] and not mb.has_images
            if self.sharded:
                self.model.set_requires_gradient_sync(j == n_micro - 1)
            yield rows, mb.to(self.device), filler

    def _forward(self, mb: MicroBatch, top_k: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's log-probs of a micro-batch's response tokens (and at its top-k ids)."""
        return self.model(
            mb.input_ids,
            mb.gather_index,
            mb.targets,
            mb.topk_ids if top_k else None,
            mb.position_ids,
            pixel_values=mb.pixel_values,
            image_grid_thw=mb.image_grid_thw,
            touch_vision=mb.touch_vision,
        )

    def step(self, batch: BatchParts) -> StepStats:
        """One optimiser step on `batch` (rank 0; the followers join). Returns global stats."""
        return self._lead_step(self._validate(batch))

    def _validate(self, batch: BatchParts) -> BatchParts:
        """Refuse an inconsistent batch, or one lacking what the loss contract reads, before the
        followers get it: the one check of a batch on the trainer."""
        batch.validate(self.contract, rewards=self.spec.algorithm.distillation.use_task_rewards)
        if self.model.vision is None and any(p.images is not None for p in batch.parts):
            raise ValueError(
                f"TrainBatch.images: the batch has image samples but the student {self.model_path} is a text model"
            )
        return batch

    def _lead_step(self, batch: BatchParts) -> StepStats:
        header, order = self._layout(batch)
        self.commands.broadcast(Command.step, header)
        stats = self._step(self._send(batch, header, order))
        self._sent()
        return stats

    def _step(self, batch: TensorBatch) -> StepStats:
        start = time.perf_counter()
        spec = self.spec
        algo = spec.algorithm
        weights = L.token_weights(batch.response_lens, algo.loss_aggregation, batch.loss_mask) * self.world
        advantages = task_advantages(batch, algo.advantage) if algo.distillation.use_task_rewards else None
        baseline = distillation_baseline(batch, algo, self.contract)

        proximal = self._proximal.pop(0) if self._proximal else None
        sums = StepSums()
        self.model.train()
        compute = 0.0  # forward, loss, backward and the optimiser; not collation or stats
        for rows, mb, filler in self._micro_batches(batch, weights, advantages):
            tc = time.perf_counter()
            logprobs, topk_lp = self._forward(mb)
            old = None
            if proximal is not None and not filler:
                old = torch.cat([proximal[i] for row in rows for i in row]).to(logprobs.device, logprobs.dtype)
            losses = L.per_token_losses(
                algo,
                logprobs=logprobs,
                behaviour_logprobs=mb.behaviour_logprobs,
                teacher_logprobs=mb.signals.get(Signal.teacher_logprobs.value),
                student_topk_logprobs=topk_lp,
                teacher_topk_logprobs=mb.topk_logprobs,
                topk_valid=mb.topk_valid,
                task_advantages=mb.task_advantages,
                old_logprobs=old,
                segments=mb.segments,
                advantage_baseline=baseline,
                loss_mask=mb.loss_mask,
            )
            (losses["total"] * mb.weights).sum().backward()
            compute += self._settled() - tc
            sums.add(mb, losses, logprobs, self.world, filler)
        tc = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, spec.trainer.optim.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        compute += self._settled() - tc
        self.step_count += 1
        total = sums.all_reduce(self.ranks.all_reduce_sum, self.ranks.all_reduce_max)
        proximal_seconds, self._proximal_seconds = self._proximal_seconds, 0.0
        stats = total.stats(
            self.step_count,
            grad_norm=float(grad_norm),
            lr=lr,
            samples=len(batch),
            seconds=time.perf_counter() - start,
            compute_seconds=compute + proximal_seconds,
        )
        if self.metrics is not None:
            record_step(self.metrics, stats)
        return stats

    def _settled(self) -> float:
        """The clock once the device has run what was queued (on a GPU the compute ends there; the
        step's statistics read the loss back right after anyway)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ---- weights and state ---------------------------------------------------------------------

    def weight_metas(self) -> list[TensorMeta]:
        """What named_full_weights yields (names, dtypes, full shapes), with no collective."""
        return weight_metas(self.model)

    def frozen_prefixes(self) -> list[str]:
        """HF name prefixes of the weights named_full_weights leaves out as frozen (freezeVision:
        ``["model.visual."]``), which a receiver keeps as it loaded them; [] when all train."""
        return frozen_prefixes(self.model)

    def lora_adapter(self) -> LoraAdapter | None:
        """The adapter's config when the student trains LoRA adapters (named_full_weights then
        yields only those), else None."""
        return lora_adapter(self.model)

    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full fp32 tensor on the device) in a fixed order, a tied lm_head omitted; with
        LoRA only the adapters, under PEFT's names. Collective: rank 0 must exhaust it."""
        self.commands.broadcast(Command.named_full_weights)
        return full_weights(self.model)

    def save_checkpoint(self, step: int, weight_version: int, driver_state: Any) -> Path:
        """Atomic checkpoint of model, optimiser, scheduler, RNG, step and weight version plus the
        driver's opaque `driver_state` (bytes or any picklable object); returns its directory.
        Rank 0; collective."""
        self.commands.broadcast(Command.save_checkpoint)
        return self.state.save(step, weight_version, self.step_count, driver_state)

    def resume(self) -> Resumed | None:
        """Load the newest complete checkpoint if spec.checkpoint.resume is auto (rank 0;
        collective). None when there is none (or resume: never): start fresh."""
        self.commands.broadcast(Command.resume)
        restored = self.state.resume()
        if restored is None:
            return None
        resumed, self.step_count = restored
        return resumed

    def _join_resume(self) -> None:
        step_count = self.state.join_resume()
        if step_count is not None:
            self.step_count = step_count

    def export_hf(self, out_dir: str | Path) -> Path:
        """Write the student as a plain HF directory (safetensors, config, tokenizer) loadable by
        transformers and vLLM; returns it. Rank 0; collective. Written to a temp dir and renamed."""
        self.commands.broadcast(Command.export_hf)
        return self.state.export(Path(out_dir))


def fused_adamw(device_type: str) -> bool | None:
    """Whether AdamW runs as one fused kernel: on CPU and CUDA (FSDP2's DTensors included), where it
    updates every tensor in one call instead of a dozen ops per tensor (faster, and that many
    fewer GIL hand-offs beside the driver's thread: docs/design.md, "Compared with peers").
    Elsewhere torch's default (None)."""
    return True if device_type in ("cpu", "cuda") else None


def _exhaust(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """A follower's side of named_full_weights: every all-gather, nothing kept."""
    for _ in weights:
        pass
