"""The student trainer (see trainer.py for the rank-0-leads protocol, the interfaces and the
components)."""

from kubedistill.runtime.trainer.state import Resumed
from kubedistill.runtime.trainer.stats import StepStats
from kubedistill.runtime.trainer.trainer import Trainer

__all__ = ["Resumed", "StepStats", "Trainer"]
