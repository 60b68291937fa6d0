"""Environment servers the driver's multi-turn traces talk to (docs/design.md, "Multi-turn
rollouts with environments"): OpenEnv's protocol over a WebSocket session per episode."""

from kubedistill.runtime.environments.client import (
    REASONS,
    EnvironmentClient,
    EnvironmentConfig,
    EnvironmentPool,
    Environments,
    EpisodeFailed,
    StepResult,
)

__all__ = [
    "REASONS",
    "EnvironmentClient",
    "EnvironmentConfig",
    "EnvironmentPool",
    "Environments",
    "EpisodeFailed",
    "StepResult",
]
