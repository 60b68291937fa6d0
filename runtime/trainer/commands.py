"""The rank-0-leads protocol: every collective runs on every rank in the same order.

Rank 0 (the only rank running the driver) broadcasts a :class:`Command` and its payload before each
collective call it makes; the other ranks wait in :meth:`CommandChannel.follow`, which looks the
command up in their handler table and runs it, until rank 0 sends ``close``. Commands travel as
pickled objects over the gloo control group (:class:`~kubedistill.runtime.trainer.distributed.Ranks`);
a batch's payload is only its small header, and its tensors follow with ``Ranks.broadcast_tensors``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

from kubedistill.runtime.trainer.distributed import Ranks


class Command(str, Enum):
    """A collective call of rank 0, named after the Trainer method that makes it."""

    step = "step"
    recompute_proximal = "recompute_proximal"
    named_full_weights = "named_full_weights"
    save_checkpoint = "save_checkpoint"
    resume = "resume"
    export_hf = "export_hf"
    close = "close"


Handler = Callable[[Any], object]
"""A follower's side of a command: called with the payload rank 0 broadcast (None if it sent none)."""


class CommandChannel:
    def __init__(self, ranks: Ranks):
        self._ranks = ranks

    def broadcast(self, command: Command, payload: Any = None) -> None:
        """Rank 0: tell the followers to run `command`; rank 0 then runs its own side."""
        if self._ranks.rank != 0:
            raise RuntimeError(f"Trainer.{command.value} is called on rank 0 only; other ranks run follow()")
        if self._ranks.world > 1:
            self._ranks.broadcast_object((command, payload))

    def follow(self, handlers: Mapping[Command, Handler]) -> None:
        """Ranks > 0: run each command rank 0 broadcasts through `handlers`, until (and including)
        ``close``."""
        missing = set(Command) - set(handlers)
        if missing:
            raise ValueError(f"CommandChannel.follow: no handler for {sorted(c.value for c in missing)}")
        while True:
            command, payload = self._ranks.broadcast_object(None)
            handler = handlers.get(command)
            if handler is None:
                raise RuntimeError(f"unknown trainer command {command!r}")
            handler(payload)
            if command is Command.close:
                return
