"""The student trainer (see trainer.py for the rank-0-leads protocol and the interfaces)."""

from kubedistill.runtime.trainer.trainer import Resumed, StepStats, Trainer

__all__ = ["Resumed", "StepStats", "Trainer"]
