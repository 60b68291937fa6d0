"""The trainer ranks: process groups, this rank's device, the collectives the other components use,
and FSDP2 sharding.

Every decision that differs on GPU (backend, device, compute dtype, whether commands need a gloo
group of their own) is a pure function of the spec, so the CPU tests cover the choice even where
they cannot run the GPU path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kubedistill.api.spec import Device, DType

if TYPE_CHECKING:
    from kubedistill.runtime.trainer.model import LogProbModel


def process_group_backend(device: Device) -> str:
    """Backend of the default process group: NCCL for CUDA tensors, with gloo beside it for the
    CPU tensors of the command channel."""
    return "cpu:gloo,cuda:nccl" if device is Device.cuda else "gloo"


def needs_control_group(default_backend: str) -> bool:
    """Whether commands, batches and stats need a gloo group of their own: they are CPU objects,
    and travel over gloo even when the default group is NCCL."""
    return default_backend != "gloo"


def rank_device(device: Device, env: Mapping[str, str]) -> torch.device:
    """The device this rank computes on: on cuda, the GPU of its LOCAL_RANK."""
    if device is Device.cuda:
        return torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def compute_dtype(mixed_precision: DType, device: Device) -> torch.dtype:
    """FSDP's parameter dtype in forward/backward (master weights stay fp32); auto is bfloat16 on
    cuda, float32 on cpu."""
    if mixed_precision is DType.auto:
        return torch.bfloat16 if device is Device.cuda else torch.float32
    return getattr(torch, mixed_precision.value)


class Ranks:
    """This process's place among the trainer ranks, and the collectives of the command channel
    (objects, a batch's CPU tensors, stats, barriers; all on the gloo control group, and no-ops on
    a single rank).

    Joins the default process group if one is initialised (torchrun, the role's entry point);
    otherwise creates a single-rank one (in-process HashStore), so 1 and N ranks share a code path.
    """

    def __init__(self, device: Device):
        self._own_group = False
        if not dist.is_initialized():
            dist.init_process_group(process_group_backend(device), store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        self.rank: int = dist.get_rank()
        self.world: int = dist.get_world_size()
        self._ctrl = dist.new_group(backend="gloo") if needs_control_group(dist.get_backend()) else None
        self.device = rank_device(device, os.environ)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (the argument of the other ranks is ignored)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ctrl)
        return box[0]

    def broadcast_tensors(self, tensors: Iterable[torch.Tensor], wait: bool = True) -> Callable[[], None]:
        """Rank 0's CPU `tensors` into every rank's tensors of the same shapes and dtypes, in place.
        Each is queued as soon as the iterable yields it, so rank 0 can make the next while gloo
        sends the last on its own thread (the iterable is drained on one rank too). Returns what
        waits for them all: with `wait=False` rank 0 may read its tensors meanwhile (not change
        them), since every later collective of the group queues behind the sends anyway."""
        works = [dist.broadcast(t, src=0, group=self._ctrl, async_op=True) if self.world > 1 else None for t in tensors]

        def done() -> None:
            for w in works:
                if w is not None:
                    w.wait()

        if wait:
            done()
        return done

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum a CPU tensor over the ranks, in place."""
        if self.world > 1:
            dist.all_reduce(tensor, group=self._ctrl)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Element-wise maximum of a CPU tensor over the ranks, in place."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._ctrl)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self._ctrl)

    def close(self) -> None:
        """Leave the process group if this object created it; otherwise wait for every rank."""
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False
        elif self.world > 1:
            dist.barrier(group=self._ctrl)


def leave_process_group() -> None:
    """The end of a rank whose work is done: destroy every process group (the default one, the
    gloo control group), which joins their threads (NCCL's watchdog and heartbeat monitor, gloo's
    workers) now. Left to the interpreter's teardown, a thread still joinable when its C++ owner is
    destroyed aborts the process ("terminate called without an active exception"): a finished rank
    would show as a failed pod, and the job would restart its gang and export again. Called by
    every rank after Trainer.close() / follow(), which end on a barrier, so no rank destroys a
    group another still uses."""
    if dist.is_initialized():
        dist.destroy_process_group()


def needs_sharding(world: int, compute: torch.dtype, params: set[torch.dtype]) -> bool:
    """Whether the model goes through FSDP2: with several ranks, or to compute in another dtype than
    its parameters (FSDP's mixed precision keeps fp32 masters). One rank computing in its
    parameters' dtype gets nothing from it, and pays its hooks, DTensor dispatch and per-tensor
    AdamW every step for the same step (docs/design.md, "Smaller measurements")."""
    return world > 1 or params != {compute}


def shard(model: LogProbModel, ranks: Ranks, dtype: torch.dtype) -> bool:
    """Returns False, leaving the model as it is, unless :func:`needs_sharding`. Otherwise FSDP2
    ``fully_shard`` over all ranks: a vision-language student's vision blocks, then its
    vision tower (patch embedding, position embedding, mergers), then each decoder layer, then the
    root (embedding, final norm and LM head); parameters compute in `dtype`, gradients reduce in
    fp32. The tower's own unit also casts the pixel rows to `dtype` as they enter it.

    A sharded vision tower gathers its parameters when it runs, so every rank must run it in the
    same micro-batches: the trainer runs it on a placeholder image where a rank has no image but
    another has (MicroBatch.touch_vision)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not needs_sharding(ranks.world, dtype, {p.dtype for p in model.parameters()}):
        return False
    mesh = init_device_mesh(ranks.device.type, (ranks.world,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = getattr(model.lm.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"spec.student.model: {type(model.lm).__name__} has no decoder .layers to shard")
    visual = model.vision_tower()
    if visual is not None:
        for block in getattr(visual, "blocks", []):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(visual, mesh=mesh, mp_policy=mp)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return True
